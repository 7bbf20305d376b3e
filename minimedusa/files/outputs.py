"""Files written so that nothing a user has is lost: every file is written beside its final name
and renamed over it, so a run that fails, or is killed, leaves the previous file as it was,
never an empty or half-written one.

The name beside it is the writer's own (its process and a random part): two runs writing one
file at once never write into each other's temporary file; the last rename wins, whole. A file
the user names for output is checked before any work (check_writable): a run of minutes
should not find at its end that it cannot keep its result.
"""
import json
import os
import secrets
import sys
from pathlib import Path
from typing import IO

from minimedusa.errors import UserError


def followed(path: Path) -> Path:
    """`path` with the symbolic links on its way followed: where what is written to it lands.
    note: a file or folder is written beside its final name, then renamed onto it; onto a link
    that rename replaces the link (a file) or fails (a folder: "Not a directory", the finished
    work left beside the link). Beside the link's target it is one rename, in the target's
    own filesystem, and the link stays as it was."""
    return Path(os.path.realpath(path))


def aside(path: Path) -> Path:
    """A name beside `path` that is this writer's own."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")


def write_atomically(path: Path, write) -> None:
    """write(tmp) writes the file beside its final name, then it is renamed over `path`; if
    write fails, the temporary file is removed and `path` stays as it was."""
    path = followed(path)
    tmp = aside(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1) + "\n"))


def check_writable(path: Path, flag: str) -> None:
    """Refuse in one line, before any work, an output file that could not be written: a folder,
    a missing folder, a read-only file or folder, a read-only disk (a file is made beside it
    and removed: the test the final write will meet)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: there is no folder {path.parent} (make it first)")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is read-only")
    probe = aside(path)
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be written ({e.strerror or e})") from None


class KeptLines:
    """An output file of JSON lines written as a run goes, each line flushed as it is done,
    into PATH.partial beside it, and renamed over PATH when the run ends well. A run stopped
    however it stops (Ctrl-C, a full disk, a kill) leaves PATH as it was and PATH.partial
    holding every line it finished: the same command then resumes after them (`kept`, the
    lines whose "prompt" are the run's first `keys`, in order; a line cut short by the kill is
    dropped). Two runs writing one PATH at once: the second is refused in one line. A context
    manager: finished where its block ends well, stopped (the lines kept) where it raises."""

    def __init__(self, path: Path, flag: str, keys: list):
        check_writable(path, flag)
        self.path = followed(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.file = open(self.partial, "a+", encoding="utf-8")
        if not lock_file(self.file):
            self.file.close()
            raise UserError(f"{flag} {path} is being written by another run ({self.partial}): "
                            "wait for it to end, or give another file")
        self.kept = keep_matching_lines(self.partial, keys)  # appended after
        if self.kept:
            print(f"minimedusa: resuming after the {self.kept} of {len(keys)} answers kept in "
                  f"{self.partial}", file=sys.stderr)

    def write(self, text: str) -> None:
        """Write, as print() does to a file; a failed write names the file (a full disk)."""
        try:
            self.file.write(text)
        except OSError as e:
            raise UserError(f"cannot write {self.partial}: {e.strerror or e}") from None

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as e:
            raise UserError(f"cannot write {self.partial}: {e.strerror or e}") from None

    def __enter__(self) -> "KeptLines":
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            self.file.close()
        except OSError:  # the full disk's error is the one raised already
            pass
        lines = self.partial.stat().st_size > 0
        if kind is None:
            os.replace(self.partial, self.path)
        elif lines:
            print(f"minimedusa: the answers finished are kept in {self.partial}: the same "
                  "command resumes after them", file=sys.stderr)
        else:
            self.partial.unlink(missing_ok=True)


def keep_matching_lines(path: Path, keys: list) -> int:
    """How many of the file's first lines are whole JSON objects whose "prompt" is keys[0],
    keys[1], ... in order; the file cut after them (a line cut short, or of other prompts, is
    not kept)."""
    kept, end = 0, 0
    for line in path.read_bytes().splitlines(keepends=True):
        if kept == len(keys) or not line.endswith(b"\n"):
            break
        try:
            value = json.loads(line)
        except ValueError:
            break
        if not isinstance(value, dict) or value.get("prompt") != keys[kept]:
            break
        kept, end = kept + 1, end + len(line)
    os.truncate(path, end)
    return kept


def lock_file(file: IO) -> bool:
    """Take the open file's lock, without waiting: False if another process holds it. The
    operating system drops it when its process ends, however it ends."""
    try:
        import fcntl  # POSIX; elsewhere the file is not locked
    except ImportError:
        return True
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_locks: dict[Path, IO] = {}  # folder -> its lock file, held open for the process's life


def lock_folder(folder: Path, command: str) -> None:
    """Make `folder` (one line if it cannot be made) and hold its .lock for the rest of the
    process: a second run writing the same folder exits in one line naming the first's process,
    instead of mixing its checkpoints and shards with the first's. The operating system drops
    the lock when the process ends, however it ends: a killed run leaves no stale lock. A
    process that holds it already (a second run of main in one process) goes on. A link is
    followed: one to a folder not made yet makes that folder."""
    folder = followed(folder)
    if folder in _locks:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "a+")
    except OSError as e:
        raise UserError(f"--out {folder} cannot be made or written ({e.strerror or e})") from None
    try:
        import fcntl  # POSIX; elsewhere the folder is not locked
    except ImportError:
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        raise UserError(f"--out {folder} is being written by another {command} (process "
                        f"{holder}): wait for it to end, or give another --out") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _locks[folder] = lock


def check_out_is_not(out: Path, init: Path) -> None:
    if out.resolve() == init.resolve():
        raise UserError(f"--out {out} is the --init-heads folder: training writes a new "
                        "folder and never overwrites the heads it starts from")

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
from pathlib import Path
from typing import IO

from minimedusa.errors import UserError


def aside(path: Path) -> Path:
    """A name beside `path` that is this writer's own."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")


def write_atomically(path: Path, write) -> None:
    """write(tmp) writes the file beside its final name, then it is renamed over `path`; if
    write fails, the temporary file is removed and `path` stays as it was."""
    tmp = aside(Path(path))
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


class WrittenAside:
    """An output file written as a run goes (a JSON line per answer), into a file beside it;
    close() renames that into place where it holds something, else removes it: a run that fails
    before its first line leaves the user's file as it was, and one stopped later keeps the
    lines it finished."""

    def __init__(self, path: Path, flag: str):
        check_writable(path, flag)
        self.path, self.tmp = Path(path), aside(Path(path))
        self.file = open(self.tmp, "w", encoding="utf-8")

    def close(self) -> None:
        kept = self.file.tell() > 0
        self.file.close()
        if kept:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


_locks: dict[Path, IO] = {}  # folder -> its lock file, held open for the process's life


def lock_folder(folder: Path, command: str) -> None:
    """Make `folder` (one line if it cannot be made) and hold its .lock for the rest of the
    process: a second run writing the same folder exits in one line naming the first's process,
    instead of mixing its checkpoints and shards with the first's. The operating system drops
    the lock when the process ends, however it ends: a killed run leaves no stale lock. A
    process that holds it already (a second run of main in one process) goes on."""
    if folder.resolve() in _locks:
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
    _locks[folder.resolve()] = lock


def check_out_is_not(out: Path, init: Path) -> None:
    if out.resolve() == init.resolve():
        raise UserError(f"--out {out} is the --init-heads folder: training writes a new "
                        "folder and never overwrites the heads it starts from")

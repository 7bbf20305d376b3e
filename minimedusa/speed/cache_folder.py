"""The one folder where this machine's own measurements and builds are kept: the C kernels
(c_kernels.py), the step latencies (assembly/latency_cache.py) and large models' rounded weights
(kept_weights.py).

$MINIMEDUSA_CACHE, else $XDG_CACHE_HOME/minimedusa, else ~/.cache/minimedusa. Where it cannot be
written (a read-only home, MINIMEDUSA_CACHE naming a file, a full disk), decoding loses nothing
but time: the kernels are built into a folder of this process's own, removed at its exit, and
one line on stderr says so, once. Everything in the folder is safe to delete.

First runs overlap (a notebook and a terminal started together, a test runner's workers): what
one builds or converts, the others must wait for, not half-read or build again beside it.
one_at_a_time(folder, doing) holds the folder's lock while a process writes in it (the C
kernels, kept weights; files/default_model.py the default model's folder); the others wait,
saying so in one line, then find the work done. And what a run writes on the way lives in the
folder it writes, where the next holder of the lock removes it (its leftovers: a killed run's).
"""
import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

# the cache root -> the folder used for it in this process (itself, or a temporary stand-in)
_chosen: dict[Path, Path] = {}


def cache_root() -> Path:
    """$MINIMEDUSA_CACHE, else the user's cache folder's minimedusa/; a link followed (one to
    a folder not made yet is made where it points, not refused as a file in the way)."""
    root = os.environ.get("MINIMEDUSA_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimedusa"
    return Path(os.path.realpath(root))


def cache_folder() -> Path:
    """The cache root, made if missing, where a file can be written in it; else this process's
    own temporary folder (a line on stderr says why, once a process)."""
    root = cache_root()
    if root not in _chosen:
        problem = unwritable(root)
        _chosen[root] = root if problem is None else stand_in(root, problem)
    return _chosen[root]


def unwritable(folder: Path) -> str | None:
    """Why no file can be written in `folder` (made if missing), in words; None if one can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-")
        probe.close()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def stand_in(root: Path, problem: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="minimedusa-cache-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    print(f"minimedusa: the cache folder {root} cannot be written ({problem}): the C kernels are "
          "built for this run only and step latencies are not kept; set MINIMEDUSA_CACHE to a "
          "writable folder", file=sys.stderr)
    return folder


# the folders this process holds the lock of: a second one_at_a_time on one of them (a build
# inside a build) goes on, where a second flock would wait for itself
_held: set[Path] = set()


@contextlib.contextmanager
def one_at_a_time(folder: Path, doing: str):
    """Hold `folder`'s lock (made if missing) while the block runs; where another process holds
    it, wait, saying "waiting for another process {doing}" once. The lock is the operating
    system's (flock on the folder itself: no lock file), dropped when its process ends however
    it ends, so a lock left by a killed run is simply taken over. Without flock (not POSIX),
    no lock."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is None or key in _held:
        yield
        return
    handle = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"minimedusa: waiting for another process {doing} ...", file=sys.stderr,
                  flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        _held.add(key)
        try:
            yield
        finally:
            _held.discard(key)
    finally:
        os.close(handle)  # the lock goes with the last descriptor


def remove_leftovers(folder: Path, patterns: tuple[str, ...]) -> None:
    """Remove what killed runs left in `folder` (files or folders matching `patterns`): call it
    holding the folder's lock (one_at_a_time), when no run of this machine is writing there."""
    for pattern in patterns:
        for path in Path(folder).glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


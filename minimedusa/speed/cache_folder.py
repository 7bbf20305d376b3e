"""The one folder where this machine's own measurements and builds are kept: the C kernels
(c_kernels.py), the step latencies (cli/latency_cache.py) and large models' rounded weights
(kept_weights.py).

$MINIMEDUSA_CACHE, else $XDG_CACHE_HOME/minimedusa, else ~/.cache/minimedusa. Where it cannot be
written (a read-only home, MINIMEDUSA_CACHE naming a file, a full disk), decoding loses nothing
but time: the kernels are built into a folder of this process's own, removed at its exit, and
one line on stderr says so, once. Everything in the folder is safe to delete.
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# the cache root -> the folder used for it in this process (itself, or a temporary stand-in)
_chosen: dict[Path, Path] = {}


def cache_root() -> Path:
    root = os.environ.get("MINIMEDUSA_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimedusa"
    return Path(root)


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

"""Building this project's C kernels (attention_kernel.c, group_kernel.c) on the machine that
runs them, once, and loading them with ctypes.

The C compiler is the one torch.compile already needs (cc, or $CC), with -O3 -march=native:
a kernel is built for this CPU's vector units, into the user's cache folder, under a name that
holds a hash of its source, the flags and the CPU, so a shared home folder never hands one
CPU's binary to another. OpenMP where the compiler has it, else one thread. Each kernel module
loads its library at first use and keeps, for the process, the library or why there is none.
A cache folder's accidents cost a build, never the kernel: a library that does not load is built
again (once), and a failed build leaves nothing behind.
"""
import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

from minimedusa.speed.machine import cpu_features, cpu_model

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]


def kernels_folder() -> Path:
    """Where built kernels are kept: $MINIMEDUSA_CACHE, else the user's cache folder."""
    root = os.environ.get("MINIMEDUSA_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimedusa"
    return Path(root) / "kernels"


def compile_kernel(source: Path, compiler: str) -> Path:
    """`source` built for this machine, or the copy built before. Written beside its final
    name, then renamed (processes building it at once never read half a file); a failed build
    leaves nothing behind."""
    key = hashlib.sha256("\n".join([source.read_text(), compiler, *FLAGS, cpu_model(),
                                    cpu_features()]).encode()).hexdigest()[:16]
    path = kernels_folder() / f"{source.stem}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            build(source, compiler, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def build(source: Path, compiler: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile `source` into the library `out`, with OpenMP if the compiler has it; `extra`
    flags after this CPU's (tests build a kernel's AVX2 path on an AVX-512 CPU with
    -march=haswell: the last -march wins)."""
    for openmp in (["-fopenmp"], []):
        done = subprocess.run([compiler, *FLAGS, *extra, *openmp, str(source), "-o", str(out)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return
    said = done.stderr.strip()[:300]
    raise RuntimeError(f"{compiler} failed (exit status {done.returncode})"
                       + (f": {said}" if said else ""))


def load_library(source: Path) -> ctypes.CDLL:
    """The built `source` (OSError or RuntimeError if it cannot be built or loaded). A built
    library that does not load (a damaged file: a disk error, a copy cut short) is deleted and
    built again, once."""
    compiler = os.environ.get("CC", "cc")
    path = compile_kernel(source, compiler)
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(compile_kernel(source, compiler)))


def why_not(error: Exception) -> str:
    """An error of load_library, in one line."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"

"""Building this project's C kernels (attention_kernel.c, group_kernel.c) on the machine that
runs them, once, and loading them: with ctypes, and as torch operators (operators.cpp,
blocks_operator.cpp and draft_operator.cpp in one library, linked with both kernels' libraries,
loaded into torch by load_operators).

The C compiler is the one torch.compile already needs (cc, or $CC), with -O3 -march=native:
a kernel is built for this CPU's vector units, into the user's cache folder, under a name that
holds a hash of its source, the flags and the CPU, so a shared home folder never hands one
CPU's binary to another. OpenMP where the compiler has it, else one thread. Each kernel module
loads its library at first use and keeps, for the process, the library or why there is none.
A cache folder's accidents cost a build, never the kernel or the run: beside each library the
build writes, last, its size and sha256; a library that does not match them (cut short by a
full disk or an interrupted copy: it may still load, then fault on its first call) is never
loaded but built again, once, and a failed build leaves nothing behind. Processes that build
at once wait for the first (built: the folder's lock), and what a killed build left, the next
one removes.
The operators are C++ against torch's headers, with the kernels' flags (the C++ compiler
torch.compile needs too: c++, or $CXX): ~18 s to build on a 2-core CPU, once per machine, torch
version and kernels' sources.
"""
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from minimedusa.speed import sanitizer
from minimedusa.speed.cache_folder import cache_folder, one_at_a_time, remove_leftovers
from minimedusa.speed.machine import cpu_features, cpu_model, forced_avx2

def flags() -> list[str]:
    """The kernels' compiler flags: for this CPU's vector units, or an AVX2 CPU's where
    MINIMEDUSA_ISA=avx2 (machine.py); instrumented where MINIMEDUSA_SANITIZE asks
    (sanitizer.py)."""
    march = "-march=haswell" if forced_avx2() else "-march=native"
    return ["-O3", march, "-ffp-contract=off", "-shared", "-fPIC", *sanitizer.build_flags()]

HERE = Path(__file__).parent
KERNELS = (HERE / "group_kernel.c", HERE / "attention_kernel.c")  # what the operators call
# the operators' sources, built into one library: the products and the attention, the fused
# blocks, the Hydra draft (each includes operators.h)
OPERATORS = tuple(HERE / name for name in ("operators.cpp", "blocks_operator.cpp",
                                           "draft_operator.cpp"))


def kernels_folder() -> Path:
    """Where built kernels are kept: the cache folder's kernels/ (cache_folder.py), or
    kernels-address/ (...) for the sanitizers' instrumented builds."""
    return cache_folder() / f"kernels{sanitizer.folder_suffix()}"


def sources_digest() -> str:
    """12 hex digits of the kernels' and operators' sources: beside the machine, what a step's
    speed depends on (assembly/latency_cache.py keys its cached latencies with it, through
    plug_in.kernels_version: a changed kernel is timed anew)."""
    text = "\n".join(source_text(source) for source in (*KERNELS, *OPERATORS))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def source_text(source: Path) -> str:
    """A C source's text with the project's headers it includes (#include "name.h", beside
    it; theirs too): what its build is made of, so what its key and digest hash."""
    text = source.read_text()
    for header in re.findall(r'#include "([^"]+)"', text):
        text += source_text(source.parent / header)
    return text


def compile_kernel(source: Path, compiler: str) -> Path:
    """`source` built for this machine, or the copy built before."""
    return built(kernel_path(source, compiler), lambda out: build(source, compiler, out))


def kernel_path(source: Path, compiler: str) -> Path:
    """Where `source`'s library built for this machine is kept: named by a hash of what the
    build is made of (its text, the compiler, the flags, the CPU)."""
    key = hashlib.sha256("\n".join([source_text(source), compiler, *flags(), cpu_model(),
                                    cpu_features()]).encode()).hexdigest()[:16]
    return kernels_folder() / f"{source.stem}-{key}.so"


def built(path: Path, build_into) -> Path:
    """`path`, built by build_into(a file) unless a whole copy is there (is_whole). Built under
    the kernels folder's lock (cache_folder.one_at_a_time: processes that build at once wait for
    the first, then load what it built), in a folder of this build's own inside it, where the
    compiler's temporary files go too (run_compiler); renamed into place, then its digest. The
    next build removes what a killed one left there (its folder: an orphaned compiler's output
    then has nowhere to go)."""
    if is_whole(path):
        return path
    with one_at_a_time(path.parent, f"building {path.name}"):
        remove_leftovers(path.parent, (".build-*", "*.tmp"))
        if not is_whole(path):
            work = path.parent / f".build-{os.getpid()}"
            work.mkdir()
            try:
                build_into(work / path.name)
                digest = file_digest(work / path.name)
                os.replace(work / path.name, path)
                write_digest(path, digest)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return path


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    """"size sha256" of a file's bytes."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def write_digest(path: Path, digest: str) -> None:
    tmp = digest_path(path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest + "\n")
    os.replace(tmp, digest_path(path))


def is_whole(path: Path) -> bool:
    """Whether `path` holds what its build wrote: its size and sha256 those of the digest
    written beside it after it. note: a library cut short can keep its headers whole, so that it
    loads and faults later (a bus error, on every run): loading is no test of a library."""
    try:
        return path.is_file() and digest_path(path).read_text().strip() == file_digest(path)
    except (OSError, UnicodeDecodeError):
        return False


def build(source: Path, compiler: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile `source` into the library `out`, with OpenMP if the compiler has it; `extra`
    flags after this CPU's (tests build a kernel's AVX2 path on an AVX-512 CPU with
    -march=haswell: the last -march wins)."""
    for openmp in (["-fopenmp"], []):
        try:
            run_compiler([compiler, *flags(), *extra, *openmp, str(source), "-o", str(out)],
                         compiler)
            return
        except RuntimeError:
            if not openmp:
                raise


def load_library(source: Path) -> ctypes.CDLL:
    """The built `source` (OSError or RuntimeError if it cannot be built or loaded)."""
    sanitizer.ensure_runtime()  # an instrumented build loads only behind its runtime
    return ctypes.CDLL(str(compile_kernel(source, os.environ.get("CC", "cc"))))


# set by the first load_operators() of the process: "problem", None or why they did not load
_operators: dict = {}


def load_operators() -> str | None:
    """Load the operators' library (OPERATORS: built, with both kernels, at the first call of
    the process); None if they run, else why not in one line. The operators' schemas are
    Python's (group_kernel.py, attention_kernel.py): the library registers what they run."""
    if not _operators:
        try:
            torch.ops.load_library(str(compile_operators()))
            _operators["problem"] = None
        except (OSError, RuntimeError) as e:
            _operators["problem"] = why_not(e)
    return _operators["problem"]


def compile_operators() -> Path:
    """The operators (OPERATORS) built against this torch and linked with the kernels'
    libraries, found beside it by name (their names hold their hashes: one built from other sources is another
    file), or the copy built before. The kernels are loaded first (load_library: a damaged one
    is built again, not linked)."""
    kernels = [Path(load_library(source)._name) for source in KERNELS]  # CDLL._name: its path
    compiler = os.environ.get("CXX", "c++")
    torch_folder = Path(torch.__file__).parent
    # the kernels' flags (the block's elementwise loops vectorised for this CPU, no fused
    # multiply-adds the reference does not make), and -fno-trapping-math: a clamp in a loop
    # becomes a vector blend, the values the same. The CPU is in the key through the kernels'
    # names.
    options = [*flags(), "-fno-trapping-math", "-std=c++17", f"-I{torch_folder / 'include'}",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    links = [f"-L{torch_folder / 'lib'}", "-ltorch_cpu", "-lc10", f"-L{kernels_folder()}",
             *(f"-l:{kernel.name}" for kernel in kernels), "-Wl,-rpath,$ORIGIN"]
    key = hashlib.sha256("\n".join([*map(source_text, OPERATORS), compiler, *options,
                                    torch.__version__,
                                    *(kernel.name for kernel in kernels)]).encode()
                         ).hexdigest()[:16]
    return built(kernels_folder() / f"operators-{key}.so", lambda out: run_compiler(
        [compiler, *options, *map(str, OPERATORS), *links, "-o", str(out)], compiler))


def run_compiler(command: list[str], compiler: str) -> None:
    """Run the compiler; its temporary files beside its output (command's -o), not in the
    system's temporary folder, where a killed compile would leave them."""
    output = Path(command[command.index("-o") + 1])
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(output.parent)})
    if done.returncode != 0:
        said = done.stderr.strip()[:300]
        raise RuntimeError(f"{compiler} failed (exit status {done.returncode})"
                           + (f": {said}" if said else ""))


def why_not(error: Exception) -> str:
    """An error of load_library or load_operators, in one line."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"

"""The C kernels and operators under a memory checker: MINIMEDUSA_SANITIZE=address (GCC's and
Clang's AddressSanitizer: a read or write outside an allocation stops the process with a report),
undefined (UndefinedBehaviorSanitizer: an overflowing shift, a misaligned load) or both,
"address,undefined". llama.cpp's CI builds so (LLAMA_SANITIZE_ADDRESS, _UNDEFINED); here:

    MINIMEDUSA_SANITIZE=address python -m pytest -q -m kernels

Every kernel and operator is then built instrumented (c_kernels.py adds build_flags()) into a
cache folder of its own (kernels-address/, beside kernels/: the normal builds are never
replaced), and the sanitizers' runtime is loaded as a Python process must load it: first, before
any library (the interpreter itself is not instrumented, so the runtime cannot come in later
with the kernels' libraries, as it would in a program built with -fsanitize). So the process
re-executes itself once, under LD_PRELOAD naming the runtime
libraries the C compiler ships (`cc -print-file-name=libasan.so`), with the options that make a
Python process checkable: leaks not reported (the interpreter keeps its objects to the end),
the first report fatal. ensure_runtime does it, before the first kernel loads (c_kernels.py),
and the test suite calls it first (tests/conftest.py's pytest_configure, after giving pytest's
captured standard output and error back: the new process inherits them, and would otherwise
write its summary and the sanitizer's report into pytest's capture files, never read).
"""
import os
import subprocess
import sys

from minimedusa.errors import UserError

VARIABLE = "MINIMEDUSA_SANITIZE"
RUNTIMES = {"address": "libasan.so", "undefined": "libubsan.so"}  # sanitizer -> its library
# note: AddressSanitizer finds C++'s __cxa_throw when it starts, in the libraries loaded then;
# the interpreter links no libstdc++, so it is preloaded after the runtime (without it, the
# first C++ exception, an operator's one-line refusal, aborts the process)
CXX_RUNTIME = "libstdc++.so.6"
# detect_leaks=0: CPython and torch free little at exit, which LeakSanitizer would report as
# leaks of the kernels' callers; halt_on_error: the first bad access stops the process
# (the test run fails, naming AddressSanitizer), a later one could be the first's echo
OPTIONS = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def sanitizers() -> tuple[str, ...]:
    """The sanitizers MINIMEDUSA_SANITIZE asks for, in a fixed order: () when it is unset."""
    names = {name.strip() for name in os.environ.get(VARIABLE, "").split(",") if name.strip()}
    unknown = sorted(names - set(RUNTIMES))
    if unknown:
        raise UserError(f"{VARIABLE}={os.environ[VARIABLE]!r}: {', '.join(unknown)} is not a "
                        "sanitizer here; use address, undefined or address,undefined")
    return tuple(name for name in RUNTIMES if name in names)


def build_flags() -> list[str]:
    """The compiler flags of the sanitizers asked for ([] for none): every report fatal, frames
    kept so that a report names the kernel's functions and lines."""
    chosen = sanitizers()
    if not chosen:
        return []
    return [f"-fsanitize={','.join(chosen)}", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"]


def folder_suffix() -> str:
    """"" or "-address", "-address-undefined": the kernels' cache folder's, so that an
    instrumented build never stands where the normal one is looked for."""
    return "".join(f"-{name}" for name in sanitizers())


def runtime_libraries(compiler: str) -> list[str]:
    """The runtime libraries of the sanitizers asked for, as the compiler ships them, and
    libstdc++ where AddressSanitizer is one (CXX_RUNTIME)."""
    names = [RUNTIMES[name] for name in sanitizers()]
    names += [CXX_RUNTIME] if "address" in sanitizers() else []
    paths = []
    for name in names:
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                               text=True).stdout.strip()
        if not os.path.isabs(found):  # the compiler echoes the bare name when it has none
            raise UserError(f"{VARIABLE}: {compiler} has no {name} (install its sanitizer "
                            "runtime, e.g. Debian's libasan8 / libubsan1)")
        paths.append(os.path.realpath(found))
    return paths


def runtime_wanted() -> bool:
    """Whether sanitizers are asked for and their runtime is not in this process yet: what
    ensure_runtime re-executes the process for."""
    return not all(runtime_loaded(name) for name in sanitizers())


def ensure_runtime(more_arguments: tuple[str, ...] = ()) -> None:
    """Where sanitizers are asked for and their runtime is not in this process, re-execute the
    process (the same interpreter and arguments, and `more_arguments`) with it preloaded.
    Nothing when none are asked for, or when the runtime is in place already (its children
    inherit it)."""
    if not runtime_wanted():
        return
    libraries = runtime_libraries(os.environ.get("CC", "cc"))
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    env = dict(os.environ, LD_PRELOAD=" ".join([*libraries, *preloaded]))
    for name, value in OPTIONS.items():
        env.setdefault(name, value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:], *more_arguments], env)


def runtime_loaded(name: str) -> bool:
    """Whether the sanitizer's runtime library is mapped into this process."""
    with open("/proc/self/maps") as maps:
        return f"/{RUNTIMES[name].removesuffix('.so')}.so" in maps.read()

"""The compiled step's attention: attention_kernel.c, model.exact_attention's twin in C.

A decoding step attends its 1 (plain) or n + 1 (tree) rows to every cached key in each block.
model.exact_attention does it in float64 PyTorch so that a row's output never depends on where
its keys sit in the cache (what keeps greedy Medusa lossless), at ~150 us a block on a 2-core
CPU, converting the whole cache to float64 every time. The C twin gets the same guarantee from
float32 arithmetic in a fixed order (the .c file says how), at a few us: 1 and 9 rows after 265
keys took 20 and 88 us on the 2-core AVX-512 EPYC, against 97 and 243 for the reference.

Built at first use with the C compiler torch.compile already needs (cc, -O3 -march=native), into
the user's cache folder, per source and machine; called through ctypes from a torch operator, so
that compiled graphs call it as they call oneDNN's products (packed_linear.py). It serves
bfloat16 and float32 rows of one sequence with a head dim up to 256; anything else (float64
test models, batches, long prompts) keeps the reference. Outside compiled graphs (the prompt's
prefill, a compiled model run eagerly) the reference runs: eager decoding stays the reading path.
tests/test_attention_kernel.py checks it against the reference and the row property itself.

Shapes: H query heads, G key/value heads, T rows, S attended slots, D head dim.
"""
import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

import torch

from minimedusa.device import cpu_features, cpu_model
from minimedusa.model import exact_attention

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
MAX_D = 256  # attention_kernel.c's MAX_D


class Step(ctypes.Structure):
    """attention_kernel.c's Step: the tensors' addresses, sizes and strides (in elements)."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("out", ctypes.c_void_p),
                *[(name, ctypes.c_int64) for name in
                  ("H", "G", "T", "S", "D", "q_head", "q_row", "kv_head", "out_head", "out_row")],
                ("bf16", ctypes.c_int), ("scale", ctypes.c_float)]


def kernels_folder() -> Path:
    """Where built kernels are kept: $MINIMEDUSA_CACHE, else the user's cache folder."""
    root = os.environ.get("MINIMEDUSA_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimedusa"
    return Path(root) / "kernels"


def compile_kernel(compiler: str) -> Path:
    """attention_kernel.c built for this machine (-march=native), or the copy built before: its
    name holds a hash of the source, the flags and the CPU, so a shared home folder never hands
    one CPU's binary to another. Written beside its final name, then renamed."""
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, *FLAGS, cpu_model(),
                                    cpu_features()]).encode()).hexdigest()[:16]
    path = kernels_folder() / f"attention-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        # OpenMP where the compiler has it (threads for big trees); without, one thread
        for openmp in (["-fopenmp"], []):
            done = subprocess.run([compiler, *FLAGS, *openmp, str(SOURCE), "-o", str(tmp)],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, path)
    return path


def load_kernel():
    """The built kernel's `attend` function (OSError or RuntimeError if it cannot be built)."""
    library = ctypes.CDLL(str(compile_kernel(os.environ.get("CC", "cc"))))
    attend = library.attend
    attend.argtypes, attend.restype = [ctypes.POINTER(Step)], ctypes.c_int
    return attend


# the kernel, loaded at the first kernel_problem() of the process: "attend", the function, or
# "problem", why there is none
_kernel: dict = {}


def kernel_problem() -> str | None:
    """None if the kernel is built and loaded (at the first call), else why not in one line."""
    if not _kernel:
        try:
            _kernel["attend"] = load_kernel()
        except (OSError, RuntimeError) as e:
            _kernel["problem"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return _kernel.get("problem")


@torch.library.custom_op("minimedusa::step_attention", mutates_args=())
def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """exact_attention's output (1, H, T, D) from the C kernel; q (1, H, T, D), k and v
    (1, G, S, D) with each key a contiguous row of D (cache slices), mask (1, 1, T, S) bool."""
    _, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    out = new_output(q)
    mask = mask.contiguous()
    step = Step(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(),
                H, G, T, S, D, q.stride(1), q.stride(2), k.stride(1), out.stride(1),
                out.stride(2), q.dtype == torch.bfloat16, D ** -0.5)
    if _kernel["attend"](ctypes.byref(step)) != 0:
        raise MemoryError("attention_kernel.c could not allocate its scores")
    return out


def new_output(q: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) laid out as (1, T, H, D): the block's next reshape to (1, T, H * D) is then
    a view, not a copy."""
    _, H, T, D = q.shape
    return q.new_empty(1, T, H, D).transpose(1, 2)


@step_attention.register_fake
def _(q, k, v, mask):  # its output's shape and strides, for the compiler's tracing
    return new_output(q)


def kernel_attention(q, k, v, mask):
    """model.exact_attention, by the C kernel inside a compiled step where it serves the
    tensors; the reference everywhere else (see the module's docstring)."""
    serves = (torch.compiler.is_compiling() and q.dtype in (torch.bfloat16, torch.float32)
              and q.shape[0] == 1 and q.shape[-1] <= MAX_D and k.dtype == q.dtype
              and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
              and v.stride() == k.stride() and q.stride(-1) == 1)
    return step_attention(q, k, v, mask) if serves else exact_attention(q, k, v, mask)


def use_kernel(model) -> str | None:
    """Swap the C kernel into every block of `model` (its attention's exact_attention); None
    if done, else why not (the blocks keep the reference)."""
    problem = kernel_problem()
    if problem is None:
        for block in model.layers:
            block.attn.exact_attention = kernel_attention
    return problem

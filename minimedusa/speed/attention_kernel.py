"""The compiled step's attention: attention_kernel.c, model.exact_attention's twin in C.

A decoding step attends its 1 (plain) or n + 1 (tree) rows to every cached key in each block.
model.exact_attention does it in float64 PyTorch so that a row's output never depends on where
its keys sit in the cache (what keeps greedy Medusa lossless), at ~150 us a block on a 2-core
CPU, converting the whole cache to float64 every time. The C twin gets the same guarantee from
float32 arithmetic in a fixed order (the .c file says how), with LANES keys side by side in a
vector (16 with AVX-512, 8 with AVX2): each key/value head's keys are turned over once a call, and
its rows, 4 at a time, share each read of them. Measured on the 2-core Zen 5, the default model's
whole forward (int4, fused), the previous version (rows side by side: a plain step's 3 rows of a
group filled 3 of 16 lanes) and this one in alternate processes, 3 each: after 256 cached tokens 1
row 3.43-3.62 ms against 3.11-3.29 now, 8 rows 6.05-6.23 against 5.89-6.00; after 1,536, 6.33-6.96
against 4.84-5.13 and 11.13-11.16 against 9.23-9.39. The same bits.

Built at first use (c_kernels.py: the C compiler torch.compile already needs, -march=native, the
user's cache folder); called through a torch operator (its schema and shape here, what it runs in
operators.cpp), so that compiled graphs call it as they call oneDNN's products
(packed_linear.OPERATORS). It serves bfloat16 and float32 rows of one sequence or of a batch's
(each its own keys, its row's bits those it has alone) with a head dim up to 256; anything else
(float64 test models, long prompts) keeps the reference. Outside
compiled graphs (the prompt's prefill, a compiled model run eagerly) the reference runs: eager
decoding stays the reading path.
tests/test_attention_kernel.py checks it against the reference, the row property itself, and that
its AVX2 build gives the same bits.

Shapes: H query heads, G key/value heads, T rows, S attended slots, D head dim.
"""
from pathlib import Path

import torch
import torch.nn as nn

from minimedusa.speed.c_kernels import load_library, load_operators, why_not
from minimedusa.model import exact_attention
from minimedusa.speed.packed_linear import OPERATORS

SOURCE = Path(__file__).with_suffix(".c")
MAX_D = 256  # attention_kernel.c's MAX_D


# set at the first kernel_problem() of the process: "problem", None or why there is no kernel
_kernel: dict = {}


def kernel_problem() -> str | None:
    """None if the kernel is built and loaded and its operator runs (at the first call), else
    why not in one line."""
    if not _kernel:
        try:
            load_library(SOURCE)  # built for this CPU and loaded
            _kernel["problem"] = load_operators()
        except (OSError, RuntimeError) as e:
            _kernel["problem"] = why_not(e)
    return _kernel["problem"]


# exact_attention's output (B, H, T, D) from the C kernel; q (B, H, T, D), k and v (B, G, S, D)
# with each key a contiguous row of D (cache slices), mask (B or 1, 1, T, S) bool
OPERATORS.define("step_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor")


def new_output(q: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) laid out as (B, T, H, D): the block's next reshape to (B, T, H * D) is then
    a view, not a copy."""
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2)


@torch.library.register_fake("minimedusa::step_attention")
def _(q, k, v, mask):  # its output's shape and strides, for the compiler's tracing
    return new_output(q)


class KernelAttention(nn.Module):
    """model.ExactAttention's twin: the C kernel inside a compiled step where it serves the
    tensors; the reference everywhere else (see the module's docstring)."""

    def forward(self, q, k, v, mask):
        # every sequence of a batch too: a batch's row then attends as it would alone (the
        # reference's float64 sums round otherwise than the kernel's float32 ones)
        serves = (torch.compiler.is_compiling() and q.dtype in (torch.bfloat16, torch.float32)
                  and q.shape[-1] <= MAX_D and k.dtype == q.dtype
                  and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
                  and v.stride() == k.stride() and q.stride(-1) == 1)
        if serves:
            return torch.ops.minimedusa.step_attention(q, k, v, mask)
        return exact_attention(q, k, v, mask)


def use_kernel(model) -> str | None:
    """Swap the C kernel into every block of `model` (its attention's ExactAttention module);
    None if done, else why not (the blocks keep the reference)."""
    problem = kernel_problem()
    if problem is None:
        for block in model.layers:
            block.attn.exact = KernelAttention()
    return problem

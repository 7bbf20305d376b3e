"""Speed, plugged into a loaded model in one call, as gpt-fast's _load_model swaps its quantized
layers after building the model: model.py and decoding.py never learn that a C kernel or a
compiled graph exists.

    step = plug_in(model, INT4, compile_flag=None)   # "fused (the blocks one C++ call)"

1. the weight format (weight_formats.py): prepacked, quantized or 4-bit layers swapped in;
2. the step: where the blocks' products are group_kernel.c's int4 layers, each block swapped
   for one C++ call (fused_block.py); elsewhere the compiled step
   (compiled_step.py): each block swapped for a compiled one, its attention for the C kernel
   (attention_kernel.py), where a C++ compiler works; on CUDA, the blocks (compiled where
   torch.compile works) replayed from CUDA graphs (cuda_graphs.py).
And the heads, in the model's format: plug_in_heads; their draft one C++ call where it runs:
fused_draft.fast_draft, where the draft is made.
how_it_runs(model) then says in words what was plugged in: the key step latencies are kept
under (assembly/latency_cache.py) names it, so a latency measured for one way of running is never used
for another.
"""
import sys
from contextlib import contextmanager

import torch
import torch.nn as nn

from minimedusa.model import Blocks, Llama
from minimedusa.speed import c_kernels
from minimedusa.speed.attention_kernel import KernelAttention, kernel_problem
from minimedusa.speed.compiled_step import (CompiledBlock, compile_blocks, compiler_problem,
                                           is_compiled, warm_up)
from minimedusa.speed.cuda_graphs import graph_step, is_graphed
from minimedusa.speed.fused_block import fusable, fuse_blocks, is_fused
from minimedusa.speed.group_kernel import uses_tiles, uses_vnni
from minimedusa.speed.packed_linear import MIN_ROWS, PackedLinear
from minimedusa.speed.quantized import (BF16KernelLinear, Int4A8KernelLinear,
                                        Int4A16KernelLinear, Int4KernelLinear, Int4Linear,
                                        Int8A16GroupLinear, Int8GroupLinear, Int8Linear)
from minimedusa.speed.weight_formats import apply_format, weight_format


def plug_in(model: Llama, fmt, compile_flag: bool | None) -> str:
    """Make a loaded model fast in place: its weight format `fmt` (weight_formats.py's), then
    its step as --compile asks
    (None: on a CPU fused where fused_block.fusable, else compiled where a compiler works; on
    CUDA in CUDA graphs, of compiled blocks where torch.compile works there, else of the eager
    blocks; True: compiled, in CUDA graphs on CUDA; False: eager).
    Returns how the step runs, in words: "fused (the blocks one C++ call)", "compiled (warm-up
    3.4 s)", "CUDA graphs of the compiled blocks (9 captured in 6.1 s)", or "eager" and why."""
    apply_format(model, fmt)
    if compile_flag is False:
        return "eager (--no-compile)"
    device = model.embed.weight.device
    if device.type == "cuda":  # the host's dispatch is the step's cost there
        # compiled blocks in the graphs where torch.compile works (Triton's kernels: fewer of
        # them, a faster step), else the eager blocks
        return graph_step(model, compiled=compile_flag or compiler_problem(device) is None)
    if compile_flag is None and fusable(model) is None:  # int4 and w4a8: nothing to compile
        fuse_blocks(model)
        return "fused (the blocks one C++ call)"
    problem = compiler_problem()
    if problem is not None:
        print(f"minimedusa: torch.compile does not work here, decoding eagerly ({problem})",
              file=sys.stderr)
        return "eager (no working compiler)"
    compile_blocks(model)
    kernel = kernel_problem()
    attention = "" if kernel is None else f"; attention in PyTorch, no C kernel: {kernel}"
    return f"compiled (warm-up {warm_up(model):.1f} s{attention})"


@contextmanager
def eager_step(model: Llama):
    """The model's decoding step eager for a while, as --no-compile runs it (bench's "(eager)"
    engines, the reference check): its blocks one after another (not fused, no CUDA graph
    replayed), compiled graphs not run; all kept for after."""
    fast = model.layers
    model.layers = Blocks(fast)  # the same Block modules (or compiled blocks: run eagerly)
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.layers = fast


def unplug_step(model: Llama) -> None:
    """The model's decoding step eager for good, its weight format kept: what --no-compile
    would have made (the reference check's way back from a step that fails it)."""
    model.layers = Blocks([layer.block if isinstance(layer, CompiledBlock) else layer
                           for layer in model.layers])


def plug_in_heads(heads: nn.Module, model: Llama) -> nn.Module:
    """The heads (float32, as loaded) in the weight format plug_in put the model in (their
    draft, one C++ call where fused_draft.fusable_draft lets it, is fused_draft.fast_draft's)."""
    return apply_format(heads, weight_format(model))


def how_it_runs(model: Llama) -> str:
    """What sets a step's cost beside the machine, in words: the weight format (and which
    kernel multiplies it), whether the step is compiled (and its attention the C kernel), how a
    block runs its products (how many, at least how many rows)."""
    block = model.layers[0]
    fmt = weight_format(model)
    weights = f" | {fmt.name} weights" if fmt.rounds else ""  # the dtype says the rest
    if any(isinstance(layer, BF16KernelLinear) for layer in block.modules()):
        weights = " | bfloat16 weights (group_kernel.c)"
    if any(isinstance(layer, Int4A8KernelLinear) for layer in block.modules()):
        weights += " (group_kernel.c, AVX-512 VNNI)" if uses_vnni() else " (group_kernel.c)"
    elif any(isinstance(layer, Int4KernelLinear) for layer in block.modules()):
        weights += " (group_kernel.c, AMX tiles)" if uses_tiles() else " (group_kernel.c)"
    for bits, kind in ((8, Int4A8KernelLinear), (16, Int4A16KernelLinear)):
        names = [name.rsplit(".", 1)[-1] for name, layer in block.named_modules()
                 if isinstance(layer, kind)]
        if names:  # w4a8: which products round their rows, and how, sets much of a step's cost
            weights += f", {bits}-bit activations in {' '.join(names)}"
    if isinstance(model.lm_head, Int8GroupLinear):
        weights += (", 8-bit LM head (16-bit activations)"
                    if isinstance(model.lm_head, Int8A16GroupLinear) else ", 8-bit LM head")
    step = " | compiled step" if is_compiled(model) else " | fused step" if is_fused(model) else ""
    if is_graphed(model):
        step = " | CUDA graphs" + (", compiled blocks" if model.layers.compiled else "")
    if any(isinstance(m, KernelAttention) for m in block.modules()):
        step += ", C attention"
    layers = [layer for layer in block.modules()
              if isinstance(layer, (nn.Linear, PackedLinear, Int8Linear, Int4Linear,
                                    Int4KernelLinear, BF16KernelLinear))]
    rows = (f", of >= {MIN_ROWS} rows" if any(isinstance(layer, PackedLinear) for layer in layers)
            else "")
    kernels = (f" | C kernels {kernels_version()}"
               if "group_kernel.c" in weights or "C attention" in step else "")
    return f"{weights}{step} | {len(layers)} products a block{rows}{kernels}"


def kernels_version() -> str:
    """A short hash of the C kernels' and their operators' sources: what a step costs changes
    with them (a faster attention makes a tree's rows cheaper), so latencies measured with other
    sources are not reused."""
    return c_kernels.sources_digest()[:8]

"""A compiled decoding step: the transformer block compiled by torch.compile (inductor), one
graph for all of the model's blocks, made before the run (warm-up) and cached on disk.

Why: around its 4 products, a block of the default model calls ~30 small operators (norms, RoPE,
the cache write, attention, SwiGLU), each a few microseconds of dispatch on a CPU, 30 blocks a
step; inductor fuses them into a few C++ loops. The products stay the weight format's own
(oneDNN's prepacked ones, int4's kernels), called as they are through this project's
operators (packed_linear.OPERATORS).
Why the block, not the whole step: the blocks share their code and shapes, so one graph serves
all 30 (their weights and caches are its inputs). Tracing one block takes a second where the
whole model took ~7 s, and inductor's disk cache keeps its C++: a later process loads it in
seconds. A whole-model graph with frozen weights ran ~15% faster a step here, but compiled for
~45 s per shape in every process (frozen graphs are not cached).
Shapes: T rows (1 for a plain step, n + 1 for a tree of n nodes) and S attended slots, which
grows every step. warm_up runs a plain step at two lengths, then two trees, in a cache whose
capacity is marked dynamic, so that torch makes S, the capacity and T (for T >= 2) dynamic: one
graph for plain steps, two for trees (small and not); after it no step of a run compiles again
(tests/test_compiled_step.py).
Each block is swapped for a CompiledBlock, which runs the graph for decoding's forwards (in
inference mode, at most model.EXACT_ATTENTION_TOKENS rows in all: a step, a tree, a short prompt,
a batch's step of a row a sequence, whose batch sizes are shapes of their own) and the eager
block for anything else (a long prompt, whose attention switches to SDPA, a branch the graph
would be traced again for; training), so model.py never learns that a graph exists. Eager stays
the reading path and the reference: compiled steps give its logits (tested).
On CUDA, cuda_graphs.py puts these compiled blocks inside CUDA graphs (--compile). Left out: the
heads' drafting.
Where a block's products are group_kernel.c's int4 layers (AVX2 or AVX-512 BF16 CPUs), all the
blocks in one C++ call are faster still and compile nothing (fused_block.py): plug_in uses that
there unless --compile is asked for."""
import time

import torch
import torch.nn as nn

from minimedusa.kv_cache import KVCache
from minimedusa.model import EXACT_ATTENTION_TOKENS, Block, Blocks, Llama, causal_mask
from minimedusa.speed.attention_kernel import use_kernel


def key_graphs_by_vector_width() -> None:
    """Name the vector width inductor generates C++ for in its settings, which key its cache.

    subtle: inductor keeps the C++ it generates in a cache on disk (/tmp/torchinductor_$USER,
    shared by every process of the user), under a key that holds its settings but not the
    vector unit it chose (torch's ATEN_CPU_CAPABILITY: avx2 or avx512 on one CPU; two machines
    sharing the folder). Code generated for 8 floats a vector, found there by a process that
    builds it for 16, stores 16 floats at every step of 8: past the end of its buffers (heap
    corruption: glibc's "free(): invalid pointer", the compiled step's batch after a run as an
    AVX2 CPU); the other way it fills half of each output (NaN logits). torch 2.13; the same
    with a function of three operators (tests/test_compiled_step.py). With the width among
    the settings (cpp.simdlen, what inductor would pick anyway), each width has its own key."""
    from torch._inductor import config, cpu_vec_isa
    isa = cpu_vec_isa.pick_vec_isa()
    if config.cpp.simdlen is None and isa:  # a CPU with no vector unit inductor knows: unkeyed
        config.cpp.simdlen = isa.bit_width()


def compiler_problem(device="cpu") -> str | None:
    """None if torch.compile works on this device, else why not in one line (no C++ compiler on
    a CPU, most often; no Triton on CUDA): a tiny function is compiled and run (cached after the
    first time)."""
    try:
        key_graphs_by_vector_width()  # inductor's choice of width compiles a test: in the try
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4, device=device))
        return None
    except Exception as e:  # whatever the toolchain raises: the step then stays eager
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


class CompiledBlock(nn.Module):
    """A block whose decoding forwards run one compiled graph (shared by every block of the
    model: their weights and caches are its inputs), and whose other forwards run eagerly."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block
        self.graph = torch.compile(block.forward, fullgraph=True)

    def forward(self, x, cos, sin, mask, cache, slots):
        B, T, _ = x.shape
        decoding = B * T <= EXACT_ATTENTION_TOKENS and torch.is_inference_mode_enabled()
        return (self.graph if decoding else self.block)(x, cos, sin, mask, cache, slots)


def compile_blocks(model: Llama) -> None:
    """Swap every block of the model for a CompiledBlock, its attention the C kernel where it
    builds (attention_kernel.py; else the reference).

    note: torch checks its guards on every call (the block's type, attributes and tensors,
    ~40 us on the 2-core EPYC, 1 ms a step): skipping the modules' guards would halve that, but
    then a graph made for one model's blocks would run another's (bench compiles one model per
    weight format in one process, and an int8 block is not a bfloat16 one)."""
    # every model compiled in a process adds its own few graphs (bench compiles one per
    # weight format); past torch's default limit of 8 it would fall back to eager, silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    key_graphs_by_vector_width()
    use_kernel(model)
    model.layers = Blocks([CompiledBlock(block) for block in model.layers])


def is_compiled(model: Llama) -> bool:
    """Whether compile_blocks compiled this model's blocks."""
    return isinstance(model.layers[0], CompiledBlock)


def warm_up(model: Llama) -> float:
    """Compile the graphs a run needs, before it; returns the seconds.

    A plain step (T = 1) at two cache lengths, then trees of 2 and of 4 rows, in a cache whose
    capacity is marked dynamic: torch then makes the length, the capacity and T >= 2 dynamic,
    so every later step, whatever its tree's size, finds its graph made (a prompt too, T rows
    into an empty cache); and a one-token prompt, whose one attended slot torch gives a graph
    of its own (it specializes sizes of 1). Five graphs: a plain step's first, at one length;
    a plain step's; trees (and prompts) of fewer than packed_linear.MIN_ROWS rows, which are
    padded; the other trees; the one-token prompt."""
    start = time.perf_counter()
    device = model.embed.weight.device
    # note: made outside inference mode, as decoding makes its caches: torch's graphs are
    # specific to that (an inference tensor lacks a dispatch key a normal one has)
    cache = KVCache.for_model(model, 48)
    for layer in cache.layers:
        torch._dynamo.mark_dynamic(layer.k, 2)
        torch._dynamo.mark_dynamic(layer.v, 2)
    for T, length in ((1, 8), (1, 9), (2, 8), (4, 8), (1, 0)):
        tokens = torch.zeros(1, T, dtype=torch.long, device=device)  # (1, T)
        positions = torch.arange(length, length + T, device=device)[None]  # (1, T)
        with torch.inference_mode():
            model(tokens, positions, causal_mask(length, T, device), cache,
                  cache.slots(length, T))
    return time.perf_counter() - start

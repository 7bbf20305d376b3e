"""A compiled decoding step: the transformer block compiled by torch.compile (inductor), one
graph for all of the model's blocks, made before the run (warm-up) and cached on disk.

Why: around its 7 products, a block of the default model calls ~30 small operators (norms, RoPE,
the cache write, attention, SwiGLU), each a few microseconds of dispatch on a CPU, 30 blocks a
step; inductor fuses them into a few C++ loops. The products stay oneDNN's prepacked ones,
called as they are (packed_linear.packed_product).
Why the block, not the whole step: the blocks share their code and shapes, so one graph serves
all 30 (their weights and caches are its inputs). Tracing one block takes a second where the
whole model took ~7 s, and inductor's disk cache keeps its C++: a later process loads it in
seconds. A whole-model graph with frozen weights ran ~15% faster a step here, but compiled for
~45 s per shape in every process (frozen graphs are not cached).
Shapes: T rows (1 for a plain step, n + 1 for a tree of n nodes) and S attended slots, which
grows every step. warm_up runs each step shape at two lengths and in two caches, so that torch
makes S, the cache's capacity and T (for T >= 2) dynamic: one graph for plain steps, one for
every tree; after it no step of a run compiles again (tests/test_compiled_step.py).
The prompt runs eagerly (decoding.prefill): its length is new with every prompt.
Eager stays the reading path and the reference: compiled steps give its logits (tested).
Left out: CUDA (CUDA graphs would be its way: mode="reduce-overhead"), the heads' drafting.
"""
import time

import torch

from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, causal_mask


def compiler_problem() -> str | None:
    """None if torch.compile works here, else why not in one line (no C++ compiler, most
    often): a tiny function is compiled and run (cached after the first time)."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4))
        return None
    except Exception as e:  # whatever the toolchain raises: the step then stays eager
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def compile_blocks(model: Llama) -> None:
    """Compile every block of the model in place (its forward becomes a compiled graph).

    note: guards on the blocks' attributes are skipped (the weights never change after
    loading): checking them on every call of every block would cost a fraction of a step."""
    for block in model.layers:
        block.compile(fullgraph=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


@torch.inference_mode()
def warm_up(model: Llama, tree_sizes) -> float:
    """Compile the graphs a run needs, before it: plain steps and trees of `tree_sizes` nodes,
    each at two cache lengths, in two caches of different capacities. Returns the seconds."""
    start = time.perf_counter()
    device = model.embed.weight.device
    rows = sorted({1, *(n + 1 for n in tree_sizes)})  # T of each step
    for capacity in (2 * max(rows) + 16, 2 * max(rows) + 32):
        cache = KVCache.for_model(model, capacity)
        for T in rows:
            for length in (8, 9):
                tokens = torch.zeros(1, T, dtype=torch.long, device=device)  # (1, T)
                positions = torch.arange(length, length + T, device=device)[None]  # (1, T)
                model(tokens, positions, causal_mask(length, T, device), cache,
                      cache.slots(length, T))
    return time.perf_counter() - start

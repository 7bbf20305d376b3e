"""The decoding step as CUDA graphs: on a GPU, each step's ~1,000 kernels launched at once.

Why: on a GPU the default model's step is ~1,000 small kernels (30 blocks of norms, RoPE, four
products, the cache write, attention, SwiGLU), each launched from Python; the GPU finishes each
long before the host has dispatched the next, so a step costs the host's dispatch, ~10x the
GPU's own work (records: the H100's and H200's step profiles). A CUDA graph records a step's
kernels once and replays them with one launch: the step then runs at the GPU's speed. This is
gpt-fast's way (there through torch.compile's mode="reduce-overhead"), written out by hand here
with torch.cuda.CUDAGraph so that a reader sees what a graph needs:

- Fixed shapes. One graph per shape: T rows of one sequence (1 for a plain step, n + 1 for a
  tree of n nodes), or T rows for each of a batch's B sequences (batch_decoding.py: a row each
  for plain steps, a tree each for Medusa's). The attended
  slots S grow every step, so a graph's attention reads the whole static cache, M slots, with
  the mask False past the sequence: the masked slots weigh exactly 0, and
  model.exact_attention's float64 sums keep the rows those of the eager step.
- Fixed addresses. A replay reads and writes the memory the capture used: each graph owns its
  inputs (the residual stream, RoPE's cos and sin, the mask, the slots), copied in before a
  replay, and its output. The KV cache is one static cache of M slots for each batch size,
  which every decoding run's cache of that many rows is given in turn ("held", StaticCache
  below); a held cache's compaction (KVCache.compact's ~120 copies) is a graph too.
- No host sync inside. Positions, slots and masks are device tensors (decoding.py builds them
  from the cache's host length), so a step's one sync stays the acceptance's.

What it swaps: the model's Blocks for GraphedBlocks (the embedding, the last norm and the LM
head stay eager: a few kernels); the heads' draft has graphs of its own (graphed_draft.py). A
shape's graph is captured the second time it is asked for (a tree's size recurs, a prompt's
length seldom does; the first time, the blocks it will hold run uncaptured: the same bits), a
plain step's and the Budget's tree sizes' up front (warm_up), and kept across prompts and chat
turns; a long prompt (more than MAX_ROWS tokens), a batch's prefill, training run the eager
blocks.
On a CPU the same code runs with nothing captured (capture() returns the function): the tests
check there that the static discipline gives the eager step's logits, and where CUDA is, that
the graphs do. Where torch.compile works (plug_in's default on CUDA, or --compile), the graphs
hold the compiled block (compiled_step.py: inductor's Triton kernels, fewer of them).

Shapes: B sequences, T rows each, C model dim, D head dim, G key/value heads, M static slots,
N tree nodes.
"""
import time
import warnings
import weakref
from collections import Counter

import torch
import torch.nn as nn

from minimedusa.budget import SIZES
from minimedusa.kv_cache import KVCache
from minimedusa.model import EXACT_ATTENTION_TOKENS, Blocks, Llama, causal_mask
from minimedusa.speed.compiled_step import CompiledBlock

# the most rows a step graph takes: the Budget's largest tree on a GPU (64 nodes) and its root;
# and the most sequences a batch's step graph takes (a row each)
MAX_ROWS, MAX_BATCH = 65, 64
SLOTS_GRAIN = 256  # the static cache's slots M: a multiple of this, so that few sizes occur
WARM_UP_RUNS = 2  # runs before a capture: cuBLAS's handles and workspaces are made outside it


def capture(run, device: torch.device, pool):
    """`run` (no arguments, touching only tensors that outlive it) recorded as a CUDA graph:
    returns its replay. On a CPU, `run` itself: the same buffers, nothing recorded."""
    if device.type != "cuda":
        return run
    side = torch.cuda.Stream(device)  # warm-ups on a side stream, as torch's docs ask
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARM_UP_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph.replay


class StaticCache:
    """The KV cache whose memory the graphs of caches of B rows read and write: M slots a
    layer. A decoding run's cache is held: its layers' tensors become the static ones (its
    entries copied in), and the cache held before gets its entries back in tensors of its own,
    so that any number of caches live (a chat's, a benchmark's), one decoding in the graphs at
    a time. Its graphs share a memory pool of their own."""

    def __init__(self, like: KVCache, slots: int):
        layer = like.layers[0].k
        self.pool = new_pool()
        with torch.inference_mode(False):  # decoding's caches are normal tensors: compact
            self.cache = KVCache(len(like.layers), layer.shape[0], layer.shape[1], slots,
                                 layer.shape[3], layer.device, layer.dtype)  # writes them
            # outside it
            # compaction's slots, from and to: the kept nodes', then the last slot's (which no
            # held cache reaches) onto itself
            self.src = torch.full((MAX_ROWS,), slots - 1, device=layer.device)  # (MAX_ROWS,)
            self.dst = self.src.clone()  # (MAX_ROWS,)
        self.held = lambda: None  # a weak reference to the cache held, once one is
        # KVCache.copy_slots moves each layer's keys and values in turn: ~120 kernels launched
        # from Python, a millisecond a Medusa step on a GPU, as one graph
        self.compaction = capture(lambda: self.cache.copy_slots(self.src, self.dst),
                                  layer.device, self.pool)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KVCache.copy_slots for the held cache (hold makes it that cache's): its entries at
        slots src (N,) to dst (N,), every layer's, one graph replayed."""
        n = src.numel()
        if n > MAX_ROWS:  # a tree too big for the step graphs: the core's own loop
            return KVCache.copy_slots(self.cache, src, dst)
        self.src[:n].copy_(src)
        self.dst[:n].copy_(dst)
        self.src[n:] = self.slots - 1
        self.dst[n:] = self.slots - 1
        self.compaction()

    @property
    def slots(self) -> int:
        return self.cache.capacity

    def holds(self, cache: KVCache) -> bool:
        """Whether the cache's entries are these static tensors (KVCache.keep_rows gives a
        batch's cache others)."""
        return cache.layers[0].k is self.cache.layers[0].k

    def hold(self, cache: KVCache) -> None:
        """Make `cache` the one whose entries live in the static tensors."""
        if self.holds(cache):
            return
        before = self.held()
        if before is not None and self.holds(before):
            give_back(before)
        elif before is not None and before.__dict__.get("copy_slots") == self.copy_slots:
            del before.copy_slots  # its rows left for tensors of their own: its own compaction
        n = cache.capacity  # (its tensors may hold more slots: a static cache's rows, kept)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.k[:, :, :n].copy_(theirs.k[:, :, :n])
            mine.v[:, :, :n].copy_(theirs.v[:, :, :n])
            theirs.k, theirs.v = mine.k, mine.v  # M slots: writes stay below its capacity
        # note: an instance's attribute before its class's method: the held cache's compaction
        # (KVCache.compact) now copies through the graph; give_back deletes it
        cache.copy_slots = self.copy_slots
        self.held = weakref.ref(cache)


def give_back(cache: KVCache) -> None:
    """A held cache's entries in tensors of its own again, its capacity's slots, and its own
    compaction."""
    with torch.inference_mode(False):
        for layer in cache.layers:
            layer.k = layer.k[:, :, :cache.capacity].clone()
            layer.v = layer.v[:, :, :cache.capacity].clone()
    cache.__dict__.pop("copy_slots", None)


class StepGraph:
    """One graph of the blocks over B sequences of T rows (one sequence's step or tree, or a
    batch's step, batch_decoding.py), with its own inputs and output. Captured with harmless
    inputs: each row attends to its own slot, among the last T of the static cache, which no
    held cache reaches (M >= its capacity + MAX_ROWS)."""

    def __init__(self, blocks: nn.Module, static: StaticCache, x, cos, sin, slots):
        B, T, M, device = x.shape[0], x.shape[1], static.slots, x.device
        tail = torch.arange(M - T, M, device=device)  # (T,)
        with torch.inference_mode(False):
            self.x = torch.zeros_like(x)  # (B, T, C): the residual stream in
            self.cos, self.sin = torch.zeros_like(cos), torch.zeros_like(sin)  # (B, 1, T, D)
            # (T,) the same slots in every row, or (B, T) each row its own (slots' shape)
            self.slots = tail.clone() if slots.dim() == 1 else tail.expand(B, T).clone()
            self.mask = torch.zeros(B, 1, T, M, dtype=torch.bool, device=device)
            self.mask[:, 0, torch.arange(T), tail] = True
            self.out = torch.zeros_like(x)  # (B, T, C)
        cache = static.cache

        def run():
            self.out.copy_(blocks(self.x, self.cos, self.sin, self.mask, cache, self.slots))
        self.replay = capture(run, device, static.pool)

    def __call__(self, x, cos, sin, mask, slots):
        """The blocks over these inputs: (B, T, C), this graph's output buffer (overwritten by
        its next replay: read it before)."""
        S = mask.shape[-1]
        self.x.copy_(x)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.mask[..., :S].copy_(mask)
        self.mask[..., S:] = False
        self.slots.copy_(slots)
        self.replay()
        return self.out


class GraphedBlocks(Blocks):
    """The model's blocks, whose decoding forwards (in inference mode, with a cache: one
    sequence of at most MAX_ROWS rows, or a batch's step of at most MAX_BATCH sequences, a row
    or a tree each) replay their shape's graph, whose other decoding forwards (a long prompt, a
    batch's row prefilled) run the blocks the graphs hold, uncaptured, and whose forwards
    outside decoding (training) run the eager blocks one after another (as Blocks)."""

    def __init__(self, blocks: Blocks, compiled: bool):
        super().__init__(blocks)  # the same Block modules: the state dict's names unchanged
        # inside the graphs: the blocks as they are, or each compiled (inductor's kernels); a
        # plain list, not a submodule: the same weights, named once
        self.inside = [Blocks([CompiledBlock(b) for b in blocks]) if compiled else
                       Blocks(blocks)]
        self.compiled = compiled
        # (B, T, slots' dims) -> its graph; forwards asked for: captured at the second
        self.graphs: dict[tuple, StepGraph] = {}
        self.asked = Counter()  # shapes not graphed yet -> forwards asked for
        self.statics: dict[int, StaticCache] = {}  # B -> the static cache of caches of B rows
        self.captures, self.capture_seconds = 0, 0.0

    def forward(self, x, cos, sin, mask, cache=None, slots=None):  # (B, T, C) -> (B, T, C)
        B, T, _ = x.shape
        # one sequence's step or tree; a batch's step, or its trees (experiments/batch_medusa.py:
        # within the exact attention's rows)
        fits = T <= MAX_ROWS and B <= MAX_BATCH and (B == 1 or B * T <= EXACT_ATTENTION_TOKENS)
        if cache is None or not torch.is_inference_mode_enabled():  # training, a whole text
            return super().forward(x, cos, sin, mask, cache, slots)
        # a cache of views of another's (a batch's row, KVCache.row: its prompt's prefill) is
        # never held: its writes must land in that cache's tensors.
        # subtle: what is not captured still runs the blocks the graphs hold, as a prompt alone
        # does: run eagerly, a batch's row prefilled its keys with other bits than the same
        # prompt alone, and its answer parted from it at the first near-tie
        if not fits or cache.layers[0].k._base is not None:
            return self.inside[0](x, cos, sin, mask, cache, slots)
        static = self.hold(cache)
        shape = (B, T, slots.dim())
        if shape not in self.graphs:
            self.asked[shape] += 1
            if self.asked[shape] < 2:  # a tree's size recurs, a prompt's seldom does
                # subtle: the blocks the graphs hold, uncaptured: a compiled block's bits are
                # not the eager block's, and a prompt run first eagerly (one engine's) and then
                # from its graph (another's) would leave different keys in their caches
                return self.inside[0](x, cos, sin, mask, cache, slots)
            start = time.perf_counter()
            self.graphs[shape] = StepGraph(self.inside[0], static, x, cos, sin, slots)
            self.captures, self.capture_seconds = (self.captures + 1,
                                                   self.capture_seconds + elapsed(start, x))
        return self.graphs[shape](x, cos, sin, mask, slots)

    def hold(self, cache: KVCache) -> StaticCache:
        """The cache's entries into the static cache of its rows, which grows (its graphs
        captured again) where this cache's capacity and a capture's rows do not fit."""
        B = cache.layers[0].k.shape[0]
        static = self.statics.get(B)
        if static is None or cache.capacity + MAX_ROWS > static.slots:
            if static is not None and static.held() is not None and static.holds(static.held()):
                give_back(static.held())
            slots = -(-(cache.capacity + MAX_ROWS) // SLOTS_GRAIN) * SLOTS_GRAIN
            static = self.statics[B] = StaticCache(cache, slots)
            self.graphs = {shape: g for shape, g in self.graphs.items() if shape[0] != B}
        static.hold(cache)
        return static


def new_pool():
    """A memory pool for graphs to share (captured one after another, replayed one at a time)."""
    return torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None


def elapsed(start: float, x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def graph_step(model: Llama, compiled: bool) -> str:
    """Swap the model's blocks for GraphedBlocks and capture a plain step's graph and the
    Budget's tree sizes' (warm_up); returns how the step runs, in words."""
    if compiled:
        # one compiled graph serves all blocks; each tree size and cache size is a shape
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # subtle: inside a fused kernel inductor keeps a bfloat16 result in float32 (no
        # rounding between the steps it fuses), so a row's bits would depend on what it chose
        # to fuse in each shape's graph; rounding where eager rounds makes them independent of
        # that (and nearer eager's). It came with the uncaptured forwards below; which of the
        # two the lossless answers need alone was not measured (weights/HISTORY.md)
        torch._inductor.config.emulate_precision_casts = True
        # inductor's note that it splits the attention's softmax over the static cache's slots:
        # nothing a user can act on
        warnings.filterwarnings("ignore", message="Online softmax is disabled")
    model.layers = GraphedBlocks(model.layers, compiled)
    warm_up(model)
    blocks = model.layers
    inside = "compiled blocks" if compiled else "eager blocks"
    return (f"CUDA graphs of the {inside} ({blocks.captures} captured in "
            f"{blocks.capture_seconds:.1f} s)")


def warm_up(model: Llama) -> None:
    """Capture the graphs of a plain step and of the Budget's tree sizes before a run, in a
    cache of up to 1,024 slots (a longer run's cache grows the static one: captured again)."""
    device = model.embed.weight.device
    capacity = min(1024, model.config.max_position_embeddings) - MAX_ROWS
    cache = KVCache.for_model(model, capacity)
    for T in (1, *(n + 1 for n in SIZES)) * 2:  # a row count is captured when asked again
        tokens = torch.zeros(1, T, dtype=torch.long, device=device)  # (1, T)
        positions = torch.arange(8, 8 + T, device=device)[None]  # (1, T): after 8 tokens
        with torch.inference_mode():
            model(tokens, positions, causal_mask(8, T, device), cache, cache.slots(8, T))


def is_graphed(model: Llama) -> bool:
    """Whether graph_step swapped this model's blocks."""
    return isinstance(model.layers, GraphedBlocks)

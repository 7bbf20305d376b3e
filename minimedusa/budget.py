"""The tree and its size for these heads on this machine (paper section 6, steps 2 and 3).

The tree is grown from the heads' calibration (tree_search.py measures it): assuming the heads
err independently, the node [i_1, ..., i_k] is accepted with probability prod_j a_j^(i_j), and
a step yields 1 + the sum of its nodes' probabilities tokens on average. Adding the most
probable node that hangs off the tree, repeatedly, gives the best tree of EVERY size at once
(a child is never more probable than its parent): its first n nodes.

The size, the budget: a bigger tree accepts more tokens per step, but each step costs more;
where the balance lies is a fact of the machine (its vector units, memory bandwidth, caches),
not of its name: the 4-node tree tuned on one 2-core "AMD EPYC" ran at 0.97x plain decoding on
another that reports the same name but has AVX2 only. So nothing here is assumed from elsewhere:
1. The step latency of each tree size, plain decoding (size 0) included, is measured at first
   use on this machine (a few seconds) and cached per machine key (device.machine_key) under
   the user's cache folder, never in the repository.
2. During decoding a Budget keeps measuring: every step's time, and for every smaller size
   nested in the tree it ran, how many tokens that size would have yielded. It runs the size
   with the most tokens per second, plain decoding being one of the choices (a run starts
   there, and moves only for a clear gain), and times each neighbouring size for a few steps,
   so a wrong prior (latencies measured on another machine, or under other load) costs a
   handful of steps, not the run.
The sizes are nested trees, the first n grown nodes, so a step of n nodes also shows what
every size below n would have accepted.

Shapes: K heads, R ranks calibrated (top-R guesses per head).
"""
import contextlib
import heapq
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.nn as nn

from minimedusa.acceptance import greedy
from minimedusa.attention_kernel import kernel_attention
from minimedusa.compiled_step import is_compiled
from minimedusa.decoding import decode_step, draft, medusa_step, new_cache, prefill
from minimedusa.draft_layer import HydraPlusPlusHeads, new_draft_cache, read_accepted
from minimedusa.device import machine_key
from minimedusa.tree import MedusaTree, build_tree
from minimedusa.packed_linear import MIN_ROWS, PackedLinear
from minimedusa.weight_formats import (Int4KernelLinear, Int4Linear, Int8GroupLinear, Int8Linear,
                                       format_of)

CALIBRATION = "calibration.json"  # a_k^(i), beside the heads (tree_search.py measures it)

# the tree sizes to choose from, doubling (few sizes: few probing steps): beyond 64 nodes the
# paper's GPU was already compute bound, and a CPU long before; and 3, the most nodes whose
# step (4 rows) int4's kernel multiplies in one pass over the weights (weight_formats.py)
SIZES = (1, 2, 3, 4, 8, 16, 32, 64)


def read_calibration(heads_dir: Path) -> torch.Tensor | None:
    """The heads' a_k^(i) (K, R) from their calibration.json, or None if not calibrated."""
    path = Path(heads_dir) / CALIBRATION
    return torch.tensor(json.loads(path.read_text())["accuracy"]) if path.is_file() else None


# --- the tree: grown from the calibration ---------------------------------------------------------

def grow_tree(accuracy: torch.Tensor, budget: int) -> tuple[list[tuple], list[float]]:
    """The `budget` most probable node paths, in the order added, and each one's probability.

    accuracy (K, R): a_k^(i). Every prefix of the returned list is the best tree of its size.
    """
    a = accuracy.tolist()
    K, R = len(a), len(a[0])
    frontier = [(-a[0][i], (i,)) for i in range(R)]  # (-probability, path): children of the root
    heapq.heapify(frontier)
    nodes, probs = [], []
    while frontier and len(nodes) < budget:
        neg_p, path = heapq.heappop(frontier)  # ties: the shorter/lower-ranked path, a parent
        nodes.append(path)
        probs.append(-neg_p)
        if len(path) < K:  # its children: the guesses of the next head
            for i in range(R):
                heapq.heappush(frontier, (neg_p * a[len(path)][i], path + (i,)))
    return nodes, probs


def expected_length(probs: list[float]) -> float:
    """Expected tokens per step of a tree whose nodes have these probabilities."""
    return 1.0 + sum(probs)


def expected_length_of(nodes, accuracy: torch.Tensor) -> float:
    """Expected tokens per step of any tree (node paths), under the same independence; a
    guess ranked past the calibrated ones counts as never right."""
    a, R = accuracy.tolist(), accuracy.shape[1]
    probs = [math.prod(a[j][i] if i < R else 0.0 for j, i in enumerate(path)) for path in nodes]
    return expected_length(probs)


def pick_budget(probs: list[float], latency: dict[int, float]) -> tuple[int, dict]:
    """(the size with the most expected tokens/s, a table of every size's estimate)."""
    table = {}
    for n, seconds in sorted(latency.items()):
        length = expected_length(probs[:n])
        table[n] = {"expected_length": round(length, 4), "step_ms": round(1000 * seconds, 3),
                    "tokens_per_s": round(length / seconds, 2)}
    best = max((n for n in table if n > 0), key=lambda n: table[n]["tokens_per_s"])
    return best, table


# --- the budget, adapted step by step ------------------------------------------------------------

class Budget:
    """Chooses each step's tree size from the steps so far. sizes: the choices (0 = plain);
    expected: prior tokens per step of each size (from the calibration; missing: unknown, so the
    size is tried); latency: prior seconds per step of each size; rank: each node path's place
    in the nested trees (size n holds the paths of rank <= n)."""

    def __init__(self, sizes, expected: dict, latency: dict, rank: dict, prior_steps: int = 8,
                 window: int = 16, trusted: int = 3, margin: float = 0.05):
        self.sizes = sorted(sizes)
        self.expected, self.latency, self.rank = expected, latency, rank
        self.prior_steps = prior_steps  # how many steps' worth of evidence the prior counts for
        self.trusted = trusted  # steps of a size before its own timing replaces the prior: one
        # step's time is noise (and a shape's first product is slow), the median of 3 is not
        self.margin = margin  # another size must promise this much more to be switched to, so
        # that timing noise does not make the steps wander between sizes of equal worth, and a
        # tree must promise it over plain decoding, where every run starts: "never slower"
        self.tokens = {n: 0 for n in self.sizes}  # tokens size n would have yielded so far ...
        self.steps = {n: 0 for n in self.sizes}  # ... over this many steps
        self.seconds = {n: deque(maxlen=window) for n in self.sizes}  # recent step times
        self.used = {n: 0 for n in self.sizes}  # steps run at each size
        self.current = 0  # the size settled on (probes aside): plain steps, until a tree pays

    def tokens_per_step(self, n: int) -> float | None:
        if n == 0:
            return 1.0
        prior = self.expected.get(n)
        weight = self.prior_steps if prior is not None else 0
        if self.steps[n] + weight == 0:
            return None
        return (self.tokens[n] + weight * (prior or 0.0)) / (self.steps[n] + weight)

    def measured(self, n: int) -> bool:
        return len(self.seconds[n]) >= self.trusted

    def seconds_per_step(self, n: int) -> float:
        """The median of the recent steps of size n once there are enough. Before: its prior,
        rescaled by how far off the prior was at the nearest measured size (a prior from
        another machine or another load is often off by one factor across the board)."""
        if self.measured(n):
            return statistics.median(self.seconds[n])
        measured = [m for m in self.sizes if self.measured(m)]
        if not measured:
            return self.latency[n]
        i = self.sizes.index(n)
        nearest = min(measured, key=lambda m: (abs(self.sizes.index(m) - i), m))
        return self.latency[n] * statistics.median(self.seconds[nearest]) / self.latency[nearest]

    def rate(self, n: int) -> float:
        """Estimated tokens per second at size n; an untried size of unknown acceptance is
        infinitely promising, so that it is tried."""
        tokens = self.tokens_per_step(n)
        return float("inf") if tokens is None else tokens / self.seconds_per_step(n)

    def best(self) -> int:
        """The size of the highest rate, unless it beats the current size by no more than the
        margin (ties go to the smaller tree)."""
        best = max(self.sizes, key=lambda n: (self.rate(n), -n))
        if self.rate(best) <= (1 + self.margin) * self.rate(self.current):
            return self.current
        return best

    def choose(self) -> int:
        """The best size, unless one of its neighbours is not measured yet in this run: then
        that neighbour, for a step (the rate over the sizes is hill-shaped, so the best size's
        neighbours are where a wrong prior shows)."""
        self.current = self.best()
        i = self.sizes.index(self.current)
        for j in (i + 1, i - 1):
            if 0 <= j < len(self.sizes) and not self.measured(self.sizes[j]):
                return self.sizes[j]
        return self.current

    def record(self, n: int, seconds: float, accepted: list[tuple],
               rank: dict | None = None) -> None:
        """A step at size n took `seconds` and accepted these node paths (root excluded); rank:
        where each path comes in this step's tree order, if not the nested trees' (a ranked tree).

        note: the accepted paths form one chain from the root, and a smaller nested tree holds
        a prefix of it; under greedy and rejection-sampling acceptance (one draw per node) that
        prefix is exactly what the smaller tree would have accepted; under typical acceptance
        it is a lower bound (another path of the smaller tree might have passed)."""
        self.seconds[n].append(seconds)
        self.used[n] += 1
        rank = rank or self.rank
        for m in self.sizes:
            if 0 < m <= n:  # what the nested tree of m nodes would have accepted in this step
                self.tokens[m] += 1 + sum(rank[p] <= m for p in accepted)
                self.steps[m] += 1

    def summary(self) -> str:
        """"4 nodes (steps by size: 0:1 3:1 4:120 6:1)": the size used most (0: plain
        steps), and the steps run at every size."""
        used = {n: c for n, c in self.used.items() if c}
        if not used:
            return "no step"
        most = max(used, key=used.get)
        by_size = " ".join(f"{n}:{c}" for n, c in sorted(used.items()))
        return f"{most} nodes (steps by size: {by_size})"


def nested_trees(nodes: list[tuple], sizes, num_heads: int, vocab_size: int, device):
    """{n: the tree of the first n grown nodes} for each size n > 0, and each path's rank."""
    trees = {n: build_tree(nodes[:n], num_heads, vocab_size, device) for n in sizes if n > 0}
    return trees, {path: i + 1 for i, path in enumerate(nodes)}


# --- step latency, measured here and cached -----------------------------------------------------

def step_latency(model, heads, trees: dict[int, MedusaTree], prompt_len: int = 256,
                 repeats: int = 8) -> dict[int, float]:
    """Seconds per step for each tree of `trees` and for a plain step (size 0). Sizes are timed
    round-robin so that machine noise hits all of them alike; the median of `repeats` rounds is
    kept. Every step starts from the same cached prefix of prompt_len random tokens."""
    device = model.embed.weight.device
    prompt_len = min(prompt_len, model.config.max_position_embeddings // 2)
    cache = new_cache(model, prompt_len, 1, margin=max(trees, default=0) + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    _, hidden = prefill(model, cache, prompt)
    draft_cache = new_draft_cache(heads, cache.capacity) if isinstance(
        heads, HydraPlusPlusHeads) else None  # a draft layer's: every step feeds it too
    features = hidden[-1] if draft_cache is None else read_accepted(heads, draft_cache, hidden)

    def timer(n):
        def seconds():
            cache.rewind(prompt_len)  # every size starts from the same prefix
            if draft_cache is not None:
                draft_cache.rewind(prompt_len)
            return time_one_step(model, heads, trees.get(n), cache, features, draft_cache)
        return seconds
    return round_robin_medians({n: timer(n) for n in [0, *trees]}, repeats)


def round_robin_medians(timers: dict, rounds: int) -> dict:
    """{key: the median of `rounds` calls of timers[key]() (each returns its seconds)}, the
    timers taking turns round by round so that machine noise hits all of them alike; a first
    round warms up, uncounted (the first product of a shape is slow)."""
    times = {key: [] for key in timers}
    for r in range(rounds + 1):
        for key, seconds in timers.items():
            elapsed = seconds()
            if r > 0:
                times[key].append(elapsed)
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}


def time_one_step(model, heads, tree, cache, features, draft_cache=None) -> float:
    """Seconds of one step: the heads and the tree forward, or (tree None) a plain step; and
    feeding the kept positions to a draft layer, if the heads have one (its cache)."""
    if model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if tree is None:
        logits, kept = decode_step(model, cache, torch.zeros(1, 1, dtype=torch.long,
                                                             device=cache.device))
        logits.argmax().item()  # the host sync a plain step makes too
    else:
        _, _, kept = medusa_step(model, tree, cache, draft(heads, model, tree, 0, features),
                                 greedy(), None)
    if draft_cache is not None:
        read_accepted(heads, draft_cache, kept)
    return time.perf_counter() - start


def cache_file() -> Path:
    """Where measured step latencies are kept: $MINIMEDUSA_CACHE, else the user's cache
    folder ($XDG_CACHE_HOME or ~/.cache)/minimedusa."""
    root = os.environ.get("MINIMEDUSA_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimedusa"
    return Path(root) / "step_latency.json"


def latency_key(model, heads, device, dtype) -> str:
    """The machine, and what sets a step's cost: the weight format, whether the step is compiled
    (and its attention the C kernel), how a block runs its products (how many, at least how
    many rows: latencies cached by a version of this code that ran them otherwise are not
    reused), the model's shapes and the heads' (their kind, and how many tokens they rank)."""
    m, h = model.config, heads.config
    vocab = "" if heads.vocabulary is None else f", draft vocabulary {heads.vocabulary.ids.numel()}"
    fmt = format_of(model)
    weights = f" | {fmt} weights" if fmt in ("int8", "int4") else ""  # the dtype says the rest
    if any(isinstance(layer, Int4KernelLinear) for layer in model.layers[0].modules()):
        weights += " (group_kernel.c)"
    if isinstance(model.lm_head, Int8GroupLinear):
        weights += ", 8-bit LM head"
    step = " | compiled step" if is_compiled(model) else ""
    if model.layers[0].attn.exact_attention is kernel_attention:
        step += ", C attention"
    layers = [layer for layer in model.layers[0].modules()
              if isinstance(layer, (nn.Linear, PackedLinear, Int8Linear, Int4Linear,
                                    Int4KernelLinear))]
    rows = (f", of >= {MIN_ROWS} rows" if any(isinstance(layer, PackedLinear) for layer in layers)
            else "")
    return (f"{machine_key(device, dtype)}{weights}{step} | {len(layers)} products a block{rows}"
            f" | model {m.num_hidden_layers}x{m.hidden_size}"
            f"x{m.intermediate_size}, vocab {m.vocab_size} | {h.head_kind} heads "
            f"{h.medusa_num_heads}x{h.medusa_num_layers}{' shared' if h.shared_lm_head else ''}"
            f"{vocab}")


def read_cache_file() -> tuple[dict, str | None]:
    """(every cached entry, None); no file reads as ({}, None). A damaged file (not UTF-8, not
    JSON, not {key: {size: seconds}}) or one that cannot be read gives ({}, why): never
    trusted, its latencies are measured again and it is replaced."""
    path = cache_file()
    if not path.is_file():
        return {}, None
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 (UnicodeDecodeError), not JSON
        return {}, f"{type(e).__name__}: {e}"
    problem = shape_problem(cached)
    return ({}, problem) if problem else (cached, None)


def shape_problem(cached) -> str | None:
    """Why a cache file's JSON is not {key: {size: seconds}}, or None. note: a latency of 0,
    NaN or infinity counts as damage too: the budget divides by it."""
    if not isinstance(cached, dict):
        return f"a JSON {type(cached).__name__}, not an object"
    for key, entry in cached.items():
        if not isinstance(entry, dict) or not all(
                n.isdecimal() and is_seconds(s) for n, s in entry.items()):
            return f"the entry {key[:80]!r} is not {{size: seconds}}"
    return None


def is_seconds(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def read_cached(key: str) -> dict[int, float]:
    """The cached seconds per step of each size under `key`; none ({}) where the file is
    damaged, which a line on stderr says (its sizes are then measured again)."""
    cached, problem = read_cache_file()
    if problem is not None:
        print(f"minimedusa: the step-latency cache {cache_file()} was damaged ({problem}); "
              "measured again", file=sys.stderr)
    return {int(n): s for n, s in cached.get(key, {}).items()}


def write_cached(key: str, latency: dict[int, float]) -> None:
    """Merge into the cache file (a damaged one is replaced: read_cached has said so), written
    beside its final name and renamed. Where it cannot be written the decoding goes on: a line
    on stderr says the latencies were not kept, why, and what to do."""
    path = cache_file()
    cached, _ = read_cache_file()
    cached[key] = {**cached.get(key, {}), **{str(n): s for n, s in latency.items()}}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:  # a read-only folder, MINIMEDUSA_CACHE naming a file, a full disk
        with contextlib.suppress(OSError):
            tmp.unlink()  # a half-written one (where the folder itself is not the problem)
        print(f"minimedusa: the step latencies measured here were not kept: {path} cannot be "
              f"written ({type(e).__name__}: {e}); set MINIMEDUSA_CACHE to a writable folder",
              file=sys.stderr)


def machine_latency(model, heads, trees: dict[int, MedusaTree], repeats: int = 3):
    """(seconds per step of each size, "cached" or "measured here"): measured once per machine
    (a few seconds), then read from the cache."""
    weight = model.embed.weight
    key = latency_key(model, heads, weight.device, weight.dtype)
    cached = read_cached(key)
    if all(n in cached for n in [0, *trees]):
        return {n: cached[n] for n in [0, *trees]}, "cached"
    latency = step_latency(model, heads, trees, repeats=repeats)
    write_cached(key, latency)
    return latency, "measured here"

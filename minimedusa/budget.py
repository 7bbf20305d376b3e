"""The tree and its size for these heads on this machine (paper section 6, steps 2 and 3).

The tree is grown from the heads' calibration (training/tree_search.py measures it): assuming the
heads err independently, the node [i_1, ..., i_k] is accepted with probability prod_j a_j^(i_j), and
a step yields 1 + the sum of its nodes' probabilities tokens on average. Adding the most
probable node that hangs off the tree, repeatedly, gives the best tree of EVERY size at once
(a child is never more probable than its parent): its first n nodes.

The size, the budget: a bigger tree accepts more tokens per step, but each step costs more;
where the balance lies is a fact of the machine (its vector units, memory bandwidth, caches),
not of its name: a tree tuned on one CPU ran slower than plain decoding on another that reports
the same name but has narrower vector units. So nothing here is assumed from elsewhere:
1. The step latency of each tree size, plain decoding (size 0) included, is measured at first
   use on this machine (a few seconds) and cached under the user's cache folder, never in the
   repository (assembly/step_latency.py; the Budget is handed the numbers).
2. During decoding a Budget keeps measuring: every step's time, and for every smaller size
   nested in the tree it ran, how many tokens that size would have yielded. It runs the size
   with the most tokens per second, plain decoding being one of the choices (a run starts
   there, and moves only for a clear gain), and times each neighbouring size for a few steps
   (again, every few hundred steps, in a long run), so a wrong prior (latencies measured on
   another machine, or under other load) costs a handful of steps, not the run.
The sizes are nested trees, the first n grown nodes, so a step of n nodes also shows what
every size below n would have accepted. A fixed tree, the paper's setting, is the simplest
budget: one size every step (FixedSize).

Shapes: K heads, R ranks calibrated (top-R guesses per head).
"""
import heapq
import math
import statistics
import time
from collections import deque

import torch

from minimedusa.draft import TreeDraft
from minimedusa.tree import MedusaTree, build_tree


# the tree sizes to choose from, doubling (few sizes: few probing steps): beyond 64 nodes the
# paper's GPU was already compute bound, and a CPU long before; and 3, the most nodes whose
# step (4 rows) int4's kernel multiplies in one pass over the weights (speed/quantized.py)
SIZES = (1, 2, 3, 4, 8, 16, 32, 64)


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


def batch_latency(latency: dict[int, float], batch_size: int) -> dict[int, float]:
    """Prior seconds per step of each size for a batch of B rows, from batch-1 latencies: a
    step of n nodes in a batch is a forward of B (n + 1) rows, which costs about what a batch-1
    forward of as many rows does (the weights are read once a step either way). So the batch-1
    table is read by rows (n + 1), linearly between its sizes and past its largest.

    Why not batch-1's latencies as they are: rows are what a CPU pays for, and in a batch of 8
    a 1-node tree doubles them; timed against batch-1's small growth (a tree of 1 node ~1.1x a
    plain step), every tree looked cheap, and the Budget's probes of sizes that could never pay
    made Medusa in a batch slower than plain batching (weights/HISTORY.md)."""
    known = sorted((n + 1, seconds) for n, seconds in latency.items())  # (rows, seconds)
    if len(known) < 2:  # one size: nothing to read growth from
        return dict(latency)

    def at(rows: int) -> float:  # the segment holding rows, else the last one, extended
        (r0, s0), (r1, s1) = next(((a, b) for a, b in zip(known, known[1:]) if rows < b[0]),
                                  known[-2:])
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    return {n: at(batch_size * (n + 1)) for n in latency}


# --- the budget, adapted step by step ------------------------------------------------------------

class Budget:
    """Chooses each step's tree size from the steps so far. sizes: the choices (0 = plain);
    expected: prior tokens per step of each size (from the calibration; missing: unknown, so the
    size is tried); latency: prior seconds per step of each size. What a step accepted is
    recorded by each node path's rank, which the draft hands with its candidates (the nested
    trees: size n holds the paths of rank <= n).

    Steps come in groups that the caller names (decoding: how long a suffix the step's context
    chain matched, context_candidates.py), each group with its own acceptance counts and
    chosen size: a step whose chain matched 3 tokens accepts far more from a big tree than one
    with no chain. Step times are one machine's: shared by the groups. chain: how many tokens
    the chain of a group > 0 proposes (0: no group has one); a step of that many nodes or fewer
    is the chain alone (context_candidates.chain_alone), whose growth with the size the heads'
    calibration does not predict (prior)."""

    def __init__(self, sizes, expected: dict, latency: dict, prior_steps: int = 8,
                 window: int = 16, trusted: int = 3, margin: float = 0.05, chain: int = 0,
                 rows: int = 1, stale: int = 512, clock=time.perf_counter):
        self.sizes = sorted(sizes)
        self.clock = clock  # what the decoding loop times each step with (tests: a fake one)
        self.expected, self.latency = expected, latency
        self.chain = chain
        # rows: the records a step makes: a batch's rows each record their share of its time
        # and their own accepted path (experiments/batch_medusa.py); the counts below are per step
        self.prior_steps = prior_steps * rows  # how many steps' worth of evidence the prior
        # counts for
        self.trusted = trusted * rows  # steps of a size before its own timing replaces the
        # prior: one step's time is noise (and a shape's first product is slow), 3's median not
        self.margin = margin  # another size must promise this much more to be switched to, so
        # that timing noise does not make the steps wander between sizes of equal worth, and a
        # tree must promise it over plain decoding, where every run starts: "never slower"
        # per group: tokens size n would have yielded so far, over this many steps
        self.tokens: dict[int, dict[int, int]] = {}
        self.steps: dict[int, dict[int, int]] = {}
        self.seconds = {n: deque(maxlen=window * rows) for n in self.sizes}  # recent steps
        # a size's timings are taken again once this many steps have passed without it: a
        # run's conditions drift (another load, a batch's rows), and a timing that came out
        # high (plain steps timed among a run's first) would otherwise keep a worse size
        self.stale, self.records = stale * rows, 0
        self.timed = {n: 0 for n in self.sizes}  # records so far at each size's last step
        self.used = {n: 0 for n in self.sizes}  # steps run at each size
        self.current: dict[int, int] = {}  # per group, the size settled on (probes aside):
        # plain steps, until a tree pays

    def tokens_per_step(self, n: int, group: int = 0) -> float | None:
        """Tokens a step of size n yields in this group: what it measured, and the prior for
        the steps it has not (prior_steps' worth)."""
        if n == 0:
            return 1.0
        prior = self.prior(n, group)
        weight = self.prior_steps if prior is not None else 0
        tokens, steps = self.tokens.get(group, {}).get(n, 0), self.steps.get(group, {}).get(n, 0)
        if steps + weight == 0:
            return None
        return (tokens + weight * (prior or 0.0)) / (steps + weight)

    def prior(self, n: int, group: int) -> float | None:
        """The calibration's tokens per step at size n, anchored at the largest smaller size
        this group has measured: that size's measured rate plus the calibration's difference
        between the two. The calibration's level is off for a group (steps with a long context
        chain accept far more, held-out chat less), its growth with the size much less so; but
        for a chain alone (a group > 0, n <= chain) the chain's own: its k-th token taken as
        right as often as its first (a^k; copies stay right a little more often than that).
        With the calibration's growth, steps after a 3-token match never grew past 1 node, where
        4 nodes accepted nearly twice the tokens (weights/HISTORY.md)."""
        if self.expected.get(n) is None:
            return None
        steps = self.steps.get(group, {})
        below = [m for m in self.sizes if 0 < m < n and steps.get(m, 0) >= self.trusted
                 and m in self.expected]
        if not below:
            return self.expected[n]
        m = max(below)
        measured = self.tokens[group][m] / steps[m]
        if group and n <= self.chain and steps.get(1, 0) >= self.trusted:
            first = self.tokens[group][1] / steps[1] - 1  # the chain's first token right
            return measured + sum(first ** k for k in range(m + 1, n + 1))
        return measured + self.expected[n] - self.expected[m]

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

    def rate(self, n: int, group: int = 0) -> float:
        """Estimated tokens per second at size n; an untried size of unknown acceptance is
        infinitely promising, so that it is tried."""
        tokens = self.tokens_per_step(n, group)
        return float("inf") if tokens is None else tokens / self.seconds_per_step(n)

    def best(self, group: int = 0) -> int:
        """The size of the highest rate, unless it beats the group's current size by no more
        than the margin (ties go to the smaller tree)."""
        best = max(self.sizes, key=lambda n: (self.rate(n, group), -n))
        current = self.current.get(group, 0)
        if self.rate(best, group) <= (1 + self.margin) * self.rate(current, group):
            return current
        return best

    def choose(self, group: int = 0) -> int:
        """The best size for a step of this group, unless one of its neighbours is not measured
        yet in this run: then that neighbour, for a step (the rate over the sizes is
        hill-shaped, so the best size's neighbours are where a wrong prior shows)."""
        self.current[group] = self.best(group)
        i = self.sizes.index(self.current[group])
        # a neighbour is timed once for every group (and again when its timings are stale);
        # its acceptance in a group is the prior until the group settles on it (a probe a
        # group: 17% of a run's steps, and slower)
        for j in (i + 1, i - 1):
            if 0 <= j < len(self.sizes):
                n = self.sizes[j]
                if self.measured(n) and self.records - self.timed[n] > self.stale:
                    self.seconds[n].clear()
                if not self.measured(n):
                    return n
        return self.current[group]

    def record(self, n: int, seconds: float, accepted: list[tuple], rank: dict | None,
               group: int = 0) -> None:
        """A step of this group at size n took `seconds` and accepted these node paths (root
        excluded); rank: where each path comes in the step's tree order (its Candidates': the
        nested trees', a ranked tree's, a tree merged with a context chain's; None for a plain
        step).

        note: the accepted paths form one chain from the root, and a smaller nested tree holds
        a prefix of it; under greedy and rejection-sampling acceptance (one draw per node), and
        speculative sampling (siblings verified in rank order; a smaller tree holds the first
        ranks of each node), that prefix is what the smaller tree would have accepted with the
        same draws; under typical acceptance
        it is a lower bound (another path of the smaller tree might have passed)."""
        self.seconds[n].append(seconds)
        self.used[n] += 1
        self.records += 1
        self.timed[n] = self.records
        tokens, steps = self.tokens.setdefault(group, {}), self.steps.setdefault(group, {})
        for m in self.sizes:
            if 0 < m <= n:  # what the nested tree of m nodes would have accepted in this step
                tokens[m] = tokens.get(m, 0) + 1 + sum(rank[p] <= m for p in accepted)
                steps[m] = steps.get(m, 0) + 1

    def summary(self) -> str:
        """"4 nodes (steps by size: 0:1 3:1 4:120 6:1)": the size used most (0: plain
        steps), and the steps run at every size."""
        used = {n: c for n, c in self.used.items() if c}
        if not used:
            return "no step"
        most = max(used, key=used.get)
        by_size = " ".join(f"{n}:{c}" for n, c in sorted(used.items()))
        return f"{most} nodes (steps by size: {by_size})"


class FixedSize:
    """The budget of one tree size every step: the paper's setting (one tree, chosen offline:
    --tree) or a ranked tree of N nodes (--tree ranked:N). It counts the steps, nothing more."""

    def __init__(self, n: int, clock=time.perf_counter):
        self.sizes, self.steps, self.clock = [n], 0, clock

    def choose(self, group: int = 0) -> int:
        return self.sizes[0]

    def record(self, n: int, seconds: float, accepted: list[tuple], rank: dict | None,
               group: int = 0) -> None:
        self.steps += 1

    def summary(self) -> str:
        return f"{self.sizes[0]} nodes"


def fixed(heads, tree: MedusaTree) -> tuple[TreeDraft, FixedSize]:
    """(draft, budget) that make decoding.medusa_decode run `tree` every step, drafted by
    `heads`: the paper's Medusa, the simplest case of the loop (each node path ranked in the
    tree's own order)."""
    n = tree.size - 1
    return TreeDraft(heads, {n: tree}), FixedSize(n)


def nested_trees(nodes: list[tuple], sizes, num_heads: int, vocab_size: int, device):
    """{n: the tree of the first n grown nodes} for each size n > 0, and each path's rank."""
    trees = {n: build_tree(nodes[:n], num_heads, vocab_size, device) for n in sizes if n > 0}
    return trees, {path: i + 1 for i, path in enumerate(nodes)}

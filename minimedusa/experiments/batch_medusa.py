"""Medusa in a batch: each row its own tree, all verified in one forward. Measured, not
shipped: on a CPU a tree's rows cost their products' arithmetic, so beside plain batching of the
same rows (batch_decoding.py) it ran at 0.97-1.00x (weights/HISTORY.md); generate.py batches
plainly. Read against decoding.medusa_decode.

Each step every row drafts its own tree of the size the budget picks for the batch (the same
size for all rows, so that the step is one (B, N) forward; 0: a plain batch step), verified in
one forward with a block mask: row b's node i is written at slot lengths[b] + i, sits at
position lengths[b] + its depth, and sees the row's own cached tokens and its tree ancestors.
Each row then accepts on its own (its own generator) and compacts its own accepted entries to
slots lengths[b], lengths[b] + 1, ... (decoding.medusa_step's compaction, through a view of its
row), so rows that accept different lengths simply have different lengths: nothing is padded or
squeezed, the mask says what each row sees. Lossless as batch-1 Medusa is: a greedy row's
answer is its batch-1 plain greedy answer.
Left out: context candidates (their chains are per sequence: a draft per row) and speculative
sampling of drawn candidates (its draws would need a generator per row).

Shapes: B rows, N tree nodes (the root first), S attended slots, V vocab, C model dim.
"""
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from minimedusa.acceptance import Acceptance, make_generator
from minimedusa.batch_decoding import Row, batch_cache, batch_step, refill
from minimedusa.decoding import Step, cut_at_stop, prefill
from minimedusa.draft import TreeDraft
from minimedusa.errors import UserError
from minimedusa.kv_cache import KVCache
from minimedusa.model import EXACT_ATTENTION_TOKENS, Llama, at_least_float32
from minimedusa.speculative_sampling import DrawnDraft
from minimedusa.tree import MedusaTree


@dataclass
class BatchMedusa:
    """What Medusa's steps in a batch run: the draft (each row's tree drafted in turn, so one
    that keeps nothing of a sequence between steps: draft.TreeDraft, fused or graphed), the
    budget that picks each step's tree size for every row (0: a plain step; its sizes' rows
    times the batch at most EXACT_ATTENTION_TOKENS: max_tree_size), and the acceptance.
    fewer(r): a budget of its own for steps of r rows, fewer than the batch's (its tail, once
    no prompt is left to take a finished row's place), made at the first such step; None: the
    budget for every count of rows."""
    draft: object
    budget: object
    acceptance: Acceptance
    fewer: Callable[[int], object] | None = None


def max_tree_size(batch_size: int) -> int:
    """The most nodes a batch's trees may have: a step of B x (n + 1) rows stays within
    model.exact_attention's rows, whose sums keep every row's bits its batch-1 bits."""
    return EXACT_ATTENTION_TOKENS // batch_size - 1


def batch_tree_mask(tree: MedusaTree, starts: torch.Tensor, S: int) -> torch.Tensor:
    """(B, N, S) bool: row b's node i sees the row's own cached tokens (slots < starts[b], its
    length) and its tree ancestors and itself (tree.mask, at slots starts[b] + j); nothing of
    another row's tree, nothing past it (decoding.tree_mask for one row). starts (B, 1)."""
    N = tree.size
    offsets = torch.arange(S, device=starts.device) - starts  # (B, S): slot - start
    cached = (offsets < 0).unsqueeze(1)  # (B, 1, S)
    in_tree = ((offsets >= 0) & (offsets < N)).unsqueeze(1)  # (B, 1, S)
    ancestors = tree.mask[:, offsets.clamp(0, N - 1)].transpose(0, 1)  # (B, N, S)
    return cached | (in_tree & ancestors)


@torch.inference_mode()
def batch_tree_step(model: Llama, cache: KVCache, tree: MedusaTree, tokens: torch.Tensor,
                    lengths: list[int]):
    """Verify every row's candidates (B, N), each row's root first, after its cached tokens,
    in one forward: (logits (B, N, V), hidden (B, N, C)), as decoding.tree_forward for one.
    Row b's node i is written at slot lengths[b] + i, at position lengths[b] + its depth."""
    starts = torch.tensor(lengths, device=tokens.device).unsqueeze(1)  # (B, 1)
    positions = starts + tree.depth  # (B, N): siblings share a position
    slots = starts + torch.arange(tree.size, device=tokens.device)  # (B, N)
    mask = batch_tree_mask(tree, starts, max(lengths) + tree.size)  # (B, N, S)
    logits, hidden = model(tokens, positions, mask, cache, slots)
    return at_least_float32(logits), hidden


def compact_row(cache: KVCache, b: int, length: int, kept: list[int]) -> None:
    """Row b's accepted nodes' entries (offsets `kept` from its slot `length`, root first) to
    slots length, length + 1, ...: KVCache.compact through a view of the row."""
    view = cache.row(b)
    view.length = length
    view.compact(kept)


def batch_medusa_decode(model: Llama, prompts: list[list[int]], max_new_tokens: int,
                        medusa: BatchMedusa, stop_ids: set[int],
                        batch_size: int) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, its answer) for every prompt, as each finishes: batch_size rows
    decoded together with Medusa's steps (each row its own tree of the budget's size, each its
    own acceptance), each row refilled with the next prompt when its answer ends. Every row
    draws from a generator of its own, seeded as batch-1 Medusa seeds its one."""
    budget = medusa.budget
    problem = unbatchable(medusa.draft)
    if problem is not None:
        raise UserError(f"Medusa in a batch cannot run this draft: {problem}")
    if max(budget.sizes) > max_tree_size(batch_size):
        raise ValueError(f"trees of {max(budget.sizes)} nodes in a batch of {batch_size} rows: at "
                         f"most {max_tree_size(batch_size)} (max_tree_size) keep rows lossless")
    # the margin: a step writes all its tree's tokens before compaction keeps the accepted
    cache = batch_cache(model, prompts, max_new_tokens, batch_size, max(budget.sizes) + 1)
    queue = deque(enumerate(prompts))
    B = cache.layers[0].k.shape[0]
    rows: list[Row | None] = [None] * B
    lengths = [0] * B  # each row's cached tokens; its last emitted token is not yet cached

    budget_for = row_count_budgets(medusa, batch_size)

    def start(b: int, prompt: tuple[int, list[int]]) -> None:
        rows[b], lengths[b] = start_medusa_row(model, cache, b, prompt, medusa)
    for b in range(B):
        start(b, queue.popleft())
    while True:
        kept = yield from refill(rows, queue, start, cache, max_new_tokens, stop_ids)
        if kept is not None:  # the others left the batch
            if not kept:
                return
            rows, lengths = [rows[b] for b in kept], [lengths[b] for b in kept]
        step_budget = budget_for(len(rows))
        clock = step_budget.clock()
        n = step_budget.choose()
        steps, hidden = batch_medusa_step(model, cache, medusa, n, rows, lengths)
        seconds = step_budget.clock() - clock
        for b, (row, step) in enumerate(zip(rows, steps)):
            lengths[b] += len(step.kept)
            row.answer += cut_at_stop(step.tokens, max_new_tokens - len(row.answer), stop_ids)[0]
            row.hidden = hidden[b, step.kept]
            accepted = [step.candidates.tree.nodes[i] for i in step.kept[1:]] if n else []
            # a row's share of the step (a Budget made with rows=B counts B records a step):
            # it weighs the sizes by their tokens a second over all rows
            step_budget.record(n, seconds / len(rows), accepted, medusa.draft.rank)


def unbatchable(draft) -> str | None:
    """Why a batch cannot run `draft`, or None. The batch drafts each row's tree in turn from
    the row's hidden state alone and verifies every row's on one tree: a TreeDraft (fused or
    graphed) of fixed trees. Not a draft that keeps a sequence between steps (context
    candidates, Hydra++'s draft layer), nor one whose tree is each row's own (ranked trees), nor
    one whose draws the acceptance must be told (drawn candidates)."""
    if isinstance(draft, DrawnDraft):
        return "drawn candidates would need a generator a row (their draws are the draft's)"
    if not isinstance(draft, TreeDraft):
        return (f"a {type(draft).__name__} keeps a sequence's state or draws a tree of its own "
                "a step; a batch runs the heads' fixed trees (TreeDraft)")
    return None


def row_count_budgets(medusa: BatchMedusa, batch_size: int) -> Callable[[int], object]:
    """The budget for a step of r rows: medusa.budget for the whole batch, medusa.fewer(r),
    made once, for fewer (the batch's tail, once no prompt is left to take a finished row's
    place, or a file of fewer prompts than the batch holds). A step's time is its rows', so the
    tail's steps, where trees pay more, are not timed among the batch's. Without fewer:
    medusa.budget for every count."""
    budgets = {batch_size: medusa.budget}

    def budget_for(rows: int):
        if rows not in budgets:
            budgets[rows] = medusa.fewer(rows) if medusa.fewer else medusa.budget
        return budgets[rows]
    return budget_for


def start_medusa_row(model: Llama, cache: KVCache, b: int, prompt: tuple[int, list[int]],
                     medusa: BatchMedusa) -> tuple[Row, int]:
    """Row b takes prompt (index, ids), prefilled alone in its row: (its Row, with its first
    token and the prefill's hidden states, as medusa_decode starts; its cached tokens)."""
    index, ids = prompt
    device = model.embed.weight.device
    view = cache.row(b)
    logits, hidden = prefill(model, view, torch.tensor([ids], device=device))
    generator = make_generator(device, medusa.acceptance.seed)
    return Row(index, [medusa.acceptance.first(logits[0], generator).item()], generator,
               hidden), view.length


def batch_medusa_step(model: Llama, cache: KVCache, medusa: BatchMedusa, n: int,
                      rows: list[Row], lengths: list[int]):
    """One step of every row, from its root (its last token): a plain step (n = 0) or a tree
    of n nodes each. Returns (a decoding.Step a row: its new tokens, kept nodes, candidates and
    verdict; hidden (B, N, C) at every node)."""
    draft, acceptance = medusa.draft, medusa.acceptance
    roots = [row.answer[-1] for row in rows]
    if n == 0:  # a plain step: every row's root, one token each
        logits, hidden = batch_step(model, cache, torch.tensor(roots, device=cache.device)[:, None],
                                    lengths)  # (B, V), (B, C)
        steps = [Step([acceptance.first(logits[b], row.generator).item()], [0])
                 for b, row in enumerate(rows)]
        return steps, hidden.unsqueeze(1)  # (B, 1, C): the root's, a row's one node
    drafted = []
    for root, row in zip(roots, rows):  # what the heads read: read for tree steps only
        drafted.append(draft.tree(model, n, root, draft.read(row.hidden)))
    tree = drafted[0].tree  # one size, one tree, every row's
    tokens = torch.stack([c.tokens for c in drafted])  # (B, N)
    logits, hidden = batch_tree_step(model, cache, tree, tokens, lengths)
    steps = []
    for b, row in enumerate(rows):
        verdict = acceptance.accept(logits[b], drafted[b], row.generator)
        compact_row(cache, b, lengths[b], verdict.kept)
        steps.append(Step(verdict.tokens, verdict.kept, drafted[b], verdict))
    return steps, hidden

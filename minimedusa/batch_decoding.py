"""Many prompts at once: plain decoding of B sequences in one forward a step (continuous
batching). decoding.plain_decode is the batch-1 loop this reads against.

Why: a step's cost on a CPU is mostly its weights streaming through the caches, once whatever
its rows; on a GPU, its kernels' launches. B rows in one step cost far less than B steps, so a
file of prompts (an evaluation, a data set to answer, the benchmark) is answered several times
faster, though each answer comes no sooner than alone (a step of B rows takes longer).

How the rows share one KV cache (B, G, M, D) a layer: each row is its own sequence, with its own
length, so its own slots: row b's token of this step is written at slot lengths[b] and sees
slots [0, lengths[b]] (its mask), its RoPE position lengths[b]. A row's prompt is prefilled
alone, through a view of its row (KVCache.row): the same forward as batch-1's. When a row's
answer ends (a stop id, or max_new_tokens), it is given out and the row takes the next prompt,
whose prefill overwrites the row from slot 0 (the old entries past its length are masked); when
none is left, the row leaves the batch (KVCache.keep_rows).
Lossless: every row's answer is its batch-1 answer token for token (greedy; and sampled, each row
drawing from its own generator, seeded as batch-1 seeds one), as the step's rows are computed
independently: model.exact_attention's float64 sums make a row's attention the same whatever
the slots it does not see, and the products' rows do not depend on the rows beside them (the
C kernels'; tested for the formats decoding runs).
Medusa in a batch, a tree a row, is measured, not shipped: experiments/batch_medusa.py.

Shapes: B rows, S attended slots, V vocab, C model dim.
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from minimedusa.decoding import check_context, prefill
from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, at_least_float32
from minimedusa.acceptance import Sampling


@dataclass
class Row:
    """One row's sequence: which prompt it answers, its answer so far, its sampling draws (or
    its acceptance's), and with Medusa the hidden states (a, C) its last forward kept (the
    accepted positions'), which the heads read when the row drafts."""
    index: int
    answer: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    hidden: torch.Tensor | None = None


@torch.inference_mode()
def batch_step(model: Llama, cache: KVCache, tokens: torch.Tensor, lengths: list[int]):
    """Feed each row's token (B, 1) at the end of its sequence: (next-token logits (B, V),
    hidden (B, C) at this token), as decoding.decode_step for one. Row b writes slot
    lengths[b] (its position too) and attends to slots [0, lengths[b]]."""
    device = tokens.device
    positions = torch.tensor(lengths, device=device).unsqueeze(1)  # (B, 1)
    S = max(lengths) + 1
    mask = torch.arange(S, device=device) <= positions  # (B, S): a row's own slots
    logits, hidden = model(tokens, positions, mask.unsqueeze(1), cache, positions)  # (B, 1, .)
    return at_least_float32(logits[:, -1]), hidden[:, -1]


def batch_decode(model: Llama, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int], batch_size: int) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, its answer) for every prompt, as each finishes (not in order):
    batch_size rows decoded together, each refilled with the next prompt when its answer
    ends. An answer ends after a stop id (kept) or max_new_tokens, as plain_decode's."""
    device = model.embed.weight.device
    cache = batch_cache(model, prompts, max_new_tokens, batch_size)
    queue = deque(enumerate(prompts))
    B = cache.layers[0].k.shape[0]
    rows: list[Row | None] = [None] * B  # each row's sequence
    lengths = [0] * B  # each row's cached tokens
    tokens = [0] * B  # each row's last token, not yet cached

    def start(b: int, prompt: tuple[int, list[int]]) -> None:
        start_row(model, cache, b, prompt, sampling, rows, lengths, tokens)
    for b in range(B):  # every row its first prompt
        start(b, queue.popleft())
    while True:
        kept = yield from refill(rows, queue, start, cache, max_new_tokens, stop_ids)
        if kept is not None:  # the others left the batch
            if not kept:
                return
            rows, lengths, tokens = ([x[b] for b in kept] for x in (rows, lengths, tokens))
        logits, _ = batch_step(model, cache, torch.tensor(tokens, device=device).unsqueeze(1),
                               lengths)  # (B, V)
        lengths = [n + 1 for n in lengths]
        tokens = pick_each(sampling, logits, rows)
        for row, token in zip(rows, tokens):
            row.answer.append(token)


def batch_cache(model: Llama, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                margin: int = 0) -> KVCache:
    """The batch's cache: a row for each of batch_size prompts (fewer if the file holds fewer),
    each as long as the longest prompt + max_new_tokens + margin (Medusa's tree tokens); every
    prompt checked against the model's context before any is decoded."""
    for ids in prompts:
        check_context(model, len(ids), max_new_tokens)
    capacity = max(len(ids) for ids in prompts) + max_new_tokens + margin
    return KVCache.for_model(model, capacity, batch_size=min(batch_size, len(prompts)))


def refill(rows: list[Row], queue: deque, start, cache: KVCache, max_new_tokens: int,
           stop_ids: set[int]):
    """Yield (prompt index, answer) for each row whose answer ended, the row taking the
    queue's next prompt (start(b, prompt)); the rows whose answer ended with no prompt left
    leave the cache (KVCache.keep_rows). Returns the rows kept, in order, where some left
    (none: the batch is done), else None."""
    left = []
    for b in range(len(rows)):
        while ends(rows[b].answer, max_new_tokens, stop_ids):
            yield rows[b].index, rows[b].answer
            if not queue:
                left.append(b)
                break
            start(b, queue.popleft())
    if not left:
        return None
    kept = [b for b in range(len(rows)) if b not in left]
    if kept:
        cache.keep_rows(kept)
    return kept


def ends(answer: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    return len(answer) == max_new_tokens or (bool(answer) and answer[-1] in stop_ids)


def start_row(model: Llama, cache: KVCache, b: int, prompt: tuple[int, list[int]],
              sampling: Sampling, rows, lengths, tokens) -> None:
    """Row b takes prompt (index, ids): prefilled alone in its row, as batch-1 prefills it,
    and its first token picked from the prefill's logits."""
    index, ids = prompt
    device = model.embed.weight.device
    view = cache.row(b)
    logits, _ = prefill(model, view, torch.tensor([ids], device=device))  # (1, V)
    row = Row(index, generator=sampling.generator(device))
    token = sampling.pick(logits, row.generator).item()
    row.answer.append(token)
    rows[b], lengths[b], tokens[b] = row, view.length, token


def pick_each(sampling: Sampling, logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Each row's next token from its logits (B, V): greedy all at once, sampled each from its
    row's own generator (so each row's draws are its batch-1 run's)."""
    if sampling.greedy:
        return sampling.pick(logits, None).tolist()
    return [sampling.pick(logits[b:b + 1], row.generator).item() for b, row in enumerate(rows)]

"""Medusa decoding (paper sections 2-3): one forward of the whole candidate tree per step.

A step: the heads' top-k at the last accepted position give the candidates; all N tree tokens
run through the model in ONE forward after the cached prefix, with the tree mask; acceptance
verifies the candidates along the root-to-leaf paths; the accepted tokens' keys/values are
copied into place in the static KV cache (compaction); the heads' outputs at the last accepted
node give the next step's candidates, with no extra forward.
Left out: batching, and a GPU loop without per-step Python (CUDA graphs); both are speed work.

Shapes: N tree nodes, K heads, V vocab, C model dim, n cached tokens (the prefix).
"""
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

from minimedusa.acceptance import Acceptance
from minimedusa.heads import MedusaHeads
from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama
from minimedusa.plain_decoding import new_cache, prefill
from minimedusa.sampling import make_generator
from minimedusa.tree import MedusaTree, candidates


@dataclass
class StepStats:
    """What a decoding run's steps yielded: the numbers that show whether Medusa pays off."""
    steps: int = 0
    tokens: int = 0
    histogram: Counter = field(default_factory=Counter)  # tokens yielded by a step -> steps

    def record(self, n_tokens: int) -> None:
        self.steps += 1
        self.tokens += n_tokens
        self.histogram[n_tokens] += 1

    @property
    def acceleration_rate(self) -> float:
        """Tokens per step (paper, appendix B); 1.0 for plain decoding."""
        return self.tokens / max(self.steps, 1)


def tree_mask(tree: MedusaTree, n: int) -> torch.Tensor:
    """(1, N, n + N) bool: every tree token sees the whole cached prefix, then the tree mask."""
    prefix = torch.ones(tree.size, n, dtype=torch.bool, device=tree.mask.device)
    return torch.cat([prefix, tree.mask], dim=1).unsqueeze(0)


@torch.inference_mode()
def tree_forward(model: Llama, cache: KVCache, tree: MedusaTree, tokens: torch.Tensor):
    """Run the tree's tokens (N,) after the n cached ones; (logits (N, V), hidden (N, C)).

    subtle: a node's RoPE position is n + depth (siblings are alternative tokens for the SAME
    position) while its cache slot is n + node index (each node needs its own keys/values);
    compaction later moves the accepted nodes' entries to slots n, n + 1, ...
    """
    n = cache.length
    positions = (n + tree.depth).unsqueeze(0)  # (1, N)
    logits, hidden = model(tokens.unsqueeze(0), positions, tree_mask(tree, n), cache,
                           cache.slots(n, tree.size))  # (1, N, V), (1, N, C)
    return logits[0], hidden[0]


def medusa_step(model: Llama, heads: MedusaHeads, tree: MedusaTree, cache: KVCache,
                root: int, head_logits: torch.Tensor, acceptance: Acceptance,
                generator) -> tuple[list[int], torch.Tensor]:
    """One step from the root token (the last one emitted, not yet in the cache) and the heads'
    logits (K, V) at the position before it.

    Returns (the accepted candidates followed by the next token drawn at the last accepted
    node: 1 + the accepted length tokens, and the heads' logits (K, V) at that node, which
    give the next step's candidates).
    """
    n = cache.length
    tokens = candidates(torch.tensor(root, device=head_logits.device), head_logits, tree)  # (N,)
    logits, hidden = tree_forward(model, cache, tree, tokens)
    path, length, next_token = acceptance.verify(logits, tree, tokens, generator)
    # the one host sync per step: the accepted length decides what to copy and emit
    path_tokens = tokens[tree.paths[path]]  # (D + 1,)
    host = torch.cat([path_tokens, torch.stack([path, length, next_token])]).tolist()
    path_i, length_i, next_i = host[-3:]
    nodes = tree.paths_host[path_i][:length_i + 1]  # the accepted nodes, the root first
    src = torch.tensor(nodes, device=tokens.device) + n
    cache.copy_slots(src, cache.slots(n, len(nodes)))  # KV compaction; rejected nodes dropped
    cache.length = n + len(nodes)
    with torch.inference_mode():
        next_head_logits = heads(hidden[nodes[-1]], model.lm_head)  # (K, V)
    return host[1:length_i + 1] + [next_i], next_head_logits


def medusa_decode(model: Llama, heads: MedusaHeads, tree: MedusaTree, prompt_ids: list[int],
                  max_new_tokens: int, acceptance: Acceptance, stop_ids: set[int],
                  seed: int | None = None) -> Iterator[list[int]]:
    """Yield the new tokens forward by forward, until a stop id (yielded) or max_new_tokens:
    first the prefill's token, then each step's accepted candidates + the next token."""
    device = model.embed.weight.device
    generator = make_generator(device, seed)
    # the margin: a step writes all N tree tokens before compaction drops the rejected ones
    cache = new_cache(model, len(prompt_ids), max_new_tokens, margin=tree.size)
    logits, hidden = prefill(model, cache, torch.tensor([prompt_ids], device=device))
    with torch.inference_mode():
        head_logits = heads(hidden[0], model.lm_head)  # (K, V)
    new = [acceptance.first(logits[0], generator).item()]
    produced = 0
    while True:
        new = new[:max_new_tokens - produced]
        stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop is not None:
            new = new[:stop + 1]
        produced += len(new)
        yield new
        if stop is not None or produced == max_new_tokens:
            return
        new, head_logits = medusa_step(model, heads, tree, cache, new[-1], head_logits,
                                       acceptance, generator)

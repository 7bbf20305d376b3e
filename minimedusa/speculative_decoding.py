"""Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023), the method
Medusa starts from: a cheap model drafts k tokens, the target verifies them in ONE forward of
k + 1 rows and keeps the prefix it agrees with, plus one token of its own. The text is the
target's: exactly its greedy text, or (sampling) its law.

A round, after the text so far (its last token, the root, not yet in the target's cache):
1. the draft proposes d_1..d_k, and when sampling the laws q_1..q_k it drew them from;
2. the target runs [root, d_1, ..., d_k] at the next k + 1 positions, causally: row i's
   logits give p_i, the target's next token after d_1..d_i;
3. greedy: d_{i+1} is kept while it is p_i's argmax; the first disagreement's argmax (all kept:
   p_k's, the bonus token) closes the round. Sampling: d_{i+1} is kept with probability
   min(1, p_i(d) / q_i(d)); at the first rejection the round closes with a draw from
   norm(max(0, p_i - q_i)); all kept, with the bonus drawn from p_k. (speculative_sampling.py
   proves the law for trees of drawn candidates; a chain is the tree of one child a node.)
4. the target's cache keeps the root and the kept drafts (the other rows are forgotten, later
   rounds write over them); the draft's keeps what it holds of the text so far.
k: each round's, chosen by a budget (budget.py's Budget, as it chooses tree sizes: from each
size's measured round time and tokens; the chain of k drafts is the tree (0,), (0, 0), ... of k
nodes, and k = 0 a plain step of the target).
The draft (ModelDraft): any model sharing the target's tokenizer; the same model rounded to 4
bits is an almost perfect one (cli/draft_model.py makes it), and it may decode with its own
Medusa heads (MedusaDraft: Medusa inside the draft). Left out: several drafts a position (a
tree of the draft's guesses), and batches of prompts.

Shapes: k drafted tokens, T = k + 1 rows, V vocab.
"""
from typing import Iterator

import torch

from minimedusa.acceptance import (Acceptance, Sampling, draw, greedy_tokens, make_generator,
                                   probabilities)
from minimedusa.decoding import cut_at_stop, medusa_decode, new_cache, prefill
from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, at_least_float32, causal_mask


class ModelDraft:
    """A draft model with a cache of its own: it proposes k tokens after the text so far,
    greedily, or drawn at the target's temperature and top-p (returning the laws it drew them
    from), and counts what it proposed and what the target kept."""

    def __init__(self, model: Llama, sampling: Sampling):
        self.model, self.sampling = model, sampling
        # its own draws, apart from the verifier's coins (seeded one on, as DrawnDraft's)
        seed = None if sampling.seed is None else sampling.seed + 1
        self.generator = make_generator(model.embed.weight.device, seed)
        self.cache: KVCache | None = None
        self.proposed = self.kept = 0

    def start(self, capacity: int) -> None:
        """A fresh cache for a run whose text reaches `capacity` tokens."""
        self.cache = KVCache.for_model(self.model, capacity)

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Run ids after the cached tokens: the next token's logits (V,) in float32."""
        logits, _ = prefill(self.model, self.cache,
                            torch.tensor([ids], device=self.cache.device))  # (1, V)
        return logits[0]

    def propose(self, text: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """(k tokens after text, their laws (k, V) when sampling, else None). The draft feeds
        what of text it has not cached (the last round's close, a kept draft), then its own
        tokens but the last."""
        logits = self.feed(text[self.cache.length:])
        tokens, laws = [], []
        for i in range(k):
            if self.sampling.greedy:
                token = greedy_tokens(logits).item()
            else:
                laws.append(probabilities(logits, self.sampling.temperature,
                                          self.sampling.top_p))
                token = draw(laws[-1], self.generator).item()
            tokens.append(token)
            if i < k - 1:
                logits = self.feed([token])
        self.proposed += k
        return tokens, torch.stack(laws) if laws else None

    def keep(self, length: int, kept: int) -> None:
        """The text now agrees with what the draft fed for its first `length` tokens: the rest
        of its cache (rejected drafts) is forgotten. kept: the drafts the target kept."""
        self.cache.rewind(length)
        self.kept += kept


class MedusaDraft(ModelDraft):
    """A draft model decoding with its own heads: each round's k drafts come from
    decoding.medusa_decode on the draft's cache (several tokens a forward where its heads guess
    right; its trees' sizes chosen by its own budget, round after round). Greedy only: the
    target's speculative sampling needs the law each draft was drawn from."""

    def __init__(self, model: Llama, heads_draft, budget, acceptance: Acceptance):
        super().__init__(model, Sampling())
        self.heads_draft, self.budget, self.acceptance = heads_draft, budget, acceptance

    def start(self, capacity: int) -> None:
        super().start(capacity + max(self.budget.sizes) + 1)  # room for a step's tree

    def propose(self, text: list[int], k: int) -> tuple[list[int], None]:
        """k tokens after text: medusa_decode prefills what of text the cache lacks, and leaves
        it holding text and the drafts but the last, as ModelDraft.propose does."""
        steps = medusa_decode(self.model, self.heads_draft, self.budget, self.acceptance, text,
                              k, set(), self.cache)
        self.proposed += k
        return [token for step in steps for token in step], None


@torch.inference_mode()
def verify(target: Llama, cache: KVCache, root: int, drafted: list[int],
           laws: torch.Tensor | None, sampling: Sampling, generator) -> list[int]:
    """One forward of [root, *drafted] (T rows) after the target's cache: the kept drafts, then
    the target's own token. The cache keeps the root and the kept drafts."""
    n, T = cache.length, len(drafted) + 1
    device = cache.device
    tokens = torch.tensor([[root, *drafted]], device=device)  # (1, T)
    positions = torch.arange(n, n + T, device=device)[None]  # (1, T)
    logits, _ = target(tokens, positions, causal_mask(n, T, device), cache,
                       cache.next_slots(T))  # (1, T, V)
    logits = at_least_float32(logits[0])  # (T, V)
    if sampling.greedy:
        kept, last = greedy_kept(logits, drafted)
    else:
        p = probabilities(logits, sampling.temperature, sampling.top_p)  # (T, V)
        kept, last = sampled_kept(p, drafted, laws, generator)
    cache.advance(1 + kept)  # the root and the kept drafts; the rejected rows are forgotten
    return drafted[:kept] + [last]


def greedy_kept(logits: torch.Tensor, drafted: list[int]) -> tuple[int, int]:
    """(how many drafts the target's argmax keeps, its token after them); logits (T, V)."""
    picks = greedy_tokens(logits).tolist()  # (T,): the one host sync of a greedy round
    kept = 0
    while kept < len(drafted) and drafted[kept] == picks[kept]:
        kept += 1
    return kept, picks[kept]


def sampled_kept(p: torch.Tensor, drafted: list[int], laws: torch.Tensor,
                 generator) -> tuple[int, int]:
    """(drafts kept, the closing token) by speculative sampling: draft i kept with probability
    min(1, p_i(d) / q_i(d)); the first rejected one replaced by a draw from
    norm(max(0, p_i - q_i)); all kept, a bonus drawn from p's last row. p (T, V), laws (k, V)."""
    for i, token in enumerate(drafted):
        coin = torch.rand((), generator=generator, device=p.device)
        if coin * laws[i, token] >= p[i, token]:  # rejected: u >= p / q
            residual = (p[i] - laws[i]).clamp(min=0)  # draw() normalises it
            return i, draw(residual, generator).item()
    return len(drafted), draw(p[-1], generator).item()


def speculative_decode(target: Llama, draft: ModelDraft, budget, sampling: Sampling,
                       prompt_ids: list[int], max_new_tokens: int,
                       stop_ids: set[int]) -> Iterator[list[int]]:
    """Yield the new tokens round by round, until a stop id (yielded) or max_new_tokens: first
    the prefill's token, then each round's kept drafts and its closing token. Each round's k
    is budget.choose()'s (0: a plain step of the target); its time and kept drafts go back to
    the budget. Greedy: exactly the target's plain greedy tokens, whatever the draft."""
    device = target.embed.weight.device
    generator = sampling.generator(device)
    margin = max(budget.sizes) + 1  # a round writes its k + 1 rows before keeping some
    cache = new_cache(target, len(prompt_ids), max_new_tokens, margin)
    draft.start(cache.capacity)
    logits, _ = prefill(target, cache, torch.tensor([prompt_ids], device=device))
    text, new, produced = list(prompt_ids), [sampling.pick(logits, generator).item()], 0
    while True:
        new, stop = cut_at_stop(new, max_new_tokens - produced, stop_ids)
        produced += len(new)
        text += new
        yield new
        if stop or produced == max_new_tokens:
            return
        start = budget.clock()
        k = budget.choose()
        drafted, laws = draft.propose(text, k) if k else ([], None)
        new = verify(target, cache, text[-1], drafted, laws, sampling, generator)
        kept = len(new) - 1
        draft.keep(len(text) + kept, kept)  # it fed the text, then its drafts but the last
        # the chain's i-th draft is the node (0,) * i, held by every k >= i: its rank is i
        accepted = [(0,) * (i + 1) for i in range(kept)]
        budget.record(k, budget.clock() - start, accepted, {path: len(path) for path in accepted})

"""Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023), the method
Medusa starts from, as a draft of Medusa's own loop (decoding.medusa_decode): a cheap model
proposes k tokens after the text so far, d_1..d_k, a chain from the root; the chain is the tree
(0,), (0, 0), ... of k nodes, and the target verifies it as it verifies any tree, in ONE forward
of k + 1 rows. Greedy acceptance keeps d_i while it is the target's argmax; speculative sampling
(speculative_sampling.verify_drawn: a chain is the tree of one child a node) keeps d_i with
probability min(1, p_i(d_i) / q_i(d_i)), q_i the law the draft drew it from (the chain's
Proposal), and closes at the first rejection with a draw from norm(max(0, p_i - q_i)). The text
is the target's: exactly its greedy text, or (sampling) its law. k is each step's tree size,
chosen by the Budget (budget.py) from each size's timed step and kept drafts (0: a plain step).

ModelDraft: any model sharing the target's tokenizer, with a cache of its own; the same model
rounded to 4 bits is an almost perfect one (assembly/draft_model.py reads it).
DraftModelWithHeads: a draft model decoding with Medusa heads of its own (medusa_decode on its
cache: several drafts a forward of it).
Left out: several drafts a position (a tree of the draft's guesses), batches of prompts.

Shapes: k drafted tokens, V vocab.
"""
import torch

from minimedusa.acceptance import Acceptance, draw, greedy_tokens, make_generator, probabilities
from minimedusa.context_candidates import merged_tree
from minimedusa.decoding import medusa_decode, prefill
from minimedusa.draft import Candidates
from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama
from minimedusa.speculative_sampling import Proposal, proposal_q


def chain_paths(k: int) -> tuple[tuple, ...]:
    """The node paths of a chain of k drafts: (0,), (0, 0), ..., each the first child of the
    last."""
    return tuple((0,) * depth for depth in range(1, k + 1))


def chain_proposal(drafts: list[int], laws: list[torch.Tensor]) -> Proposal:
    """What a chain's drafts were drawn from, as speculative sampling verifies them: at each
    parent (the root, d_1, ...) its one child, drawn from q (V,), a column of the vocabulary."""
    parents = [(0,) * depth for depth in range(len(drafts))]
    return Proposal(q=dict(zip(parents, laws)), columns={p: [d] for p, d in zip(parents, drafts)},
                    draws={p: [d] for p, d in zip(parents, drafts)})


class ModelDraft:
    """A draft model (draft.py's five verbs): each step's candidates are k tokens it proposes
    after the text so far, greedily (temperature 0) or drawn at the target's temperature and
    top-p, with the laws they were drawn from. It keeps the text (the prompt, each step's root
    and accepted drafts) and a cache of its own, and counts what it proposed and what was
    kept in the run."""

    def __init__(self, model: Llama, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None):
        self.model, self.temperature, self.top_p = model, temperature, top_p
        # its own draws, apart from the verifier's coins (seeded one on, as DrawnDraft's)
        self.generator = make_generator(model.embed.weight.device,
                                        None if seed is None else seed + 1)
        self.text: list[int] = []
        self.cache: KVCache | None = None
        self.proposed = self.kept = 0

    def start(self, prompt_ids: list[int], cache) -> None:
        """A fresh cache of the target's capacity, the text so far (the prompt), and the run's
        counts from 0 (a step timed before it proposes too: assembly/step_latency.py)."""
        self.text, self.cache = list(prompt_ids), KVCache.for_model(self.model, cache.capacity)
        self.proposed = self.kept = 0

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[-1]  # the draft reads its own model, not the target's states

    def match(self, root: int) -> int:
        self.text.append(root)  # the last token emitted: the text the draft continues
        return 0  # every step in the budget's one group

    def tree(self, model, n: int, root: int, features: torch.Tensor) -> Candidates:
        """The chain of n drafts after the text, its tokens [root, d_1, .., d_n] on the target's
        device, each path's rank its depth; drawn drafts with their laws (the Proposal)."""
        drafts, laws = self.propose(n)
        self.proposed += n
        paths = chain_paths(n)
        tokens = torch.tensor([root, *drafts], device=features.device)  # (n + 1,)
        tree = merged_tree(paths, features.device)
        proposal = None if laws is None else chain_proposal(drafts, laws)
        q = None if laws is None else lambda: proposal_q(tree, tokens, proposal)
        return Candidates(tree, tokens, {p: len(p) for p in paths}, proposal, q,
                          drafter="draft model")

    def propose(self, k: int) -> tuple[list[int], list[torch.Tensor] | None]:
        """(k tokens after the text, the laws (V,) they were drawn from, or None: greedy).
        note: the cache holds what the draft fed the last time (the text then, its drafts but
        the last); of it, what agrees with the text now (all but its last token: the last gives
        the first draft's logits) is kept, the rejected drafts forgotten."""
        self.forget_rejected()
        logits = self.feed(self.text[self.cache.length:])
        tokens, laws = [], []
        for i in range(k):
            if self.temperature == 0:
                token = greedy_tokens(logits).item()
            else:
                laws.append(probabilities(logits, self.temperature, self.top_p))
                token = draw(laws[-1], self.generator).item()
            tokens.append(token)
            if i < k - 1:
                logits = self.feed([token])
        return tokens, laws or None

    def forget_rejected(self) -> None:
        """Cut the cache to what agrees with the text: all of it but its last token."""
        self.cache.rewind(len(self.text) - 1)

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Run ids after the cached tokens: the next token's logits (V,) in float32."""
        logits, _ = prefill(self.model, self.cache, torch.tensor([ids], device=self.cache.device))
        return logits[0]

    def extend(self, tokens: list[int]) -> None:
        """The step's accepted drafts join the text (the draft's cache is cut to them at its
        next proposal)."""
        self.text += tokens
        self.kept += len(tokens)


class DraftModelWithHeads(ModelDraft):
    """A draft model decoding with its own heads: each step's k drafts come from
    decoding.medusa_decode on the draft's cache (several tokens a forward where its heads guess
    right; its trees' sizes chosen by its own budget, step after step). Greedy only: speculative
    sampling needs the law each draft was drawn from."""

    def __init__(self, model: Llama, heads_draft, budget, acceptance: Acceptance):
        super().__init__(model)
        self.heads_draft, self.budget, self.acceptance = heads_draft, budget, acceptance

    def start(self, prompt_ids: list[int], cache) -> None:
        super().start(prompt_ids, cache)
        self.cache = KVCache.for_model(self.model, cache.capacity + max(self.budget.sizes) + 1)

    def propose(self, k: int) -> tuple[list[int], None]:
        """k tokens after the text: medusa_decode feeds what of the text the cache lacks, and
        leaves it holding the text and the drafts but the last, as ModelDraft.propose does."""
        self.forget_rejected()
        steps = medusa_decode(self.model, self.heads_draft, self.budget, self.acceptance,
                              self.text, k, set(), self.cache)
        return [token for step in steps for token in step.tokens], None

"""Decoding, in the order the data flows: plain decoding (the reference), then Medusa decoding.

Plain: prefill the prompt into a static KV cache (a fresh one, or a conversation's that already
holds the prompt's first tokens: the rest is prefilled), then one forward per new token. It is
what every speedup is measured against (acceleration rate 1.0, paper section 7) and what
Medusa's greedy output must equal token for token.
Medusa (paper sections 2-3), one step: the heads' top-k at the last accepted position give the
candidates (the draft, draft.py: Medusa heads guess every depth at once, Hydra heads depth by
depth, heads.py); all N tree tokens run through the model in ONE forward after the cached prefix,
with the tree mask; acceptance verifies the candidates along the root-to-leaf paths; the
accepted tokens' keys/values are copied into place (KV compaction); the heads read the hidden
state at the last accepted node, which gives the next step's candidates with no extra forward.
Elsewhere: many prompts at once (batch_decoding.py; Medusa in a batch: experiments/), the step
replayed from CUDA graphs on a GPU (speed/cuda_graphs.py). Left out: beam search.

Shapes: T tokens, V vocab, C model dim, K heads, N tree nodes, D max depth, n cached tokens.
"""
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from minimedusa.acceptance import Acceptance, Sampling, Verdict, make_generator
from minimedusa.draft import Candidates, Draft
from minimedusa.errors import UserError
from minimedusa.kv_cache import KVCache
from minimedusa.model import EXACT_ATTENTION_TOKENS, Llama, at_least_float32, causal_mask
from minimedusa.tree import MedusaTree


class PromptTooLongError(UserError):
    """The prompt plus the requested new tokens exceed the model's context."""


@dataclass
class Step:
    """What one step of a decoding run did, the value the loops yield: whoever watches a run
    (the streamed text, --show's colours, --trace's page, bench, the chat) reads it, never the
    loop's parts. tokens: the tokens it added; kept: the nodes it kept, root first ([0] a plain
    step's root; none for the prefill, the run's first step); candidates: what it verified
    (draft.Candidates: the tree, its tokens, what drafted them; None for a plain step); verdict:
    the rule's (acceptance.Verdict: the numbers it decided by)."""
    tokens: list[int]
    kept: list[int] = field(default_factory=list)
    candidates: Candidates | None = None
    verdict: Verdict | None = None


def check_context(model: Llama, prompt_len: int, max_new_tokens: int) -> None:
    """The prompt plus the new tokens must fit the model's context: checked before any cache is
    written, so that the error names the real problem."""
    context = model.config.max_position_embeddings
    if prompt_len + max_new_tokens > context:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens and {max_new_tokens} new ones were asked for, "
            f"but the model's context is {context} tokens")


def new_cache(model: Llama, prompt_len: int, max_new_tokens: int, margin: int = 0) -> KVCache:
    """A cache for prompt + new tokens (+ a margin for Medusa's tree tokens), checked against
    the model's context length first."""
    check_context(model, prompt_len, max_new_tokens)
    return KVCache.for_model(model, capacity=prompt_len + max_new_tokens + margin)


def decoding_cache(model: Llama, cache: KVCache | None, prompt_ids: list[int],
                   max_new_tokens: int, margin: int = 0) -> KVCache:
    """The cache a decoding run writes in: a new one (cache None), or the caller's, holding a
    conversation so far (a chat's earlier turns) whose cache.length tokens must be the first
    of prompt_ids: the run prefills only the rest, and leaves the cache holding the
    conversation (the prompt and the answer but its last token, which no step has fed yet).
    note: the cache cannot check which tokens it holds (it keeps keys and values, not ids):
    the caller keeps them (cli/chat.py); here the lengths are checked."""
    if cache is None:
        return new_cache(model, len(prompt_ids), max_new_tokens, margin)
    check_context(model, len(prompt_ids), max_new_tokens)
    if not cache.length < len(prompt_ids):  # the prefill's last logits give the first token
        raise ValueError(f"the cache holds {cache.length} tokens: the prompt ({len(prompt_ids)}"
                         ") must add at least one")
    if len(prompt_ids) + max_new_tokens + margin > cache.capacity:
        raise ValueError(f"a cache of {cache.capacity} slots cannot hold {len(prompt_ids)} + "
                         f"{max_new_tokens} tokens and a margin of {margin}")
    return cache


@torch.inference_mode()
def prefill(model: Llama, cache: KVCache, prompt: torch.Tensor):
    """Run the prompt (1, T) through the model after the cache's n tokens (none, or a
    conversation so far), at positions n, n + 1, ...

    Returns (logits (1, V) at the prompt's last position only: the LM head over every prompt
    token would be wasted work (49k x 576 per token on the default model), hidden (T, C) at
    every position: a draft layer reads them all, other heads the last).
    Logits come back in float32 (or float64) whatever the weights' dtype, as from every step: the
    acceptance and sampling math runs in float32 (and on a CPU torch's argmax over bfloat16 is
    several times slower than over float32).
    subtle: in chunks of at most EXACT_ATTENTION_TOKENS, so that a long prompt never switches to
    SDPA (model.attention), whose sums round otherwise: a token's row is then the same bits
    whether it came in a prompt, a chat's later turn or a decoding step, and a conversation
    continued in its cache answers as a fresh run given the whole history does.
    """
    hidden = []
    for chunk in prompt.split(EXACT_ATTENTION_TOKENS, dim=1):  # (1, <= 256) each
        n, T = cache.length, chunk.shape[1]
        positions = torch.arange(n, n + T, device=prompt.device).unsqueeze(0)  # (1, T)
        hidden.append(model.hidden_states(chunk, positions, causal_mask(n, T, prompt.device),
                                          cache, cache.next_slots(T))[0])  # (T, C)
        cache.advance(T)
    hidden = torch.cat(hidden)  # (T, C)
    return at_least_float32(model.lm_head(hidden[-1:])), hidden


# --- plain decoding: one forward per token -----------------------------------------------------

@torch.inference_mode()
def decode_step(model: Llama, cache: KVCache, token: torch.Tensor):
    """Feed one token (1, 1) at the end of the cached sequence: (logits (1, V) for the next
    token, hidden (1, C) at this one)."""
    n = cache.length
    positions = torch.full((1, 1), n, device=token.device)  # (1, 1)
    logits, hidden = model(token, positions, causal_mask(n, 1, token.device), cache,
                           cache.next_slots(1))  # (1, 1, V), (1, 1, C)
    cache.advance(1)
    return at_least_float32(logits[:, -1]), hidden[:, -1]


def plain_decode(model: Llama, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int], cache: KVCache | None = None) -> Iterator[Step]:
    """Yield the steps (a Step of one token each) until a stop id (which is yielded) or
    max_new_tokens. The caller times and streams; this only decodes. `cache`: a
    conversation's, holding prompt_ids' first tokens (decoding_cache), or None: a new one."""
    device = model.embed.weight.device
    cache = decoding_cache(model, cache, prompt_ids, max_new_tokens)
    generator = sampling.generator(device)
    rest = torch.tensor([prompt_ids[cache.length:]], device=device)  # (1, T): not yet cached
    logits, _ = prefill(model, cache, rest)
    for i in range(max_new_tokens):
        token = sampling.pick(logits, generator)  # (1,)
        token_id = token.item()  # the one host sync per step: needed to stop at EOS
        yield Step([token_id], kept=[0] if i else [])
        if token_id in stop_ids or i == max_new_tokens - 1:
            return
        logits, _ = decode_step(model, cache, token.unsqueeze(0))


# --- Medusa decoding: one forward of the candidate tree per step -------------------------------

def tree_mask(tree: MedusaTree, n: int) -> torch.Tensor:
    """(1, N, n + N) bool: every tree token sees the whole cached prefix, then the tree mask
    (itself and its ancestors, never a sibling or another branch)."""
    prefix = torch.ones(tree.size, n, dtype=torch.bool, device=tree.mask.device)
    return torch.cat([prefix, tree.mask], dim=1).unsqueeze(0)


@torch.inference_mode()
def tree_forward(model: Llama, cache: KVCache, tree: MedusaTree, tokens: torch.Tensor):
    """Run the tree's tokens (N,) after the n cached ones; (logits (N, V), hidden (N, C)).

    subtle: a node's RoPE position is n + depth (siblings are alternative tokens for the SAME
    position) while its cache slot is n + node index (each node needs its own keys/values);
    compaction later moves the accepted nodes' entries to slots n, n + 1, ...
    """
    positions = (cache.length + tree.depth).unsqueeze(0)  # (1, N)
    logits, hidden = model(tokens.unsqueeze(0), positions, tree_mask(tree, cache.length), cache,
                           cache.next_slots(tree.size))  # (1, N, V), (1, N, C)
    return at_least_float32(logits[0]), hidden[0]


def medusa_step(model: Llama, candidates: Candidates, cache: KVCache, acceptance: Acceptance,
                generator) -> tuple[Step, torch.Tensor]:
    """One step: verify the draft's candidates (its tree's tokens (N,), the root first: the last
    token emitted, not yet in the cache) in one forward, the acceptance given them whole.

    Returns (the Step: the new tokens (the accepted candidates, then the next token drawn at
    the last accepted node), the accepted nodes' indices, root first, the candidates and the
    rule's verdict; the hidden states (a, C) at the accepted nodes, the last of which the heads
    guess the next step's candidates from).
    """
    tree = candidates.tree
    logits, hidden = tree_forward(model, cache, tree, candidates.tokens)  # (N, V), (N, C)
    verdict = acceptance.accept(logits, candidates, generator)  # the one host sync
    cache.compact(verdict.kept)  # the accepted nodes' keys/values into place; rejected dropped
    return Step(verdict.tokens, verdict.kept, candidates, verdict), hidden[verdict.kept]


def root_step(model: Llama, cache: KVCache, root: int, acceptance: Acceptance,
              generator) -> tuple[Step, torch.Tensor]:
    """A step whose tree is the root alone: plain decoding's step, returned as medusa_step
    returns (the two mix in one run), without the heads' draft, which it does not need."""
    token = torch.tensor([[root]], device=cache.device)  # (1, 1)
    logits, hidden = decode_step(model, cache, token)  # (1, V), (1, C)
    return Step([acceptance.first(logits[0], generator).item()], [0]), hidden


def medusa_decode(model: Llama, draft: Draft, budget, acceptance: Acceptance,
                  prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                  cache: KVCache | None = None) -> Iterator[Step]:
    """Yield the steps forward by forward (decoding.Step: its new tokens, what it verified and
    kept), until a stop id (yielded) or max_new_tokens: first the prefill's token, then each
    step's accepted candidates + the next token.

    Each step: the draft's tree of the size n that `budget` chooses (budget.FixedSize: the
    paper's one tree every step, budget.fixed; a budget.Budget adapts n to this machine's step
    times and the accepted lengths, 0 being a plain step) and its tokens (draft.py: the heads'
    guesses; ranked trees and context candidates are drafts too), verified in one forward by
    `acceptance`; every step's time, group and accepted path go back to the budget. Lossless
    under greedy acceptance whatever the draft. `cache`: a conversation's, or None
    (decoding_cache)."""
    device = model.embed.weight.device
    generator = make_generator(device, acceptance.seed)
    # the margin: a step writes all its tree's tokens before compaction drops the rejected ones
    cache = decoding_cache(model, cache, prompt_ids, max_new_tokens, max(budget.sizes) + 1)
    draft.start(prompt_ids, cache)
    rest = torch.tensor([prompt_ids[cache.length:]], device=device)  # (1, T): not yet cached
    logits, hidden = prefill(model, cache, rest)
    step, features = Step([acceptance.first(logits[0], generator).item()]), draft.read(hidden)
    produced = 0
    while True:
        tokens, stop = cut_at_stop(step.tokens, max_new_tokens - produced, stop_ids)
        produced += len(tokens)
        yield replace(step, tokens=tokens)
        if stop or produced == max_new_tokens:
            cache.rewind(len(prompt_ids) + produced - 1)  # a cut step's later tokens: dropped
            return
        start, root = budget.clock(), tokens[-1]  # root: the last token emitted
        group = draft.match(root)
        n = budget.choose(group)
        if n == 0:
            step, hidden = root_step(model, cache, root, acceptance, generator)
            accepted, rank = [], None
        else:
            candidates = draft.tree(model, n, root, features)
            step, hidden = medusa_step(model, candidates, cache, acceptance, generator)
            accepted, rank = [candidates.tree.nodes[i] for i in step.kept[1:]], candidates.rank
        # note: a step's time includes what the draft reads of its kept positions (a draft
        # layer reads them all): every step pays it, plain ones too
        features = draft.read(hidden)
        budget.record(n, budget.clock() - start, accepted, rank, group)
        draft.extend(step.tokens[:-1])  # the accepted candidates; the last is the next root


def cut_at_stop(new: list[int], room: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """A step's tokens cut to the room left and after the first stop id: (tokens, stopped)."""
    new = new[:room]
    stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
    return (new, False) if stop is None else (new[:stop + 1], True)


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

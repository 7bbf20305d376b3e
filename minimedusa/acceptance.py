"""Acceptance (paper section 3): which tree candidates the backbone verifies, and the next token.

Every verify function takes the backbone's logits at each tree node, (N, V) (node i's logits
predict the token of node i's children), the tree and its tokens (N,), and returns three 0-d
tensors: the chosen root-to-leaf path, how many candidates along it were accepted (0..D), and
the next token, drawn from the backbone's distribution at the last accepted node; it becomes the
next step's root; and the numbers it decided by, as it computed them (its Verdict's). Nothing
there syncs with the host: accepted_on_host does, once a step. Each rule is an Acceptance (its
accept and its first token), which the decoding loop runs; accept returns a Verdict.

- greedy: a candidate is accepted iff it is the argmax. Lossless: output == plain greedy.
- rejection sampling: draw y ~ p at every node; a child is accepted iff its token is y. With
  deterministic top-k drafts (q a point mass) this IS speculative sampling's multi-draft rule:
  accepting child x with probability min(1, r(x)/q(x)) = r(x) and updating the residual r to
  norm(max(0, r - q)) after each rejected child is the same as drawing once from p and taking
  the child that matches; a draw that matches no child is the residual sample. Lossless.
- typical: a candidate x is accepted iff p(x) > min(eps, delta * exp(-H(p))), p at temperature
  T; the next token is greedy, so each step yields >= 1 token. Not lossless; eps is the knob.
- speculative sampling of candidates DRAWN from the heads (not their top-k): its own file,
  speculative_sampling.py, as it needs to know what each candidate was drawn from. Lossless.

Shapes: N tree nodes, V vocab, P root-to-leaf paths, D max depth.
"""
from dataclasses import dataclass
from typing import Callable

import torch

from minimedusa.errors import UserError
from minimedusa.tree import MedusaTree


# Turning next-token logits into a token: greedy, or sampling with temperature and top-p.
#
# `probabilities` is the target distribution p that every sampler here draws from; Medusa's
# rejection sampling (paper section 3) will verify its drafts against the very same p.
# Left out: top-k, repetition penalties, min-p.
#
# Shapes: V vocab; "..." any leading dims.


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        return make_generator(device, self.seed)

    def pick(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """One token id per row of logits (..., V) -> (...,), greedy or sampled."""
        if self.greedy:
            return greedy_tokens(logits)
        return draw(probabilities(logits, self.temperature, self.top_p), generator)


def make_generator(device, seed: int | None) -> torch.Generator:
    """A random generator on `device`: seeded (reproducible) or from OS entropy (seed None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-p nucleus and renormalised: (..., V) float32."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (..., V)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V) each
    # a token stays if the tokens ranked above it have not yet reached top_p (so >= 1 stays)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row drawn from probs (..., V) -> (...,) int64, by the inverse of its
    cumulative distribution: a uniform u in [0, total), the first token whose cumulative
    probability exceeds u. The same law as torch.multinomial (tested), with one cumsum and a
    binary search a row, where multinomial on a CPU takes far longer over a 49,152-token row.
    A token of probability 0 owns an empty interval: never drawn."""
    cdf = probs.cumsum(dim=-1)  # (..., V)
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, device=probs.device)
    token = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # (..., 1)
    return token.squeeze(-1).clamp(max=probs.shape[-1] - 1)  # u * total rounded up to total


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), (..., V) -> (...,) int64: the first maximum of each row, a NaN
    counting as one. Plain decoding and greedy acceptance both pick their tokens here, so the
    two stay compared like for like (on a CPU, speed/host_greedy.py's numpy argmax stands in
    for both)."""
    return logits.argmax(dim=-1)


def accept_along_paths(matches: torch.Tensor) -> torch.Tensor:
    """Accepted length of each path: its longest all-True prefix. matches (P, D) -> (P,)."""
    return matches.long().cumprod(dim=-1).sum(dim=-1)


def child_tokens(tree: MedusaTree, tokens: torch.Tensor) -> torch.Tensor:
    """The candidate at depth d + 1 of each path, (P, D); -1 on the padding (never matches)."""
    return tokens[tree.paths[:, 1:]].masked_fill(~tree.path_valid[:, 1:], -1)


def pick_by_draws(draws: torch.Tensor, tree: MedusaTree, tokens: torch.Tensor):
    """Accept each child whose token equals its parent's draw (N,). Children of a node are
    distinct tokens (distinct top-k ranks), so at most one matches and the accepted path is
    unique; any path of the longest length holds it."""
    parents = tree.paths[:, :-1]  # (P, D): the node whose logits judge depth d + 1
    lengths = accept_along_paths(draws[parents] == child_tokens(tree, tokens))  # (P,)
    best = lengths.argmax()
    last = tree.paths[best, lengths[best]]  # the last accepted node
    return best, lengths[best], draws[last]


def greedy_acceptance(logits, tree: MedusaTree, tokens, generator=None):
    argmax = greedy_tokens(logits)  # (N,)
    return (*pick_by_draws(argmax, tree, tokens), {"argmax": argmax})


def candidates_p(probs: torch.Tensor, tree: MedusaTree, tokens) -> torch.Tensor:
    """(P, D): p of the candidate at depth d + 1 of each path, at its parent (on a path's
    padding, tree.path_valid False: no candidate's)."""
    return probs[tree.paths[:, :-1], child_tokens(tree, tokens).clamp(min=0)]


def rejection_acceptance(logits, tree: MedusaTree, tokens, generator, temperature, top_p):
    probs = probabilities(logits, temperature, top_p)  # (N, V) float32
    draws = draw(probs, generator)  # (N,): y ~ p per node
    return (*pick_by_draws(draws, tree, tokens),
            {"p": candidates_p(probs, tree, tokens), "draw": draws})


def typical_threshold(probs: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """The least p a candidate needs at each node, min(eps, delta * exp(-H(p))): (..., V) ->
    (...,). A flat p (high entropy) lowers it: many continuations are plausible there."""
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # H(p); 0 log 0 = 0
    return torch.minimum(torch.full_like(entropy, eps), delta * torch.exp(-entropy))


def typical_acceptance(logits, tree: MedusaTree, tokens, generator, temperature, eps, delta):
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (N, V) p_original at T
    threshold = typical_threshold(probs, eps, delta)  # (N,)
    parents = tree.paths[:, :-1]  # (P, D)
    children = child_tokens(tree, tokens)  # (P, D)
    p_child = probs[parents, children.clamp(min=0)]  # (P, D): p(candidate | its context)
    matches = (p_child > threshold[parents]) & (children >= 0)
    lengths = accept_along_paths(matches)  # (P,)
    # among the longest paths, the most likely: sum of log p over the accepted candidates
    accepted = torch.arange(matches.shape[1], device=logits.device) < lengths[:, None]  # (P, D)
    log_lik = torch.where(accepted, p_child.log(), 0.0).sum(dim=-1)  # (P,)
    best = torch.where(lengths == lengths.max(), log_lik, -torch.inf).argmax()
    last = tree.paths[best, lengths[best]]
    numbers = {"p": p_child, "threshold": threshold}
    return best, lengths[best], greedy_tokens(logits[last]), numbers  # the next token: greedy


@dataclass
class Verdict:
    """What a rule decided on a step's candidates: the kept nodes' indices, root first, and the
    new tokens (the kept candidates, then the next token), Python lists, the step's one host
    sync; and the numbers it decided by, as it ran, by name, kept where they were computed (the
    device) until a watcher reads them (cli/trace.py): greedy "argmax" (N,), the verifier's
    argmax at each node; rejection "p" (P, D), each path's candidates' p at their parents, and
    "draw" (N,), the token drawn at each node; typical "p" (P, D) and "threshold" (N,);
    speculative sampling "judged", each child it judged in order: (child, r(x), q_i(x), coin)."""
    kept: list[int]
    tokens: list[int]
    numbers: dict


@dataclass
class Acceptance:
    """A step's rule: accept(logits (N, V), candidates (draft.Candidates: the tree, its tokens
    (N,), what drawn ones were drawn from), generator) -> its Verdict (the kept nodes, the new
    tokens, the numbers it decided by); first(logits (V,), generator) -> the very first
    token (), drawn from the distribution the rule draws its next tokens from; seed: the seed
    of the run's random draws (None: from the system), as Sampling's for plain decoding."""
    name: str
    accept: Callable
    first: Callable
    seed: int | None = None


def on_device(verify: Callable) -> Callable:
    """accept for a rule verified on the device, verify(logits, tree, tokens, generator) ->
    (path, length, next) 0-d tensors and its numbers: nothing waits until accepted_on_host's
    one sync (the numbers stay on the device)."""
    def accept(logits, candidates, generator) -> Verdict:
        tree, tokens = candidates.tree, candidates.tokens
        path, length, next_token, numbers = verify(logits, tree, tokens, generator)
        return Verdict(*accepted_on_host(tree, tokens, path, length, next_token), numbers)
    return accept


def accepted_on_host(tree: MedusaTree, tokens, path, length, next_token):
    """(the accepted nodes' indices, root first; the new tokens: the accepted candidates and the
    next token) as Python lists.

    note: the one host sync of a Medusa step. The accepted length decides which slots to keep
    and how many tokens to emit, so the host must wait for it; everything before this runs
    on the device without waiting. One .tolist() of one small tensor brings all of it back.
    """
    path_tokens = tokens[tree.paths[path]]  # (D + 1,): the chosen path's tokens, root first
    host = torch.cat([path_tokens, torch.stack([path, length, next_token])]).tolist()
    path_i, length_i, next_i = host[-3:]
    nodes = tree.paths_host[path_i][:length_i + 1]  # paths_host: the same paths, on the host
    return nodes, host[1:length_i + 1] + [next_i]


def greedy() -> Acceptance:
    return Acceptance("greedy", on_device(greedy_acceptance),
                      lambda logits, g: greedy_tokens(logits))


def rejection(temperature: float, top_p: float = 1.0, seed: int | None = None) -> Acceptance:
    if temperature == 0:
        return greedy()  # the T -> 0 limit of sampling

    def verify(logits, tree, tokens, g):
        return rejection_acceptance(logits, tree, tokens, g, temperature, top_p)

    def first(logits, g):
        return draw(probabilities(logits, temperature, top_p), g)

    return Acceptance(f"rejection(T={temperature}, top_p={top_p})", on_device(verify), first,
                      seed)


def typical(temperature: float, eps: float = 0.09, delta: float = 0.3) -> Acceptance:
    if temperature == 0:
        return greedy()  # p at T = 0 is one-hot on the argmax: only the argmax passes

    def verify(logits, tree, tokens, g):
        return typical_acceptance(logits, tree, tokens, g, temperature, eps, delta)

    return Acceptance(f"typical(T={temperature}, eps={eps}, delta={delta})", on_device(verify),
                      lambda logits, g: greedy_tokens(logits))

"""Speculative sampling with drafts drawn from the heads: lossless sampling that accepts more.

acceptance.rejection verifies the heads' top-k, point-mass drafts: a child x is accepted with
probability p(x), so at T = 0.7 a tree accepts little more than what p gives its top guess.
Here the candidates are DRAWN from the heads' own distribution q, and verified by speculative
sampling (Leviathan et al., Chen et al.) with recursive rejection across a node's siblings
(SpecInfer; EAGLE's tree sampling). One candidate alone is accepted with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q): the closer the heads' q is to the backbone's p, the
more they accept, whatever p's entropy.

The rule at a node whose next-token distribution is p, its children x_1, x_2, ... in the order
they were drawn. Start with r_1 = p; for i = 1, 2, ...:
    q_i = the law x_i was drawn from, given the draws before it (x_1..x_{i-1} drawn from q
          without replacement: q with them removed, renormalised; a context candidate, not
          drawn: a point mass on it)
    accept x_i with probability min(1, r_i(x_i) / q_i(x_i)): emit it, go on at its node
    else r_{i+1} = norm(max(0, r_i - q_i))
when every child is rejected (or there is none), the next token is drawn from the last r.

Why the output is exactly p (by induction from the last child back): suppose whatever happens
from child i + 1 on emits a token of law r_{i+1}, for any draws before it. Child i emits y with
probability q_i(y) min(1, r_i(y)/q_i(y)) = min(q_i(y), r_i(y)), and is rejected with
probability sum_y max(0, r_i(y) - q_i(y)) = Z, after which y comes with probability
r_{i+1}(y) = max(0, r_i(y) - q_i(y)) / Z. In all: min(q_i, r_i)(y) + max(0, r_i - q_i)(y) =
r_i(y). After the last child the token is drawn from r itself, so the induction starts; at the
first child r_1 = p. Each accepted child's own children are then verified against p at that
node, so every token of the step, and the whole sequence, follows plain sampling's law. q_i
may depend on anything drawn before x_i (the earlier siblings, other draws that never became
nodes) but not on the verifier's coins: the heads' draws are made before the forward.

Without replacement (Gumbel-top-k: the k largest of log q + Gumbel noise are k draws in order)
a node's siblings are distinct: a repeated draw would be a node that can only be rejected.

Shapes: N tree nodes, V vocab, V' the heads' draft vocabulary, k draws a node.
"""
from dataclasses import dataclass, field

import torch

from minimedusa.acceptance import Acceptance, Verdict, draw, make_generator, probabilities
from minimedusa.draft import Candidates, TreeDraft, guessed_q, tree_tokens
from minimedusa.heads import HydraHeads, token_ids
from minimedusa.tree import MedusaTree


def gumbel_noise(shape, generator, device) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), u ~ U[0, 1), float32."""
    uniform = torch.rand(shape, generator=generator, device=device)
    return -torch.log(-torch.log(uniform.clamp(min=1e-20)))


def draw_without_replacement(logits: torch.Tensor, k: int, temperature: float,
                             noise: torch.Tensor):
    """k draws without replacement from q = softmax(logits / T), in the order drawn, by the
    Gumbel-top-k trick, the k largest of logits / T + noise (standard Gumbel noise of logits'
    shape): (columns (..., k), q (..., V')); logits (..., V')."""
    scaled = logits.float() / temperature
    keys = scaled + noise  # (..., V')
    return keys.topk(k, dim=-1).indices, torch.softmax(scaled, dim=-1)


def step_noise(heads, tree: MedusaTree, width: int, generator, device) -> torch.Tensor:
    """A step's Gumbel noise, drawn at once, in the one layout every drawn draft reads (this
    file's and the fused one, speed/fused_draft.py, so that one seed draws the same candidates
    on both): Hydra heads draw at each parent node, a row a node (N, V'), the row at the node's
    index; Medusa heads draw once a head, a row a head (K, V')."""
    rows = tree.size if isinstance(heads, HydraHeads) else tree.num_heads
    return gumbel_noise((rows, width), generator, device)


@dataclass
class Proposal:
    """What a step's drawn candidates were drawn from: for each parent node path, the heads'
    q there (V',), the columns of q drawn there in order (k,) and their token ids; ids: the
    draft vocabulary's token id of each of q's columns (None: columns are token ids)."""
    q: dict = field(default_factory=dict)  # parent node path -> (V',) float32
    columns: dict = field(default_factory=dict)  # parent node path -> [k columns of q]
    draws: dict = field(default_factory=dict)  # parent node path -> [k token ids]
    ids: torch.Tensor | None = None


class DrawnDraft(TreeDraft):
    """TreeDraft whose candidates are drawn from the heads' q at `temperature`, without
    replacement, instead of their top-k; each step's Candidates carry their Proposal to the
    acceptance, which must know what every candidate was drawn from."""

    def __init__(self, heads, trees: dict[int, MedusaTree], temperature: float,
                 seed: int | None = None, rank: dict | None = None):
        super().__init__(heads, trees, rank)
        self.temperature, self.seed = temperature, seed
        self.generator = None

    def generator_on(self, device) -> torch.Generator:
        """The draws' generator, made once, on the heads' device."""
        if self.generator is None:
            self.generator = make_generator(device, self.seed)
        return self.generator

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        tree = self.trees[n]
        calls = []  # (q (M, V'), the columns drawn (M, k)) of each call of the heads, in order
        noise = []  # the step's (step_noise), drawn at the first call, once its width is known

        def pick(logits, k):
            if not noise:
                noise.append(step_noise(self.heads, tree, logits.shape[-1],
                                        self.generator_on(features.device), features.device))
            # Hydra's call at depth d: its parents' rows (tree.drafting's order); Medusa's: all
            rows = (tree.drafting[len(calls)][0] if isinstance(self.heads, HydraHeads)
                    else slice(None))
            columns, q = draw_without_replacement(logits, k, self.temperature, noise[0][rows])
            calls.append((q, columns))
            return columns

        tokens = tree_tokens(self.heads, model, tree, root, features, pick)
        hydra = isinstance(self.heads, HydraHeads)
        return Candidates(tree, tokens, self.rank, proposal_of(tree, calls, self.heads),
                          q=lambda: guessed_q(tree, calls, hydra, law=lambda q: q))


def proposal_of(tree: MedusaTree, calls: list, heads) -> Proposal:
    """The parents' q and draws from the heads' calls (q (M, V'), columns (M, k)): Hydra heads
    make one call a depth, a row a parent (tree.drafting's order); Medusa heads one call, head
    d's row serving every parent of depth d - 1."""
    if isinstance(heads, HydraHeads):
        rows = [(tree.nodes[parent], q[row], draws[row])
                for (q, draws), (parents, *_) in zip(calls, tree.drafting)
                for row, parent in enumerate(parents.tolist())]
    else:
        q, draws = calls[0]
        rows = [(path, q[len(path)], draws[len(path)]) for path in tree.nodes
                if len(path) < tree.num_heads]
    return proposal_from(rows, heads)


def proposal_from(rows, heads) -> Proposal:
    """A Proposal of rows (parent node path, q (V',), the columns of q drawn there (k,))."""
    proposal = Proposal(ids=heads.vocabulary.ids if heads.vocabulary is not None else None)
    for path, q_row, columns in rows:
        proposal.q[path], proposal.columns[path] = q_row, columns.tolist()
        proposal.draws[path] = token_ids(heads.vocabulary, columns).tolist()
    return proposal


def proposal_q(tree: MedusaTree, tokens: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """(N,) each node's q at its parent where the proposal drew it (its rank's draw is its
    token), NaN where it did not (a context candidate), the root's 1: a Candidates' q for a
    draft that keeps only its Proposal (the fused draw, a draft model's chain)."""
    token_list, q = tokens.tolist(), [1.0] + [float("nan")] * (tree.size - 1)
    for i, path in enumerate(tree.nodes[1:], start=1):
        parent, rank = path[:-1], path[-1]
        draws = proposal.draws.get(parent, [])
        if rank < len(draws) and draws[rank] == token_list[i]:
            q[i] = proposal.q[parent][proposal.columns[parent][rank]].item()
    return torch.tensor(q)


def children_in_order(tree: MedusaTree) -> dict[tuple, list[int]]:
    """Each node path's children (node indices), in the order of their rank: the draw order."""
    children: dict[tuple, list[int]] = {}
    for index, path in sorted(enumerate(tree.nodes), key=lambda item: item[1]):
        if path:
            children.setdefault(path[:-1], []).append(index)
    return children


def law_of(child_path: tuple, token: int, proposal: Proposal | None):
    """q_i, the law the child's token was drawn from, on its support: (the support, token ids
    (S,) or slice(None) for the whole vocabulary; q_i there (S,); q_i(token)). Its parent's q
    without the draws before it, renormalised, if the token is its rank's draw; else a point
    mass on the token (q_i None). A law whose float32 mass underflowed to 0 counts as a point
    mass too (exact but for that)."""
    parent, rank = child_path[:-1], child_path[-1]
    draws = proposal.draws.get(parent, []) if proposal is not None else []
    if rank < len(draws) and draws[rank] == token:
        columns = proposal.columns[parent]
        q = proposal.q[parent].clone()  # (V',)
        q[columns[:rank]] = 0.0  # the draws before it: drawn without replacement
        mass = q.sum().item()
        if mass > 0:
            support = slice(None) if proposal.ids is None else proposal.ids
            return support, q / mass, q[columns[rank]].item() / mass
    return [token], None, 1.0


def verify_drawn(p, tree: MedusaTree, tokens: torch.Tensor, proposal: Proposal | None,
                 generator) -> Verdict:
    """Recursive rejection down the tree: p(i), the backbone's next-token distribution (V,) at
    node i (asked for at the nodes visited only); -> the Verdict every Acceptance returns: the
    accepted nodes' indices, root first; the new tokens (the accepted candidates, then the next
    token); and "judged", each child judged, in order: (child, r(x), q_i(x), the coin).

    The residual r is kept unnormalised, as weights w with a total (r = w / total): a
    rejection then changes w on q_i's support only, w <- max(0, w - total q_i) (the draft
    vocabulary's columns, not the whole vocabulary), and the last draw takes the weights as
    they are."""
    children, token_list = children_in_order(tree), tokens.tolist()
    node, nodes, new, judged = 0, [0], [], []
    weights, total = p(0), 1.0  # r_1 = p at the root
    coins = iter(torch.rand(tree.size, generator=generator, device=tokens.device).tolist())
    while True:
        accepted, own = None, False  # own: weights is this step's copy, free to change
        for child in children.get(tree.nodes[node], []):
            x = token_list[child]
            support, q, q_x = law_of(tree.nodes[child], x, proposal)
            r_x, coin = weights[x].item(), next(coins)
            judged.append((child, r_x / total, q_x, coin))
            if coin * q_x * total < r_x:  # with probability min(1, r(x) / q_i(x))
                accepted = child
                break
            if not own:
                weights, own = weights.clone(), True
            if q is None:  # a point mass: r(x) <= 1 = q_i(x), so max(0, r - q_i) is 0 at x
                weights[x], total = 0.0, total - r_x
                continue
            there = weights[support]  # (S,)
            rest = (there - total * q).clamp(min=0.0)  # max(0, w - total q_i) on the support
            left = total - (there - rest).sum().item()
            # r == q_i leaves nothing (it is never rejected); a rejection then came of float32's
            # rounding, and what it left is rounding too: r is kept
            if left > 1e-6 * total:
                weights[support], total = rest, left
        if accepted is None:
            new.append(draw(weights, generator).item())
            return Verdict(nodes, new, {"judged": judged})
        nodes.append(accepted)
        new.append(token_list[accepted])
        node, weights, total = accepted, p(accepted), 1.0


def speculative(temperature: float, top_p: float = 1.0, seed: int | None = None) -> Acceptance:
    """Speculative sampling of drawn candidates (a DrawnDraft's, maybe inside a context draft:
    their Candidates carry what they were drawn from; a step with none, a context chain alone,
    verifies point masses), lossless at (temperature, top_p): the Acceptance the loop runs."""
    def accept(logits, candidates, generator):
        def p(node):  # (V,) p at a node, computed only where the walk goes
            return probabilities(logits[node], temperature, top_p)
        return verify_drawn(p, candidates.tree, candidates.tokens, candidates.proposal,
                            generator)

    def first(logits, generator):
        return draw(probabilities(logits, temperature, top_p), generator)

    return Acceptance(f"speculative sampling of drawn drafts (T={temperature}, top_p={top_p})",
                      accept, first, seed)

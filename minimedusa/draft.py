"""The draft (paper section 2): each step's candidate tree and its tokens, guessed by the heads
from the hidden state at the last accepted position, before the one forward that verifies them.

The decoding loop (decoding.medusa_decode) asks a draft five things, in the order a run uses
them: start(prompt ids, cache) before the prefill; read(hidden (a, C)) after every forward, what
the heads will read (here the last position's hidden state); match(root), the Budget's group
for the step (how long a suffix a context chain matched: 0 here, context_candidates.py);
tree(model, n, root, features), the step's Candidates: its tree of n nodes, its tokens
(n + 1,), each node path's rank, and what drawn candidates were drawn from, which the loop
hands the acceptance with them; extend(tokens), the step's accepted candidates.

TreeDraft is the paper's: a fixed tree every step (budget.fixed), or one of nested trees of the
sizes the Budget chooses among (budget.nested_trees). Others: the confidence-ranked tree
(RankedDraft, below), context candidates around any draft (context_candidates.ContextDraft).

Shapes: C model dim, K heads, V vocab (V' the heads' draft vocabulary), N tree nodes.
"""
import heapq
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from minimedusa.heads import (DraftVocabulary, HydraHeads, MedusaHeads, as_features,
                              drafting_lm_head, hydra_candidates, token_ids)
from minimedusa.tree import MedusaTree, build_tree


@dataclass
class Candidates:
    """A step's draft, handed whole from the draft to the acceptance: the tree, its tokens (N,)
    root first, each node path's rank (what the Budget records a step by), and for candidates
    drawn from the heads what they were drawn from (speculative_sampling.Proposal; None: every
    candidate is a point mass, as the heads' top-k are). For whoever watches the step (the
    decoding loop yields it in its Step): q, where the draft has it, computes each node's
    probability at its parent under what drafted it, (N,) (the root's 1; NaN where nothing
    drafted it), from values the draft computed anyway, only when asked; context, the node
    paths a context chain proposed (context_candidates.py); drafter, what guessed the rest:
    "heads" (head k the nodes of depth k) or "draft model" (speculative_decoding.py)."""
    tree: MedusaTree
    tokens: torch.Tensor
    rank: dict
    proposal: object = None
    q: Callable[[], torch.Tensor] | None = None
    context: tuple = ()
    drafter: str = "heads"


class Draft(Protocol):
    """The five verbs decoding.medusa_decode asks of a draft (the module's docstring says when);
    TreeDraft below is the paper's."""

    def start(self, prompt_ids: list[int], cache) -> None: ...

    def read(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def match(self, root: int) -> int: ...

    def tree(self, model, n: int, root: int, features: torch.Tensor) -> Candidates: ...

    def extend(self, tokens: list[int]) -> None: ...


def best_guesses(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's guesses: the k largest logits' columns, best first, (..., V) -> (..., k)."""
    return logits.topk(k, dim=-1).indices


def noting(calls: list, pick=best_guesses):
    """pick, each call's logits (M, V') and the columns it picked (M, k) noted in `calls`: what
    a step's q is computed from if a watcher asks (guessed_q)."""
    def noted(logits, k):
        columns = pick(logits, k)
        calls.append((logits, columns))
        return columns
    return noted


def guessed_q(tree: MedusaTree, calls: list, hydra: bool, law=None) -> torch.Tensor:
    """(N,): each node's probability at its parent under the heads, from the calls noted
    (law(logits) -> q (M, V'): softmax by default; the root's 1). Hydra heads make a call a
    depth, a row a parent with children (tree.drafting's order); Medusa heads one call, head
    d's row guessing every node of depth d (laid out as candidates() lays the tokens)."""
    law = law or (lambda logits: logits.float().softmax(dim=-1))
    if not hydra:
        logits, columns = calls[0]
        guessed = law(logits).gather(-1, columns).reshape(-1)  # (D * top_k,)
        return torch.cat([guessed.new_ones(1), guessed])[tree.token_index]
    q = torch.ones(tree.size, device=calls[0][0].device)
    for (logits, columns), (_, children, slot, rank) in zip(calls, tree.drafting):
        q[children] = law(logits).gather(-1, columns)[slot, rank]
    return q


def candidates(root: torch.Tensor, head_logits: torch.Tensor, tree: MedusaTree,
               vocabulary: DraftVocabulary | None = None, pick=best_guesses) -> torch.Tensor:
    """The tree's tokens: (N,) int64, from the root token () and the heads' logits (K, V).

    The heads' top-k are laid out flat as [root, head 1's top-k, head 2's top-k, ...], and
    tree.token_index says where each node's token sits in that list (tree.py). `vocabulary`:
    the draft vocabulary whose columns the heads score, if any (heads.DraftVocabulary);
    `pick`: how a head's k guesses are chosen from its logits (best_guesses;
    speculative_sampling.py draws them)."""
    top = token_ids(vocabulary, pick(head_logits[:tree.num_heads], tree.top_k))
    flat = torch.cat([root.reshape(1), top.reshape(-1)])  # (1 + D * top_k,)
    return flat[tree.token_index]


@torch.inference_mode()
def guess(heads: MedusaHeads, model, hidden: torch.Tensor) -> torch.Tensor:
    """The heads' logits (K, V) at one position, from its hidden state (C,) (V': over the
    heads' draft vocabulary, when they have one)."""
    return heads(hidden, drafting_lm_head(heads.vocabulary, model.lm_head))


def tree_tokens(heads: MedusaHeads | HydraHeads, model, tree: MedusaTree,
                root: int | torch.Tensor, hidden: torch.Tensor, pick=best_guesses) -> torch.Tensor:
    """The tree's candidate tokens (N,), root first, guessed at the position whose hidden state
    (or what the heads read there: a draft's read) is hidden (C,). Medusa heads guess every
    depth at once from h_t alone; Hydra heads read the draft's own tokens, so they guess depth
    by depth (heads.HydraHeads). root: its token id, or a 0-d tensor of it on hidden's device (a
    CUDA graph's input, speed/cuda_graphs.py)."""
    root = torch.as_tensor(root, device=hidden.device)
    if isinstance(heads, HydraHeads):
        return hydra_candidates(heads, model, hidden, root, tree, pick)
    return candidates(root, guess(heads, model, hidden), tree, heads.vocabulary, pick)


def nested_rank(trees: dict[int, MedusaTree]) -> dict:
    """Each node path's place in trees nested by size: the smaller trees' paths first, each
    tree's in its own order."""
    rank = {}
    for n in sorted(trees):
        for path in trees[n].nodes[1:]:
            rank.setdefault(path, len(rank) + 1)
    return rank


class TreeDraft:
    """The heads' guesses on a tree of each size the budget may ask for: trees[n]; rank: each
    node path's place in the nested trees (the tree of n nodes holds the paths of rank <= n:
    budget.nested_trees gives the grown order), which the Budget records a step by; by default
    the smaller trees' paths first, each tree's in its own order (one tree: its order)."""

    def __init__(self, heads: MedusaHeads | HydraHeads, trees: dict[int, MedusaTree],
                 rank: dict | None = None):
        self.heads, self.trees = heads, trees
        self.rank = rank if rank is not None else nested_rank(trees)

    def start(self, prompt_ids: list[int], cache) -> None:
        pass  # nothing to set up: the heads read one hidden state, the last

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the heads read after a forward that kept hidden (a, C): the last position's."""
        return as_features(self.heads, hidden[-1])

    def match(self, root: int) -> int:
        return 0  # no context chain: every step in the budget's one group

    def tree(self, model, n: int, root: int, features: torch.Tensor) -> Candidates:
        """trees[n], its tokens (n + 1,), root first, each node path's rank; q from the heads'
        logits the guesses were ranked by."""
        tree, calls = self.trees[n], []
        tokens = tree_tokens(self.heads, model, tree, root, features, noting(calls))
        hydra = isinstance(self.heads, HydraHeads)
        return Candidates(tree, tokens, self.rank, q=lambda: guessed_q(tree, calls, hydra))

    def extend(self, tokens: list[int]) -> None:
        pass  # the accepted tokens change nothing the heads keep


# A confidence-ranked tree (EAGLE-2's dynamic tree, here for both kinds of heads): each step
# keeps the N nodes whose paths the heads themselves find most probable at this step.
#
# The static tree (training/tree_search.py, budget.grow_tree) is the best tree on average: its
# nodes were chosen from the heads' accuracies measured offline. But at each step the heads say
# how sure they are: after "The capital of France is" head 1 may put 0.9 on " Paris", elsewhere
# 0.2 on its best guess. The path probability of node (r_1, ..., r_d) is the product of the
# heads' probabilities of the guesses on its path, p_1(r_1) ... p_d(r_d): for Medusa heads each
# head's own distribution; for Hydra heads head d's distribution given the path's tokens. It
# estimates how likely the path is to be accepted, so the N most probable nodes are this step's
# best guess of the best tree of N nodes. The tree and its mask are built anew each step; the
# tree forward, acceptance and KV compaction are unchanged, so decoding stays lossless.
#
# A node path's ranks mean what they mean in a static tree: (r_1, ..., r_d) is the r_d-th best
# guess at its parent (r_1, ..., r_{d-1}). A child is never more probable than its parent, so the
# N most probable nodes always form a tree.
#
# Shapes: K heads, V vocab (V' with a draft vocabulary), R guesses ranked per node, N nodes.


def most_probable_paths(probs: list[list[float]], n: int) -> list[tuple]:
    """The n node paths of highest path probability, most probable first, when every node at
    depth d has the same guesses: probs[d - 1][r] (descending in r) is head d's r-th best.
    best of a frontier that starts as {(0,)} and grows, at each popped node, by its first child
    and its next sibling visits the nodes in order of probability."""
    frontier = [(-probs[0][0], (0,), 1.0)]  # (-path probability, path, its parent's)
    paths = []
    while frontier and len(paths) < n:
        negative, path, parent = heapq.heappop(frontier)
        paths.append(path)
        d, r = len(path), path[-1]
        if r + 1 < len(probs[d - 1]):  # the next sibling
            heapq.heappush(frontier, (-parent * probs[d - 1][r + 1], path[:-1] + (r + 1,), parent))
        if d < len(probs):  # the first child
            heapq.heappush(frontier, (negative * probs[d][0], path + (0,), -negative))
    return paths


@torch.inference_mode()
def ranked_medusa_draft(heads, model, root: int, hidden: torch.Tensor,
                        size: int) -> tuple[MedusaTree, torch.Tensor, list[tuple]]:
    """(this step's tree of `size` nodes, its tokens (size + 1,), root first, its node paths
    most probable first) for Medusa heads: one call of the heads, as in a static tree, then the
    most probable paths."""
    logits = heads(hidden, drafting_lm_head(heads.vocabulary, model.lm_head))  # (K, V')
    top = logits.softmax(-1).topk(min(size, logits.shape[-1]), dim=-1)  # (K, R)
    paths = most_probable_paths(top.values.tolist(), size)  # the one host sync of the draft
    tree = build_tree(paths, device=hidden.device)
    # laid out as a static tree's candidates: [root, head 1's top-k, ...] at tree.token_index
    ids = token_ids(heads.vocabulary, top.indices[:tree.num_heads, :tree.top_k])  # (D, top_k)
    guesses = torch.cat([torch.tensor([root], device=ids.device), ids.reshape(-1)])
    return tree, guesses[tree.token_index], paths


@torch.inference_mode()
def ranked_hydra_draft(heads: HydraHeads, model, root: int, hidden: torch.Tensor, size: int,
                       beam: int = 4) -> tuple[MedusaTree, torch.Tensor, list[tuple]]:
    """(this step's tree of `size` nodes, its tokens (size + 1,), root first, its node paths
    most probable first) for Hydra heads, whose guesses at a node depend on its path: depth by
    depth, head d runs on the `beam` most probable nodes of depth d-1 and ranks R guesses under
    each; of all the nodes made, the `size` most probable are kept."""
    lm_head = drafting_lm_head(heads.vocabulary, model.lm_head)
    R = min(size, lm_head.weight.shape[0])
    made = {(): (1.0, root)}  # node path -> (path probability, token)
    layer = [()]
    for d in range(1, heads.config.medusa_num_heads + 1):
        path_tokens = torch.tensor([[made[p[:j]][1] for j in range(d)] for p in layer],
                                   device=hidden.device)  # (M, d): root .. node
        top = heads.head(d, hidden, path_tokens, model.embed, lm_head).softmax(-1).topk(R, -1)
        ids = token_ids(heads.vocabulary, top.indices)  # (M, R)
        for p, probs, tokens in zip(layer, top.values.tolist(), ids.tolist()):
            for r in range(R):
                made[p + (r,)] = (made[p][0] * probs[r], tokens[r])
        children = [p for p in made if len(p) == d]
        layer = sorted(children, key=lambda p: -made[p][0])[:beam]
    # most probable first; a parent before its children on ties (a child is never more probable)
    paths = sorted((p for p in made if p), key=lambda p: (-made[p][0], len(p)))[:size]
    tree = build_tree(paths, device=hidden.device)
    tokens = torch.tensor([made[p][1] for p in tree.nodes], device=hidden.device)
    return tree, tokens, paths


def ranked_draft(heads, model, root: int, hidden: torch.Tensor,
                 size: int) -> tuple[MedusaTree, torch.Tensor, list[tuple]]:
    """This step's confidence-ranked tree of `size` nodes, its tokens and its node paths most
    probable first (its first m paths: the ranked tree of m nodes), for either kind."""
    if isinstance(heads, HydraHeads):
        return ranked_hydra_draft(heads, model, root, hidden, size)
    return ranked_medusa_draft(heads, model, root, hidden, size)


class RankedDraft:
    """A draft (draft.py's verbs) whose tree of n nodes is this step's n most probable nodes,
    each step's own order ranking them (its first m paths: its tree of m nodes)."""

    def __init__(self, heads):
        self.heads = heads

    def start(self, prompt_ids: list[int], cache) -> None:
        pass

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        return as_features(self.heads, hidden[-1])

    def match(self, root: int) -> int:
        return 0

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        tree, tokens, order = ranked_draft(self.heads, model, root, features, n)
        return Candidates(tree, tokens, {path: i + 1 for i, path in enumerate(order)})

    def extend(self, tokens: list[int]) -> None:
        pass

"""A confidence-ranked tree (EAGLE-2's dynamic tree, here for both kinds of heads): each step
keeps the N nodes whose paths the heads themselves find most probable at this step.

The static tree (training/tree_search.py, budget.grow_tree) is the best tree on average: its
nodes were chosen from the heads' accuracies measured offline. But at each step the heads say
how sure they are: after "The capital of France is" head 1 may put 0.9 on " Paris", elsewhere
0.2 on its best guess. The path probability of node (r_1, ..., r_d) is the product of the
heads' probabilities of the guesses on its path, p_1(r_1) ... p_d(r_d): for Medusa heads each
head's own distribution; for Hydra heads head d's distribution given the path's tokens. It
estimates how likely the path is to be accepted, so the N most probable nodes are this step's
best guess of the best tree of N nodes. The tree and its mask are built anew each step; the
tree forward, acceptance and KV compaction are unchanged, so decoding stays lossless.

A node path's ranks mean what they mean in a static tree: (r_1, ..., r_d) is the r_d-th best
guess at its parent (r_1, ..., r_{d-1}). A child is never more probable than its parent, so the
N most probable nodes always form a tree.

Shapes: K heads, V vocab (V' with a draft vocabulary), R guesses ranked per node, N nodes.
"""
import heapq

import torch

from minimedusa.draft import Candidates
from minimedusa.heads import as_features, drafting_lm_head, token_ids
from minimedusa.hydra import HydraHeads
from minimedusa.tree import MedusaTree, build_tree


def most_probable_paths(probs: list[list[float]], n: int) -> list[tuple]:
    """The n node paths of highest path probability, most probable first, when every node at
    depth d has the same guesses: probs[d - 1][r] (descending in r) is head d's r-th best.

    Best-first: a node is no more probable than its parent or its elder sibling, so popping the
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

    def tree(self, model, n: int, root: int, features: torch.Tensor, rank: dict):
        tree, tokens, order = ranked_draft(self.heads, model, root, features, n)
        return Candidates(tree, tokens, {path: i + 1 for i, path in enumerate(order)})

    def extend(self, tokens: list[int]) -> None:
        pass

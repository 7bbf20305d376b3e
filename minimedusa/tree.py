"""The candidate tree and its attention mask (paper section 2).

A tree is given by its node paths ("medusa choices"): [0, 1] is "top-1 of head 1, then top-2 of
head 2". Depth 0 is the root, the token chosen from the backbone's LM head; depth k holds picks
of head k. Built once, the tree gives everything a decoding step needs as tensors: the node
order, the N×N tree mask (each node sees itself and its ancestors), each node's depth (its
position offset), where each node's token comes from among the heads' top-k, and the
root-to-leaf paths along which candidates are verified.

    >>> t = build_tree([[0], [1], [0, 0]])
    >>> t.nodes      # tree order: by depth, then by path; the root is ()
    [(), (0,), (1,), (0, 0)]
    >>> t.mask.int().tolist()    # row i: the nodes that node i attends to
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    >>> t.paths.tolist()         # root-to-leaf node indices, padded (see path_valid)
    [[0, 2, 0], [0, 1, 3]]

Shapes: N tree nodes (root included), P root-to-leaf paths, D max depth, K heads.
"""
import itertools
from dataclasses import dataclass

import torch

from minimedusa.errors import UserError


class TreeError(UserError):
    """A malformed tree, or one the heads cannot fill."""


@dataclass
class MedusaTree:
    nodes: list[tuple[int, ...]]  # N node paths in tree order; nodes[0] == () is the root
    depth: torch.Tensor  # (N,) int64: 0 for the root, len(path) otherwise
    mask: torch.Tensor  # (N, N) bool: mask[i, j] iff node j is node i or one of its ancestors
    head: torch.Tensor  # (N,) int64: the head whose guess node i is (0-based; -1 for the root)
    rank: torch.Tensor  # (N,) int64: which of that head's guesses (0 = its top-1)
    token_index: torch.Tensor  # (N,) int64 into [root, head 1's top-k, head 2's top-k, ...]
    paths: torch.Tensor  # (P, D + 1) int64: node indices root -> leaf, padded with 0
    path_valid: torch.Tensor  # (P, D + 1) bool: False on the padding
    paths_host: list[list[int]]  # the same paths, unpadded, kept on the host: after the step's
    # one sync the accepted nodes are looked up here without another device round trip
    top_k: int  # the most guesses read from any head: max rank + 1
    num_heads: int  # the heads the tree reads: its max depth
    # for heads that draft depth by depth (heads.HydraHeads): each node's path, and per depth
    # d = 1..D
    # (the M nodes of depth d-1 with children, depth d's nodes, each one's parent among those M,
    # its rank among its siblings' guesses)
    ancestors: torch.Tensor  # (N, D + 1) int64: node indices root -> node, padded with 0
    drafting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def size(self) -> int:
        return len(self.nodes)

    def to(self, device) -> "MedusaTree":
        move = lambda t: t.to(device)  # noqa: E731
        return MedusaTree(self.nodes, move(self.depth), move(self.mask), move(self.head),
                          move(self.rank), move(self.token_index), move(self.paths),
                          move(self.path_valid), self.paths_host, self.top_k, self.num_heads,
                          move(self.ancestors), [tuple(map(move, d)) for d in self.drafting])


def check_choices(choices, num_heads: int | None, vocab_size: int | None) -> list[tuple]:
    """The node paths as tuples, or a TreeError naming the first problem."""
    if not choices:
        raise TreeError("the tree is empty: give at least one node path, e.g. [[0]]")
    paths = []
    for c in choices:
        if not isinstance(c, (list, tuple)) or not c or \
                not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c):
            raise TreeError(f"malformed node path {c!r}: a non-empty list of ranks >= 0")
        paths.append(tuple(c))
    seen = set()
    for p in paths:
        if p in seen:
            raise TreeError(f"node path {list(p)} appears twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"node path {list(p)} has no parent: {list(p[:-1])} is not in the tree")
        if num_heads is not None and len(p) > num_heads:
            raise TreeError(f"node path {list(p)} has depth {len(p)} but there are only "
                            f"{num_heads} Medusa heads")
        if vocab_size is not None and max(p) >= vocab_size:
            raise TreeError(f"node path {list(p)} asks for rank {max(p)} but the heads only "
                            f"rank {vocab_size} tokens")
    return paths


def build_tree(choices, num_heads: int | None = None, vocab_size: int | None = None,
               device="cpu") -> MedusaTree:
    """Every buffer of the tree given by `choices` (lists or tuples, any order), checked."""
    paths = check_choices(choices, num_heads, vocab_size)
    nodes = [()] + sorted(paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(nodes)}
    N, depth_max = len(nodes), max(len(p) for p in nodes)
    top_k = max(max(p) for p in paths) + 1

    mask = torch.zeros(N, N, dtype=torch.bool)
    for i, p in enumerate(nodes):
        for d in range(len(p) + 1):
            mask[i, index[p[:d]]] = True  # each prefix of p is an ancestor (or p itself)
    # node p is guess p[-1] of head len(p) (0-based: head len(p) - 1); candidates are laid out
    # as [root, head 0's top-k, head 1's top-k, ...], so its token sits at 1 + head * top_k + rank
    head = torch.tensor([len(p) - 1 for p in nodes])  # (N,): -1 for the root
    rank = torch.tensor([p[-1] if p else 0 for p in nodes])  # (N,)
    token_index = torch.where(head >= 0, 1 + head * top_k + rank, 0)  # (N,)
    has_child = {p[:-1] for p in paths}
    leaves = [p for p in nodes if p not in has_child]
    rows = [[index[p[:d]] for d in range(len(p) + 1)] for p in leaves]
    paths_t, valid = padded(rows, depth_max + 1)  # (P, D + 1)
    ancestors, _ = padded([[index[p[:d]] for d in range(len(p) + 1)] for p in nodes],
                          depth_max + 1)  # (N, D + 1)
    return MedusaTree(nodes, torch.tensor([len(p) for p in nodes]), mask, head, rank, token_index,
                      paths_t, valid, rows, top_k, depth_max, ancestors,
                      drafting_order(nodes, index)).to(device)


def padded(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of node indices as one (len(rows), width) int64 tensor padded with 0, and where
    it is not padding."""
    out = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        out[r, :len(row)] = torch.tensor(row)
        valid[r, :len(row)] = True
    return out, valid


def drafting_order(nodes: list[tuple], index: dict) -> list[tuple]:
    """Per depth d = 1..D: (parents (M,), children (n_d,), slot (n_d,), rank (n_d,)): the
    nodes of depth d-1 that have children, the nodes of depth d, which of those parents each
    one hangs off and which of its parent's guesses it is."""
    order = []
    for d in range(1, max(len(p) for p in nodes) + 1):
        children = [p for p in nodes if len(p) == d]
        parents = sorted({index[p[:-1]] for p in children})
        slot = {node: s for s, node in enumerate(parents)}
        order.append((torch.tensor(parents), torch.tensor([index[p] for p in children]),
                      torch.tensor([slot[index[p[:-1]]] for p in children]),
                      torch.tensor([p[-1] for p in children])))
    return order


def dense_tree(top_s: list[int]) -> list[tuple]:
    """The Cartesian tree with top-s_k guesses of head k: sum_k prod_{i<=k} s_i node paths."""
    return [p for k in range(1, len(top_s) + 1)
            for p in itertools.product(*[range(s) for s in top_s[:k]])]


# The paper's 63-node sparse tree for Vicuna-7B (the reference implementation's mc_sim_7b_63):
# its 63 node paths plus the root make 64 tree tokens, reading 4 heads' top-10.
MC_SIM_7B_63 = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
]


# Small trees for a CPU, where each extra tree token costs real time: the top-1 chain of every
# head plus a few second guesses.
NAMED_TREES = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "chain3": [(0,), (0, 0), (0, 0, 0)],
    "chain5": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "cpu_8": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "cpu_16": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
               (0, 0, 1, 0)],
}

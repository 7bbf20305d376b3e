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
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from minimedusa.device import device_name


class TreeError(ValueError):
    """A malformed tree, or one the heads cannot fill."""


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

# Small trees for a CPU, where each extra tree token costs real time (a 64-row matrix product is
# about 20x a one-row one on 2 cores): the top-1 chain of every head plus a few second guesses.
NAMED_TREES = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "chain3": [(0,), (0, 0), (0, 0, 0)],
    "chain5": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "cpu_8": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "cpu_16": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
               (0, 0, 1, 0)],
}


def default_tree(device: torch.device) -> str:
    """The paper's 64-token tree on a GPU (compute to spare); a small one on a CPU."""
    return "mc_sim_7b_63" if device.type == "cuda" else "cpu_8"


@dataclass
class MedusaTree:
    nodes: list[tuple[int, ...]]  # N node paths in tree order; nodes[0] == () is the root
    depth: torch.Tensor  # (N,) int64: 0 for the root, len(path) otherwise
    mask: torch.Tensor  # (N, N) bool: mask[i, j] iff node j is node i or one of its ancestors
    head: torch.Tensor  # (N,) int64: the head whose guess node i is (0-based; -1 for the root)
    rank: torch.Tensor  # (N,) int64: which of that head's guesses (0 = its top-1)
    token_index: torch.Tensor  # (N,) int64 into the step's candidates (see `candidates`)
    paths: torch.Tensor  # (P, D + 1) int64: node indices root -> leaf, padded with 0
    path_valid: torch.Tensor  # (P, D + 1) bool: False on the padding
    paths_host: list[list[int]]  # the same paths, unpadded, kept on the host: after the step's
    # one sync the accepted nodes are looked up here without another device round trip
    top_k: int  # the most guesses read from any head: max rank + 1
    num_heads: int  # the heads the tree reads: its max depth

    @property
    def size(self) -> int:
        return len(self.nodes)

    def to(self, device) -> "MedusaTree":
        move = lambda t: t.to(device)  # noqa: E731
        return MedusaTree(self.nodes, move(self.depth), move(self.mask), move(self.head),
                          move(self.rank), move(self.token_index), move(self.paths),
                          move(self.path_valid), self.paths_host, self.top_k, self.num_heads)


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
    paths_t = torch.zeros(len(rows), depth_max + 1, dtype=torch.long)  # (P, D + 1)
    valid = torch.zeros(len(rows), depth_max + 1, dtype=torch.bool)
    for r, row in enumerate(rows):
        paths_t[r, :len(row)] = torch.tensor(row)
        valid[r, :len(row)] = True
    return MedusaTree(nodes, torch.tensor([len(p) for p in nodes]), mask, head, rank, token_index,
                      paths_t, valid, rows, top_k, depth_max).to(device)


def dense_tree(top_s: list[int]) -> list[tuple]:
    """The Cartesian tree with top-s_k guesses of head k: sum_k prod_{i<=k} s_i node paths."""
    return [p for k in range(1, len(top_s) + 1)
            for p in itertools.product(*[range(s) for s in top_s[:k]])]


def tree_choices(spec: str) -> list:
    """A named tree, a dense tree 'dense:3,2,2', or a JSON file holding a list of node paths."""
    if spec in NAMED_TREES:
        return NAMED_TREES[spec]
    if spec.startswith("dense:"):
        try:
            return dense_tree([int(s) for s in spec.removeprefix("dense:").split(",")])
        except ValueError:
            raise TreeError(f"bad dense tree {spec!r}: use e.g. dense:3,2,2") from None
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"unknown tree {spec!r}: not one of {', '.join(NAMED_TREES)}, "
                        "not dense:s1,s2,..., and no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"tree file {path} is not valid JSON: {e}") from None


# Trees tuned by tree_search for a device and dtype, saved beside the heads they were grown for.
TREES = "trees.json"


def device_key(device: torch.device, dtype: torch.dtype) -> str:
    """trees.json's key: device type, dtype and the hardware itself (with the CPU's thread
    count), because step latencies differ per machine: a 2-node tree tuned on one 2-core CPU
    ran at 0.55x plain decoding on another, where 8 nodes were cheaper than 2."""
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return f"{device_kind(device, dtype)}/{device_name(device)}{threads}"


def device_kind(device: torch.device, dtype: torch.dtype) -> str:
    """"cpu/float32": what a tree tuned on another machine must share with this one."""
    return f"{device.type}/{str(dtype).removeprefix('torch.')}"


def tuned_tree(heads_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple | None:
    """(name, node paths) of the tree tuned beside the heads for this machine; else of one
    tuned for the same device type and dtype on another machine, named so; else None."""
    path = Path(heads_dir) / TREES
    if not path.is_file():
        return None
    trees, key = json.loads(path.read_text()), device_key(device, dtype)
    if key in trees:
        return f"tuned for {key}", trees[key]["nodes"]
    kind = device_kind(device, dtype)
    other = next((k for k in trees if k.startswith(kind + "/")), None)
    if other is None:
        return None
    return (f"tuned for {other}, not this machine (python -m minimedusa.tree_search tunes "
            "one for it)"), trees[other]["nodes"]


def tree_for_heads(spec: str | None, heads, model_config, device, dtype=torch.float32,
                   heads_spec: str | None = None) -> tuple[str, MedusaTree]:
    """(name, tree) for a --tree value, checked against the heads it will read and the
    vocabulary they rank. Without a --tree: the tree tuned for this device and dtype beside the
    heads (tree_search's trees.json, if the heads came from a folder), else the device's
    default named tree without the paths deeper than the heads."""
    device = torch.device(device)
    folder = Path(heads_spec) if heads_spec is not None and Path(heads_spec).is_dir() else None
    if spec is not None:
        name, choices = spec, tree_choices(spec)
    elif folder is not None and (tuned := tuned_tree(folder, device, dtype)) is not None:
        name, choices = tuned
    else:  # a general tree, made for any heads: keep the paths these heads can read
        name, depth = default_tree(device), heads.config.medusa_num_heads
        every = tree_choices(name)
        choices = [path for path in every if len(path) <= depth]
        if len(choices) < len(every):
            name += f" (cut to its paths of at most {depth} nodes: {depth} heads)"
    return name, build_tree(choices, heads.config.medusa_num_heads, model_config.vocab_size,
                            device)


def candidates(root: torch.Tensor, head_logits: torch.Tensor, tree: MedusaTree) -> torch.Tensor:
    """The tree's tokens: (N,) int64, from the root token () and the heads' logits (K, V)."""
    top = head_logits[:tree.num_heads].topk(tree.top_k, dim=-1).indices  # (D, top_k)
    flat = torch.cat([root.reshape(1), top.reshape(-1)])  # (1 + D * top_k,)
    return flat[tree.token_index]

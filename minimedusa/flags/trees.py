"""--tree's values: a named tree (tree.NAMED_TREES), a dense one (dense:3,2,2), a JSON file of
node paths, or ranked:N; each at most MAX_TREE_NODES nodes, refused in one line past it.
"""
import json
import math
from pathlib import Path

import torch

from minimedusa.tree import NAMED_TREES, TreeError, dense_tree


# The most nodes a tree may have: its nodes are the rows of one forward (and a tree mask of
# nodes x nodes), so past a thousand a step costs far more than it could accept on any machine,
# and tens of thousands exhaust the memory (the paper's largest useful tree had 64).
MAX_TREE_NODES = 1024


def tree_choices(spec: str) -> list:
    """A named tree, a dense tree 'dense:3,2,2', or a JSON file holding a list of node paths;
    at most MAX_TREE_NODES nodes."""
    if spec in NAMED_TREES:
        return NAMED_TREES[spec]
    if spec.startswith("dense:"):
        try:
            top_s = [int(s) for s in spec.removeprefix("dense:").split(",")]
        except ValueError:
            raise TreeError(f"bad dense tree {spec!r}: use e.g. dense:3,2,2") from None
        if min(top_s) < 1:
            raise TreeError(f"bad dense tree {spec!r}: each head keeps >= 1 guess")
        check_tree_size(dense_size(top_s), spec)  # before listing: 100,100,100 lists a million
        return dense_tree(top_s)
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"unknown tree {spec!r}: not one of {', '.join(NAMED_TREES)}, "
                        "not dense:s1,s2,..., and no such file")
    try:
        choices = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TreeError(f"tree file {path} is not valid JSON: {e}") from None
    if isinstance(choices, list):
        check_tree_size(len(choices), spec)
    return choices


def dense_size(top_s: list[int]) -> int:
    """sum_k prod_{i<=k} s_i: the nodes of dense:s_1,...,s_K."""
    return sum(math.prod(top_s[:k]) for k in range(1, len(top_s) + 1))


def check_tree_size(nodes: int, spec: str) -> None:
    """A TreeError naming the bound if a tree of `nodes` nodes is not allowed."""
    if nodes > MAX_TREE_NODES:
        raise TreeError(f"tree {spec!r} has {nodes} nodes; at most {MAX_TREE_NODES} are "
                        "allowed (a step's rows: the paper's largest useful tree had 64)")


def ranked_size(spec: str) -> int | None:
    """N of a --tree ranked:N (ranked_tree.py: each step's N most probable nodes); None for
    --tree ranked, whose N the budget chooses step by step."""
    if spec == "ranked":
        return None
    size = spec.removeprefix("ranked:")
    if not size.isdigit() or not 1 <= int(size) <= MAX_TREE_NODES:
        raise TreeError(f"bad tree {spec!r}: use ranked:N with N >= 1 nodes, at most "
                        f"{MAX_TREE_NODES} (a step's rows: the paper's largest useful tree had 64)")
    return int(size)


def default_tree(device: torch.device) -> str:
    """The paper's 64-token tree on a GPU (compute to spare); a small one on a CPU."""
    return "mc_sim_7b_63" if device.type == "cuda" else "cpu_8"

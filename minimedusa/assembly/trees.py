"""--tree's values: a named tree (tree.NAMED_TREES), a dense one (dense:3,2,2), a JSON file of
node paths, ranked:N, or grown:N (the first N nodes grown from the heads' calibration); each at
most MAX_TREE_NODES nodes, refused in one line past it. And without --tree, the trees the Budget
chooses among (budget_trees: grown from the heads' calibration, or the default tree where the
heads have none; their step latencies are timed with the run's own draft and acceptance by the
recipe, recipe.py).
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

from minimedusa.budget import SIZES, Budget, expected_length, grow_tree, nested_trees
from minimedusa.context_candidates import CHAIN
from minimedusa.errors import UserError
from minimedusa.files.heads_files import read_calibration
from minimedusa.heads import ranked_vocab_size
from minimedusa.model import Llama
from minimedusa.speed.defaults import default_tree, largest_grown_tree
from minimedusa.tree import NAMED_TREES, MedusaTree, TreeError, build_tree, dense_tree


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
    except RecursionError:  # lists nested thousands deep: JSON's reader recurses
        choices = None
    if not (isinstance(choices, list) and all(
            isinstance(node, list) and all(type(i) is int and i >= 0 for i in node)
            for node in choices)):
        raise TreeError(f"tree file {path} must hold a JSON list of node paths, each a list of "
                        "integers >= 0 (the k-th guess of each head on the way): "
                        "[[0], [1], [0, 0]]")
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
    """N of a --tree ranked:N (draft.RankedDraft: each step's N most probable nodes); None for
    --tree ranked, whose N the budget chooses step by step."""
    if spec == "ranked":
        return None
    size = spec.removeprefix("ranked:")
    if not size.isdigit() or not 1 <= int(size) <= MAX_TREE_NODES:
        raise TreeError(f"bad tree {spec!r}: use ranked:N with N >= 1 nodes, at most "
                        f"{MAX_TREE_NODES} (a step's rows: the paper's largest useful tree had 64)")
    return int(size)


def grown_size(spec: str) -> int:
    """N of a --tree grown:N: the first N nodes grown from the heads' calibration."""
    size = spec.removeprefix("grown:")
    if not size.isdigit() or not 1 <= int(size) <= MAX_TREE_NODES:
        raise TreeError(f"bad tree {spec!r}: use grown:N with N >= 1 nodes, at most "
                        f"{MAX_TREE_NODES}")
    return int(size)


@dataclass(frozen=True)
class TreeSpec:
    """--tree's value, read once (tree_spec): "adapted" (the grown trees, each step's size
    chosen by the Budget: the default), "ranked" (each step's most probable nodes: `size` of
    them, or None: chosen step by step), "grown" (the first `size` nodes grown from the heads'
    calibration), or "fixed" (`name`: a named tree, dense:s1,s2,..., a JSON file)."""
    kind: str
    size: int | None = None
    name: str | None = None


def tree_spec(text: str | None) -> TreeSpec:
    """--tree's value as a TreeSpec; a malformed size is a TreeError (a fixed tree's file is
    read by decoding_tree)."""
    if text is None:
        return TreeSpec("adapted")
    if text == "ranked" or text.startswith("ranked:"):
        return TreeSpec("ranked", ranked_size(text))
    if text.startswith("grown:"):
        return TreeSpec("grown", grown_size(text))
    return TreeSpec("fixed", name=text)


def decoding_tree(spec: str | None, heads, model: Llama) -> tuple[str, MedusaTree]:
    """(name, tree) for a --tree value, checked against the heads it will read and the
    vocabulary they rank; without one, the device's default named tree without the paths
    deeper than the heads."""
    device = model.embed.weight.device
    if spec is not None:
        name, choices = spec, tree_choices(spec)
    else:  # a general tree, made for any heads: keep the paths these heads can read
        name, depth = default_tree(device), heads.config.medusa_num_heads
        every = tree_choices(name)
        choices = [path for path in every if len(path) <= depth]
        if len(choices) < len(every):
            name += f" (cut to its paths of at most {depth} nodes: {depth} heads)"
    return name, build_tree(choices, heads.config.medusa_num_heads,
                            ranked_vocab_size(heads, model), device)


@dataclass
class BudgetTrees:
    """The trees a Budget chooses among (with plain steps), before their latencies are timed
    (recipe.py times them with the run's own draft and acceptance): {size: tree}, each node
    path's rank in the nested trees, each size's expected tokens a step, and why these."""
    trees: dict[int, MedusaTree]
    rank: dict
    expected: dict[int, float]
    why: str

    def budget(self, latency: dict[int, float], context: bool = False) -> Budget:
        """The Budget over these trees and plain steps, given each size's seconds a step;
        context: whether decoding reads context chains (the Budget then knows how many tokens
        one proposes: context_candidates.CHAIN)."""
        return Budget([0, *self.trees], self.expected, latency, chain=CHAIN if context else 0)


def budget_trees(heads, model: Llama, heads_spec: str, sizes: list[int] | None = None
                 ) -> BudgetTrees:
    """The tree grown from the heads' calibration at each of `sizes` (None: budget.SIZES up to
    the machine's largest, defaults.largest_grown_tree); for heads without a calibration, the
    default tree alone (and an error where sizes are asked for)."""
    weight = model.embed.weight
    folder = Path(heads_spec)
    accuracy = read_calibration(folder) if folder.is_dir() else None
    if accuracy is None and sizes is not None:
        raise UserError(f"trees grown to {', '.join(map(str, sizes))} nodes grow from "
                        f"{heads_spec}/calibration.json, which does not exist (run python -m "
                        "minimedusa.training.tree_search)")
    if accuracy is None:
        name, tree = decoding_tree(None, heads, model)
        nodes, sizes, expected = tree.nodes[1:], [tree.size - 1], {}
        why = f"{name} or plain steps (the heads have no calibration.json)"
    else:
        nodes, probs = grow_tree(accuracy, max(sizes or [largest_grown_tree(weight.device)]))
        sizes = sizes or [n for n in SIZES if n <= len(nodes)]
        expected = {n: expected_length(probs[:n]) for n in sizes}
        why = "grown from the heads' calibration"
    trees, rank = nested_trees(nodes, sizes, heads.config.medusa_num_heads,
                               ranked_vocab_size(heads, model), weight.device)
    return BudgetTrees(trees, rank, expected, why)

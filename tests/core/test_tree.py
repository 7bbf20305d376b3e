"""The tree builder (paper section 2), over random valid trees: the mask is exactly the
ancestor-or-self relation, depths are path lengths, the paths run root to leaf and cover every
node, and each node gets the token of its head and rank."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minimedusa.assembly.trees import tree_choices
from minimedusa.tree import MC_SIM_7B_63, NAMED_TREES, TreeError, build_tree, dense_tree
from minimedusa.draft import candidates
from helpers import trees


def is_prefix(a: tuple, b: tuple) -> bool:
    return b[:len(a)] == a


@settings(max_examples=100, deadline=None)
@given(choices=trees())
def test_tree_mask_is_ancestor_relation(choices):
    tree = build_tree(choices)
    expected = [[is_prefix(tree.nodes[j], tree.nodes[i]) for j in range(tree.size)]
                for i in range(tree.size)]
    assert tree.mask.tolist() == expected


@settings(max_examples=100, deadline=None)
@given(choices=trees())
def test_depths_equal_path_lengths_and_root_comes_first(choices):
    tree = build_tree(choices)
    assert tree.nodes[0] == ()
    assert tree.depth.tolist() == [len(p) for p in tree.nodes]
    assert sorted(tree.nodes[1:]) == sorted(tuple(c) for c in choices)


@settings(max_examples=100, deadline=None)
@given(choices=trees())
def test_paths_run_root_to_leaf_and_cover_every_node(choices):
    tree = build_tree(choices)
    parents = {p[:-1] for p in tree.nodes if p}
    covered = set()
    for row, valid, host in zip(tree.paths.tolist(), tree.path_valid.tolist(), tree.paths_host):
        path = [i for i, v in zip(row, valid) if v]
        assert path == host and valid == sorted(valid, reverse=True)  # padding only at the end
        assert path[0] == 0  # the root
        for a, b in zip(path, path[1:]):  # each step goes from a node to one of its children
            assert tree.nodes[b][:-1] == tree.nodes[a]
        assert tree.nodes[path[-1]] not in parents  # ends at a leaf
        covered.update(path)
    assert covered == set(range(tree.size))


@settings(max_examples=100, deadline=None)
@given(choices=trees(), seed=st.integers(0, 1000))
def test_tokens_land_on_the_right_nodes(choices, seed):
    tree = build_tree(choices)
    g = torch.Generator().manual_seed(seed)
    head_logits = torch.randn(5, 50, generator=g)  # (K, V)
    root = torch.tensor(7)
    tokens = candidates(root, head_logits, tree).tolist()
    ranked = head_logits.argsort(dim=-1, descending=True)  # (K, V)
    assert tokens[0] == 7
    for i, p in enumerate(tree.nodes[1:], start=1):
        assert (tree.head[i].item(), tree.rank[i].item()) == (len(p) - 1, p[-1])
        assert tokens[i] == ranked[len(p) - 1, p[-1]].item()  # head len(p), rank p[-1]


def test_top_k_is_derived_from_the_tree():
    assert build_tree([[0], [0, 0]]).top_k == 1
    assert build_tree([[0], [3], [0, 1]]).top_k == 4
    assert build_tree(MC_SIM_7B_63).top_k == 10


@pytest.mark.parametrize("name", sorted(NAMED_TREES))
def test_named_trees_hold_exactly_their_paths(name):
    tree = build_tree(NAMED_TREES[name])
    assert set(tree.nodes[1:]) == {tuple(p) for p in NAMED_TREES[name]}
    assert tree.size == len(NAMED_TREES[name]) + 1


def test_paper_tree_has_64_tokens_and_reads_4_heads():
    tree = build_tree(tree_choices("mc_sim_7b_63"))
    assert tree.size == 64 and tree.num_heads == 4


def test_dense_tree_has_sum_of_products_nodes():
    assert len(dense_tree([3, 2, 2])) == 3 + 3 * 2 + 3 * 2 * 2
    assert build_tree(tree_choices("dense:3,2,2")).size == 1 + 21


@pytest.mark.parametrize("choices, message", [
    ([], "the tree is empty"),
    ([[0], [0]], r"node path \[0\] appears twice"),
    ([[0], [1, 0]], r"node path \[1, 0\] has no parent: \[1\] is not in the tree"),
    ([[0], [0, 0], [0, 0, 0]], r"depth 3 but there are only 2 Medusa heads"),
    ([[0], [70]], r"asks for rank 70 but the heads only rank 64 tokens"),
    ([[0], [-1]], "malformed node path"),
    ([[0], []], "malformed node path"),
    ([0, 1], "malformed node path"),
])
def test_malformed_trees_are_clear_errors(choices, message):
    with pytest.raises(TreeError, match=message):
        build_tree(choices, num_heads=2, vocab_size=64)


def test_unknown_tree_name_is_a_clear_error(tmp_path):
    with pytest.raises(TreeError, match="unknown tree 'nope'"):
        tree_choices("nope")
    bad = tmp_path / "tree.json"
    bad.write_text("[[0], [0,")
    with pytest.raises(TreeError, match="not valid JSON"):
        tree_choices(str(bad))

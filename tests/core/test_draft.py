"""The confidence-ranked tree (draft.RankedDraft): its nodes are the most probable paths, every
step's tree is a valid tree whose tokens are the heads' guesses, and decoding with it is
lossless for both kinds of heads."""
import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import copycat_model, flat, perturbed_hydra, tiny_model
from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import FixedSize, grow_tree
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.heads import MedusaHeads
from minimedusa.draft import RankedDraft, most_probable_paths, ranked_draft


def path_probability(probs, path) -> float:
    return math.prod(probs[d][r] for d, r in enumerate(path))


@settings(max_examples=50, deadline=None)
@given(depths=st.lists(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=4), min_size=1,
                       max_size=4), n=st.integers(1, 20))
def test_most_probable_paths_are_the_best_n_of_every_path(depths, n):
    probs = [sorted(d, reverse=True) for d in depths]
    every = [p for k in range(1, len(probs) + 1)
             for p in itertools.product(*[range(len(d)) for d in probs[:k]])]
    best = sorted((path_probability(probs, p) for p in every), reverse=True)[:n]
    paths = most_probable_paths(probs, n)
    assert len(paths) == len(best) and len(set(paths)) == len(paths)
    got = sorted((path_probability(probs, p) for p in paths), reverse=True)
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, best))
    assert all(p[:-1] in paths for p in paths if len(p) > 1)  # a tree: every parent is in it


@settings(max_examples=50, deadline=None)
@given(K=st.integers(1, 4), R=st.integers(1, 4), n=st.integers(1, 20), data=st.data())
def test_grow_tree_and_the_ranked_search_find_equally_probable_trees(K, R, n, data):
    """One search written twice: budget.grow_tree (the calibration's tree, children pushed all
    at once) and most_probable_paths (each step's, a node's first child and next sibling):
    where every depth's guesses are ranked, their best n paths hold the same probabilities."""
    rows = [sorted(data.draw(st.lists(st.floats(0.001, 1.0), min_size=R, max_size=R)),
                   reverse=True) for _ in range(K)]
    nodes, probs = grow_tree(torch.tensor(rows, dtype=torch.float64), n)
    paths = most_probable_paths(rows, n)
    assert len(nodes) == len(paths) == min(n, sum(R ** k for k in range(1, K + 1)))
    ranked = sorted((path_probability(rows, p) for p in paths), reverse=True)
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(sorted(probs, reverse=True),
                                                                 ranked))


def test_medusa_ranked_tree_holds_the_heads_guesses():
    model = tiny_model(2)
    heads = MedusaHeads.for_model(model, 3, shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    hidden = torch.randn(32, dtype=torch.float64)
    tree, tokens, order = ranked_draft(heads, model, 9, hidden, 10)
    assert tree.size == 11 and tokens[0] == 9
    assert sorted(order) == sorted(tree.nodes[1:])
    for m in range(1, 11):  # its first m paths are a tree: the ranked tree of m nodes
        assert all(p[:-1] in order[:m] for p in order[:m] if len(p) > 1)
    ranked = heads(hidden, model.lm_head).topk(10, dim=-1).indices  # (K, R)
    for i, node in enumerate(tree.nodes[1:], start=1):
        assert tokens[i] == ranked[len(node) - 1, node[-1]]


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["medusa", "hydra"]), seed=st.integers(0, 10_000),
       size=st.integers(1, 20), repetitive=st.sampled_from([None, 4.0, 10.0]),
       max_new=st.integers(1, 30))
def test_ranked_tree_greedy_equals_plain_greedy(kind, seed, size, repetitive, max_new):
    model = tiny_model(seed) if repetitive is None else copycat_model(seed, repetitive)
    if kind == "hydra":
        heads = perturbed_hydra(model, 3, seed, 0.05)
    else:
        heads = MedusaHeads.for_model(model, 3, shared_lm_head=True).eval().requires_grad_(False)
    prompt = [1 + seed % 60, 2, 3]
    stop = {int(seed % 64)}
    assert flat(medusa_decode(model, RankedDraft(heads), FixedSize(size), greedy(), prompt,
                              max_new, stop)) == \
        flat(plain_decode(model, prompt, max_new, Sampling(), stop))

"""Context candidates (context_candidates.py): the index finds what a slow scan of the sequence
finds (the chain and how long a suffix it matched), the chain merged into a step's tree keeps
the step within its budget, hangs from the root with its tokens in order and never duplicates a
sibling, ranks its nodes so that a smaller step's merged tree is its first nodes, and decoding
with it stays lossless and accepts what the chain proposes."""
import random

import torch
from hypothesis import given, settings, strategies as st

from helpers import copycat_model, NODES
from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import Budget, nested_trees
from minimedusa.context_candidates import ContextDraft, ContextIndex, chain_alone, with_chain
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import TreeDraft
from minimedusa.heads import MedusaHeads


def scanned_chain(tokens: list[int], max_ngram: int, length: int,
                  min_ngram: int) -> tuple[int, list[int]]:
    """The slow reference: for the longest suffix first (down to min_ngram tokens), scan back
    for its last earlier occurrence and return (the suffix's length, what followed it, the
    sequence repeating itself past its end)."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                period = len(tokens) - (start + n)
                return n, [tokens[start + n + i % period] for i in range(length)]
    return 0, []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), split=st.integers(0, 40),
       max_ngram=st.integers(1, 4), length=st.integers(1, 6), min_ngram=st.integers(1, 4))
def test_index_finds_the_chain_a_scan_of_the_sequence_finds(tokens, split, max_ngram, length,
                                                            min_ngram):
    """Built at once or extended piece by piece, the index agrees with the scan."""
    index = ContextIndex(tokens[:split], max_ngram, length, min_ngram)
    index.extend(tokens[split:])
    assert index.match() == scanned_chain(tokens, max_ngram, length, min_ngram)


def tree_tokens(tree):
    """Random distinct tokens per sibling group, as the heads' top-k guesses are."""
    rng, token = random.Random(len(tree.nodes)), {(): 7}
    for p in tree.nodes[1:]:
        siblings = {token[q] for q in token if q[:-1] == p[:-1] and len(q) == len(p)}
        token[p] = rng.choice([t for t in range(20) if t not in siblings])
    return torch.tensor([token[p] for p in tree.nodes])


@settings(max_examples=200, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8, 16]), chain=st.lists(st.integers(0, 19), min_size=1,
                                                               max_size=6))
def test_the_merged_tree_keeps_the_budget_holds_the_chain_and_no_twin_siblings(size, chain):
    trees, rank = nested_trees(NODES, [size], 4, 32, "cpu")
    tree, tokens = trees[size], tree_tokens(trees[size])
    merged, merged_tokens, merged_rank = with_chain(tree, tokens, rank, size, chain)
    token_of = dict(zip(merged.nodes, merged_tokens.tolist()))
    assert merged.size <= size + 1 and token_of[()] == 7
    assert set(merged_rank) == set(merged.nodes[1:])
    # the chain (cut to the budget) is a path from the root
    node = ()
    for token in chain[:size]:
        node = next(p for p in merged.nodes if p[:-1] == node and len(p) == len(node) + 1
                    and token_of[p] == token)
    # a node the heads drafted keeps its token; siblings never share one
    original = dict(zip(tree.nodes, tokens.tolist()))
    for p in merged.nodes:
        siblings = [token_of[q] for q in merged.nodes if q and q[:-1] == p[:-1] and
                    len(q) == len(p)]
        assert len(siblings) == len(set(siblings))
    kept = [p for p in merged.nodes if p in original and merged_rank.get(p, 0) != 1]
    assert all(token_of[p] == original[p] for p in kept)


def token_paths(tree, tokens, nodes) -> set[tuple]:
    """Each node as the tokens on its path from the root: what a node IS, whatever index the
    merge gave it."""
    token_of = dict(zip(tree.nodes, tokens.tolist()))
    return {tuple(token_of[p[:d]] for d in range(1, len(p) + 1)) for p in nodes}


@settings(max_examples=200, deadline=None)
@given(sizes=st.sampled_from([(1, 2), (1, 4), (2, 4), (2, 8), (4, 8), (3, 16), (8, 16)]),
       chain=st.lists(st.integers(0, 19), max_size=6))
def test_a_smaller_steps_merged_tree_is_the_first_nodes_of_a_larger_ones(sizes, chain):
    """What the budget counts a smaller tree's acceptance by (budget.Budget.record): the nodes
    ranked 1..m in an n-node step's merged tree are the m-node step's merged tree."""
    m, n = sizes
    trees, rank = nested_trees(NODES, [m, n], 4, 32, "cpu")
    big_tokens = tree_tokens(trees[n])
    token_of = dict(zip(trees[n].nodes, big_tokens.tolist()))
    small_tokens = torch.tensor([token_of[p] for p in trees[m].nodes])  # the same guesses
    if not chain:  # the heads' own trees and ranks: nested by construction
        return
    big, big_merged, big_rank = with_chain(trees[n], big_tokens, rank, n, chain)
    small, small_merged, _ = with_chain(trees[m], small_tokens, rank, m, chain)
    first = [p for p in big.nodes[1:] if big_rank[p] <= m]
    assert token_paths(big, big_merged, first) == token_paths(small, small_merged,
                                                              small.nodes[1:])


@settings(max_examples=200, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4, 5]), chain=st.lists(st.integers(0, 19), min_size=5,
                                                              max_size=5))
def test_a_chain_that_fills_the_tree_needs_no_draft(size, chain):
    """Where the chain has as many tokens as the step has nodes, with_chain keeps none of the
    heads' nodes: chain_alone (no draft) gives the same tree of tokens and the same ranks."""
    trees, rank = nested_trees(NODES, [size], 4, 32, "cpu")
    tree, tokens = trees[size], tree_tokens(trees[size])  # the heads' draft, thrown away
    merged, merged_tokens, merged_rank = with_chain(tree, tokens, rank, size, chain)
    alone, alone_tokens, alone_rank = chain_alone(7, chain[:size], "cpu")
    assert token_paths(alone, alone_tokens, alone.nodes[1:]) == token_paths(
        merged, merged_tokens, merged.nodes[1:])
    assert sorted(alone_rank.values()) == sorted(merged_rank.values()) == list(range(1, size + 1))


def test_decoding_with_context_candidates_stays_lossless_and_accepts_the_chain():
    """A model that repeats itself: the chain is right often, greedy output is plain greedy's,
    and with the chain a run takes fewer steps than the heads alone."""
    model = copycat_model(4, embed_scale=2.0)
    heads = MedusaHeads.for_model(model, 4, shared_lm_head=True).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():  # heads mostly wrong: what the chain adds shows
            p += torch.randn(p.shape, generator=g, dtype=p.dtype)
    trees, rank = nested_trees(NODES[:8], [4, 8], 4, model.config.vocab_size, "cpu")
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3]
    plain = [t for s in plain_decode(model, prompt, 48, Sampling(), set()) for t in s.tokens]
    steps = {}
    for context in (False, True):
        budget = Budget([0, 4, 8], {4: 2.0, 8: 2.0}, {0: 1.0, 4: 1.0, 8: 1.0})
        draft = TreeDraft(heads, trees, rank)
        draft = ContextDraft(draft) if context else draft
        out = list(medusa_decode(model, draft, budget, greedy(), prompt, 48, set()))
        assert [t for s in out for t in s.tokens] == plain
        steps[context] = len(out)
    assert steps[True] < steps[False]

"""Speculative sampling of drawn drafts is lossless: tested against the exact law on a Markov
chain (as test_rejection_exact.py tests the point-mass rule), siblings drawn without
replacement, a rank drawn but not a node, a context candidate (a point mass) among drawn
siblings, drafts over a draft vocabulary (q on some tokens only); against plain sampling
through medusa_decode for Medusa and Hydra heads, with context candidates; one candidate is
accepted with probability 1 - TV(p, q). Broken versions (the law of a later sibling taken as q
itself, drafts drawn from another q than the one verified against, q's columns taken as token
ids) fail the same tests, so they can fail."""
import dataclasses
from collections import Counter

import pytest
import torch

from minimedusa import speculative_sampling
from minimedusa.budget import fixed
from minimedusa.context_candidates import ContextDraft
from minimedusa.decoding import medusa_decode
from minimedusa.acceptance import probabilities
from minimedusa.speculative_sampling import (DrawnDraft, Proposal, draw_without_replacement,
                                             gumbel_noise, speculative, verify_drawn)
from minimedusa.tree import build_tree
from helpers import (ALPHA, chain, chi_square_p_value, exact_law, goodness_of_fit, M, N_SAMPLES,
                    plain_samples, rejection_setup as setup, RUNS, slow_except, V)

DRAWS = 3  # draws a node, without replacement
# half test_rejection_exact's sequences: a total variation of 0.05 (not 0.035) gives a
# noncentrality >= 100 there, still caught with probability > 0.99 (its power note)
SAMPLES = N_SAMPLES // 2
TREES = {  # every node's token drawn at its parent
    "drawn siblings": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    "rank 1 drawn, not a node": [[0], [2], [0, 0], [0, 2], [2, 0], [0, 0, 0]]}
POINT_MASS = [[0], [1], [3], [0, 0], [3, 0]]  # rank 3: not drawn, a fixed token (as a context one)


def drawn_step(tree, table, guesses, root: int, temperature: float, g, draft_temperature=None,
               ids=None):
    """One step's candidates on the chain: at each parent (token a) DRAWS draws from the
    draft's q = softmax(guesses[a] / T) without replacement (over the draft vocabulary's
    tokens `ids` only, if given: q's columns); a node of rank >= DRAWS holds the fixed token
    a + 1 (mod V). -> (tokens (N,), the Proposal)."""
    proposal, tokens = Proposal(ids=ids), {(): root}
    for path in tree.nodes[1:]:
        parent = path[:-1]
        if parent not in proposal.draws:
            a = tokens[parent]
            scores = guesses[a] if ids is None else guesses[a][ids]  # (V',)
            columns, q = draw_without_replacement(scores[None], DRAWS,
                                                  draft_temperature or temperature,
                                                  gumbel_noise((1, len(scores)), g, "cpu"))
            proposal.columns[parent] = columns[0].tolist()
            proposal.draws[parent] = (columns[0] if ids is None else ids[columns[0]]).tolist()
            proposal.q[parent] = torch.softmax(scores.float() / temperature, dim=-1)
        draws = proposal.draws[parent]
        tokens[path] = draws[path[-1]] if path[-1] < DRAWS else (tokens[parent] + 1) % V
    return torch.tensor([tokens[p] for p in tree.nodes]), proposal


def sequences(tree, table, guesses, temperature, top_p, n, seed, draft_temperature=None,
              ids=None):
    """n sequences of M tokens after token 0, from drawn steps verified by verify_drawn."""
    g, counts, emitted, steps = torch.Generator().manual_seed(seed), Counter(), 0, 0
    probs = probabilities(table, temperature, top_p).float()  # (V, V): p after each token
    for _ in range(n):
        sequence = []
        while len(sequence) < M:
            root = sequence[-1] if sequence else 0
            tokens, proposal = drawn_step(tree, table, guesses, root, temperature, g,
                                          draft_temperature, ids)
            new = verify_drawn(probs[tokens].__getitem__, tree, tokens, proposal, g).tokens
            sequence += new
            emitted, steps = emitted + len(new), steps + 1
        counts[tuple(sequence[:M])] += 1
    return counts, emitted / steps


def chain_and_guesses():
    table, _ = chain(0)
    g = torch.Generator().manual_seed(5)
    return table, table + 1.5 * torch.randn(V, V, generator=g, dtype=torch.float64)


# each shape, and each setting of temperature and top-p, once: the shapes and the settings
# reach different code (the tree's layout; the law's scaling and nucleus), not their pairs
@pytest.mark.parametrize("shape, temperature, top_p", slow_except([
    ("drawn siblings", 1.0, 0.8), ("rank 1 drawn, not a node", 0.7, 1.0),
    ("a point mass among drawn siblings", 1.0, 1.0)], ("drawn siblings", 1.0, 0.8)))
def test_drawn_drafts_emit_the_plain_law_exactly(shape, temperature, top_p):
    tree = build_tree(TREES.get(shape, POINT_MASS), num_heads=3)
    table, guesses = chain_and_guesses()
    counts, per_step = sequences(tree, table, guesses, temperature, top_p, SAMPLES, seed=1)
    p = goodness_of_fit(counts, exact_law(table, 0, temperature, top_p))
    assert p > ALPHA, f"Medusa's sequences do not follow plain sampling's law (p = {p:.2g})"
    assert per_step > 1.3  # candidates are accepted: not a test of plain sampling


@pytest.mark.slow  # a draft vocabulary's law, in CI; by default the drawn drafts' law above
@pytest.mark.parametrize("shape, temperature, top_p", [
    ("drawn siblings", 0.7, 1.0), ("a point mass among drawn siblings", 1.0, 0.8)])
def test_drafts_over_a_draft_vocabulary_emit_the_plain_law_exactly(shape, temperature, top_p):
    """q over 3 of the 4 tokens (a draft vocabulary: token 1 is never drawn), so a rejection
    changes the residual on q's columns only and token 1 keeps its mass: the law is still
    plain sampling's."""
    tree = build_tree(TREES.get(shape, POINT_MASS), num_heads=3)
    table, guesses = chain_and_guesses()
    counts, per_step = sequences(tree, table, guesses, temperature, top_p, SAMPLES, seed=2,
                                 ids=torch.tensor([2, 0, 3]))
    p = goodness_of_fit(counts, exact_law(table, 0, temperature, top_p))
    assert p > ALPHA, f"Medusa's sequences do not follow plain sampling's law (p = {p:.2g})"
    assert per_step > 1.3


def law_without_the_earlier_draws_removed(child_path, token, proposal):
    """A later sibling's law taken as its parent's q itself, as if drawn with replacement."""
    parent, rank = child_path[:-1], child_path[-1]
    if proposal is not None and parent in proposal.draws and rank < DRAWS:
        q = proposal.q[parent]
        return slice(None), q, q[token].item()
    return [token], None, 1.0


@pytest.mark.slow  # a control (the law test catches this break): CI's -m slow run
def test_a_sibling_law_that_forgets_the_earlier_draws_fails(monkeypatch):
    monkeypatch.setattr(speculative_sampling, "law_of", law_without_the_earlier_draws_removed)
    table, guesses = chain_and_guesses()
    tree = build_tree(TREES["drawn siblings"], num_heads=3)
    counts, _ = sequences(tree, table, guesses, 1.0, 1.0, SAMPLES, seed=1)
    p = goodness_of_fit(counts, exact_law(table, 0, 1.0, 1.0))
    assert p < ALPHA, f"the broken rule went unnoticed (p = {p:.2g})"


@pytest.mark.slow  # a control (the law test catches this break): CI's -m slow run
def test_drafts_drawn_from_another_q_than_verified_against_fail():
    table, guesses = chain_and_guesses()
    tree = build_tree(TREES["drawn siblings"], num_heads=3)
    counts, _ = sequences(tree, table, guesses, 1.0, 1.0, SAMPLES, seed=1,
                          draft_temperature=0.3)
    p = goodness_of_fit(counts, exact_law(table, 0, 1.0, 1.0))
    assert p < ALPHA, f"the broken draft went unnoticed (p = {p:.2g})"


@pytest.mark.parametrize("seed", slow_except([0, 1, 2], 0))
def test_one_candidate_is_accepted_with_probability_one_minus_tv(seed):
    """A one-node tree: the candidate x ~ q is accepted with probability sum min(p, q)."""
    g = torch.Generator().manual_seed(seed)
    p_logits, q_logits = torch.randn(2, 6, generator=g) * 1.5
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    tree, n, accepted = build_tree([[0]], num_heads=1), 20_000, 0
    for _ in range(n):
        columns, _ = draw_without_replacement(q_logits[None], 1, 1.0,
                                              gumbel_noise((1, len(q_logits)), g, "cpu"))
        x = columns[0, 0].item()
        proposal = Proposal(q={(): q}, columns={(): [x]}, draws={(): [x]})
        kept = verify_drawn(lambda node: p, tree, torch.tensor([0, x]), proposal, g).kept
        accepted += len(kept) - 1
    expected = 1 - 0.5 * (p - q).abs().sum().item()
    sigma = (expected * (1 - expected) / n) ** 0.5
    assert abs(accepted / n - expected) < 5 * sigma, (accepted / n, expected)


def drawn_samples(kind: str, temperature: float, top_p: float, context: bool) -> Counter:
    model, heads, tree = setup(kind)
    inner, budget = fixed(heads, tree)
    draft = DrawnDraft(heads, inner.trees, temperature)
    rule = speculative(temperature, top_p)
    outer = ContextDraft(draft) if context else draft
    counts = Counter()
    for s in range(RUNS):
        draft.seed, draft.generator = s + 10_000, None
        steps = medusa_decode(model, outer, budget, dataclasses.replace(rule, seed=s), [1, 2],
                              3, set())
        counts[tuple(t for step in steps for t in step.tokens)] += 1
    return counts


@pytest.mark.parametrize("kind, temperature, top_p, context", slow_except([
    ("medusa", 1.0, 1.0, False), ("medusa", 0.7, 0.8, False), ("hydra", 0.7, 1.0, True)],
    ("hydra", 0.7, 1.0, True)))
def test_drawn_drafts_through_medusa_decode_match_plain_sampling(kind, temperature, top_p,
                                                                 context):
    p = chi_square_p_value(drawn_samples(kind, temperature, top_p, context),
                           plain_samples(temperature, top_p))
    assert p > 0.001, f"continuation distributions differ (p = {p:.2g})"

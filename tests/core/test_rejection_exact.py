"""Rejection sampling is lossless, tested against the exact law: on a Markov chain (the next
token's logits depend on the current token alone, a V x V table) every sequence's probability
under plain sampling is a product of table entries, so the tokens Medusa's steps emit can be
compared with the law itself (a chi-square goodness-of-fit), not with another sample. The
tree has siblings and three depths, and sequences of M tokens span several steps, so later
depths and the steps after an accepted path are tested too.

Power: N_SAMPLES sequences over V^M = 64 outcomes at ALPHA. A sampler whose law q differs from
p is caught when n * chi2(q, p) is well past the test's critical value (~106 for 63 degrees of
freedom at 1e-4); chi2(q, p) >= (2 TV(q, p))^2, so a total variation of 0.035 or more gives a
noncentrality >= 98 at n = 20,000, caught with probability > 0.99. The negative controls below
(a draw that takes the argmax a quarter of the time, a temperature or top-p ignored, the next
token drawn from p instead of the residual) must each fail, with fewer samples."""
from collections import Counter

import pytest
import torch

from minimedusa.acceptance import pick_by_draws, probabilities, rejection_acceptance
from minimedusa.tree import build_tree
from helpers import (ALPHA, argmax_a_quarter_of_the_time, chain, exact_law, goodness_of_fit, M,
                    N_SAMPLES, slow_except, V)

TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3)


def candidates(root: int, ranks: torch.Tensor) -> torch.Tensor:
    """The tree's tokens (N,) after `root`: node p's token is its parent's guess of rank p[-1]
    (so siblings hold distinct tokens, as top-k drafts do)."""
    tokens = {(): root}
    for path in TREE.nodes[1:]:
        tokens[path] = int(ranks[tokens[path[:-1]], path[-1]])
    return torch.tensor([tokens[p] for p in TREE.nodes])


def sampled_sequences(verify, table, ranks, root: int, n: int, seed: int) -> Counter:
    """n sequences of M tokens after `root`, each from Medusa steps (verify's accepted
    candidates, then its next token) repeated from the last token emitted."""
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        sequence = []
        while len(sequence) < M:
            tokens = candidates(sequence[-1] if sequence else root, ranks)
            path, length, next_token, _ = verify(table[tokens], TREE, tokens, g)
            sequence += tokens[TREE.paths[path, 1:int(length) + 1]].tolist() + [int(next_token)]
        counts[tuple(sequence[:M])] += 1
    return counts


def rejection_rule(temperature: float, top_p: float):
    return lambda logits, tree, tokens, g: rejection_acceptance(logits, tree, tokens, g,
                                                                temperature, top_p)


@pytest.mark.parametrize("temperature, top_p", slow_except([(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)],
                                                          (0.7, 1.0)))
def test_rejection_sampling_emits_the_plain_law_exactly(temperature, top_p):
    table, ranks = chain(0)
    counts = sampled_sequences(rejection_rule(temperature, top_p), table, ranks, 0, N_SAMPLES,
                               seed=1)
    p = goodness_of_fit(counts, exact_law(table, 0, temperature, top_p))
    assert p > ALPHA, f"Medusa's sequences do not follow plain sampling's law (p = {p:.2g})"


def test_the_steps_accept_candidates_so_the_test_is_not_of_plain_sampling():
    """A rule that never accepts would emit the plain law too: the chain is built so that the
    drafts are often right, and more than one token a step comes out."""
    table, ranks = chain(0)
    g, emitted, steps = torch.Generator().manual_seed(0), 0, 500
    for root in range(steps):
        tokens = candidates(root % V, ranks)
        _, length, _, _ = rejection_acceptance(table[tokens], TREE, tokens, g, 0.7, 1.0)
        emitted += int(length) + 1
    assert emitted / steps > 1.3


def next_token_from_p_not_the_residual(temperature):
    def verify(logits, tree, tokens, g):
        probs = probabilities(logits, temperature, 1.0)
        path, length, _ = pick_by_draws(torch.multinomial(probs, 1, generator=g)[:, 0], tree,
                                        tokens)
        last = tree.paths[path, length]
        return path, length, torch.multinomial(probs[last], 1, generator=g)[0], {}
    return verify


@pytest.mark.parametrize("broken, asked", [
    (argmax_a_quarter_of_the_time(0.7), (0.7, 1.0)),
    (rejection_rule(1.0, 1.0), (0.7, 1.0)),  # verifies at T = 1 whatever is asked
    (rejection_rule(1.0, 1.0), (1.0, 0.8)),  # ignores top-p
    (next_token_from_p_not_the_residual(1.0), (1.0, 1.0))],
    ids=["argmax a quarter of the time", "temperature ignored", "top-p ignored",
         "next token from p, not the residual"])
def test_a_broken_sampler_fails_the_same_test(broken, asked):
    table, ranks = chain(0)
    counts = sampled_sequences(broken, table, ranks, 0, N_SAMPLES // 4, seed=2)
    law = exact_law(table, 0, *asked)
    impossible = any(law.get(o, 0) == 0 for o in counts)  # top-p's dropped tokens came out
    assert impossible or goodness_of_fit(counts, law) < ALPHA

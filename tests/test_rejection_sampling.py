"""Rejection sampling is lossless: Medusa's continuations follow the same distribution as plain
sampling from the model, at any temperature and top-p (seeded chi-square tests on a tiny model
with a 5-token vocabulary, 3-token continuations). The same test rejects a deliberately wrong
sampler, so it can fail. Both kinds of heads: the paper's and Hydra's."""
import functools
from collections import Counter

import pytest
import torch

from conftest import tiny_model
from minimedusa.budget import fixed
from minimedusa.acceptance import Acceptance, pick_by_draws, rejection
from minimedusa.heads import MedusaHeads
from minimedusa.draft_layer import HydraPlusPlusHeads
from minimedusa.hydra import HydraHeads
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.sampling import Sampling, probabilities
from minimedusa.tree import build_tree

VOCAB, NEW, RUNS = 5, 3, 1000  # the wrong sampler below scores p ~ 1e-15 at this size
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two equal-sized samples from one distribution? Pearson's homogeneity test; outcomes
    seen fewer than 10 times in all are pooled into one bin so the chi-square law holds."""
    outcomes = set(a) | set(b)
    rare = [o for o in outcomes if a[o] + b[o] < 10]
    bins = [(a[o], b[o]) for o in outcomes if o not in rare]
    bins.append((sum(a[o] for o in rare), sum(b[o] for o in rare)))
    bins = [(x, y) for x, y in bins if x + y > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    return torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)).item()


def setup(kind="medusa"):
    model = tiny_model(1, vocab_size=VOCAB)
    kinds = {"medusa": MedusaHeads, "hydra": HydraHeads, "hydra++": HydraPlusPlusHeads}
    heads = kinds[kind].for_model(model, 3).requires_grad_(False)
    with torch.no_grad():  # untrained-looking heads: their guesses are right only sometimes
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2),
                                     dtype=p.dtype))
    return model, heads, build_tree(TREE, num_heads=3)


def medusa_samples(accept: Acceptance, kind="medusa") -> Counter:
    model, heads, tree = setup(kind)
    return Counter(tuple(t for step in medusa_decode(model, heads, *fixed(tree), [1, 2], NEW,
                                                     accept, set(), seed=s) for t in step)
                   for s in range(RUNS))


@functools.cache
def plain_samples(temperature, top_p) -> Counter:
    model, _, _ = setup()
    return Counter(tuple(t for step in plain_decode(model, [1, 2], NEW,
                                                    Sampling(temperature, top_p, seed=s), set())
                         for t in step)
                   for s in range(RUNS, 2 * RUNS))


@pytest.mark.parametrize("kind, temperature, top_p", [
    ("medusa", 1.0, 1.0), ("medusa", 0.7, 1.0), ("medusa", 1.0, 0.8), ("hydra", 1.0, 1.0),
    ("hydra++", 1.0, 1.0)])
def test_rejection_sampling_matches_plain_sampling(kind, temperature, top_p):
    p = chi_square_p_value(medusa_samples(rejection(temperature, top_p), kind),
                           plain_samples(temperature, top_p))
    assert p > 0.001, f"continuation distributions differ (p = {p:.2g})"


def resampling_from_p_not_the_residual(temperature: float) -> Acceptance:
    """The classic bug: after the drafts at a node are rejected, draw the next token from p
    again instead of from the residual, so rejected tokens come back too often."""
    def verify(logits, tree, tokens, g):
        probs = probabilities(logits, temperature, 1.0)
        draws = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        path, length, _ = pick_by_draws(draws, tree, tokens)
        last = tree.paths[path, length]
        return path, length, torch.multinomial(probs[last], 1, generator=g)[0]
    return Acceptance("wrong", verify, rejection(temperature).first)


def test_chi_square_test_rejects_a_wrong_sampler():
    p = chi_square_p_value(medusa_samples(resampling_from_p_not_the_residual(1.0)),
                           plain_samples(1.0, 1.0))
    assert p < 0.001, f"the wrong sampler went unnoticed (p = {p:.2g})"

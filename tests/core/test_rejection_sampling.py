"""Rejection sampling is lossless: Medusa's continuations follow the same distribution as plain
sampling from the model, at any temperature and top-p (seeded chi-square tests on a tiny model
with a 5-token vocabulary, 3-token continuations). The same test rejects a deliberately wrong
sampler, so it can fail. Both kinds of heads: the paper's and Hydra's."""
import dataclasses
import functools
import itertools
from collections import Counter

import pytest
import torch

from minimedusa.budget import Budget, fixed, nested_trees
from minimedusa.acceptance import Acceptance, on_device, pick_by_draws, probabilities, rejection
from minimedusa.context_candidates import ContextDraft
from minimedusa.draft import TreeDraft
from minimedusa.heads import DraftVocabulary
from minimedusa.model import causal_mask
from minimedusa.speed.plug_in import plug_in, plug_in_heads
from minimedusa.speed.weight_formats import format_named
from helpers import (ALPHA, argmax_a_quarter_of_the_time, chi_square_p_value, goodness_of_fit,
                    NEW, plain_samples, rejection_setup as setup, RUNS)
from minimedusa.experiments.draft_layer import PlusPlusDraft
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.decoding import medusa_decode
from minimedusa.speculative_sampling import DrawnDraft, speculative



def medusa_samples(accept: Acceptance, kind="medusa") -> Counter:
    model, heads, tree = setup(kind)
    draft, budget = fixed(heads, tree)
    draft = PlusPlusDraft(draft) if kind == "hydra++" else draft  # read through its layer
    return Counter(tuple(t for step in medusa_decode(model, draft, budget,
                                                     dataclasses.replace(accept, seed=s), [1, 2],
                                                     NEW, set()) for t in step.tokens)
                   for s in range(RUNS))


@pytest.mark.slow  # the law by default: through the default path, below
@pytest.mark.parametrize("kind, temperature, top_p", [  # each kind, each setting, once
    ("medusa", 1.0, 0.8), ("hydra", 0.7, 1.0), ("hydra++", 1.0, 1.0)])
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
        return path, length, torch.multinomial(probs[last], 1, generator=g)[0], {}
    return Acceptance("wrong", on_device(verify), rejection(temperature).first)


@pytest.mark.slow  # a control (the law test catches this break): CI's -m slow run
def test_chi_square_test_rejects_a_wrong_sampler():
    p = chi_square_p_value(medusa_samples(resampling_from_p_not_the_residual(1.0)),
                           plain_samples(1.0, 1.0))
    assert p < 0.001, f"the wrong sampler went unnoticed (p = {p:.2g})"


DEFAULT_NODES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (2,)]
DEFAULT_RUNS, TEMPERATURE, TOP_P = 1500, 1.0, 0.8  # the biased draw below: p ~ 2e-15 here


@functools.cache
def default_path():
    """A model and heads as generate.py samples with by default on a CPU: int4 weights and the
    fused step where group_kernel.c multiplies (else int4 in torch's kernel), Hydra heads that
    draft from a draft vocabulary (48 of 64 tokens), in the model's format; cycling_model with
    its LM head softened, so that a step's nucleus holds a likely token and a long tail."""
    from helpers import cycling_heads, cycling_model
    model = cycling_model(1, hidden_size=64, intermediate_size=128)
    model.lm_head.weight.mul_(0.006)  # logits ~5, not ~750: a distribution to sample from
    heads = cycling_heads(model, "hydra", 1)
    plug_in(model, format_named("int4"), None)
    heads.vocabulary = DraftVocabulary(torch.arange(48), model.lm_head)
    return model, plug_in_heads(heads.float(), model)


def default_path_samples(accept: Acceptance | None, runs: int,
                         seed: int) -> tuple[Counter, float]:
    """The first 2 tokens of `runs` answers of 4, each decoded with context candidates and the
    Budget between nested trees and plain steps (a counting clock: every step one second); and
    the tokens a step over all the runs. accept None: the default above temperature 0, speculative
    sampling of candidates drawn from the heads (fused where it fuses)."""
    model, heads = default_path()
    trees, rank = nested_trees(DEFAULT_NODES, [3, 8], 4, model.config.vocab_size, "cpu")
    counts, tokens, steps = Counter(), 0, 0
    for s in range(seed, seed + runs):
        budget = Budget([0, 3, 8], {3: 1.8, 8: 2.2}, {0: 1.0, 3: 1.1, 8: 1.2},
                        clock=itertools.count().__next__)
        inner = fast_draft(TreeDraft(heads, trees, rank) if accept is not None else
                           DrawnDraft(heads, trees, TEMPERATURE, s + 10**6, rank), model)
        rule = accept if accept is not None else speculative(TEMPERATURE, TOP_P)
        answer = list(medusa_decode(model, ContextDraft(inner), budget,
                                    dataclasses.replace(rule, seed=s),
                                    PROMPT, 4, set()))
        flat = [t for step in answer for t in step.tokens]
        counts[tuple(flat[:2])] += 1
        tokens, steps = tokens + len(flat), steps + len(answer)
    return counts, tokens / steps


PROMPT = [5, 9, 13, 5, 9]


def default_path_law() -> dict[tuple, float]:
    """Plain sampling's law of the first 2 tokens, from the model's own forwards."""
    model, _ = default_path()

    def next_law(ids):
        with torch.inference_mode():
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None],
                              causal_mask(0, len(ids)))
        p = probabilities(logits[0, -1].float(), TEMPERATURE, TOP_P).double()
        return {t: p[t].item() for t in p.nonzero()[:, 0].tolist()}
    return {(a, b): pa * pb for a, pa in next_law(PROMPT).items()
            for b, pb in next_law(PROMPT + [a]).items()}


@pytest.mark.kernels
def test_sampling_through_the_default_path_emits_the_plain_law():
    counts, per_step = default_path_samples(rejection(TEMPERATURE, TOP_P), DEFAULT_RUNS, 0)
    p = goodness_of_fit(counts, default_path_law())
    assert p > ALPHA, f"the default path's samples do not follow plain sampling (p = {p:.2g})"
    assert per_step > 1.1  # candidates were accepted


@pytest.mark.kernels
def test_drawn_drafts_through_the_default_path_emit_the_plain_law():
    counts, per_step = default_path_samples(None, DEFAULT_RUNS, 0)
    p = goodness_of_fit(counts, default_path_law())
    assert p > ALPHA, f"the default path's samples do not follow plain sampling (p = {p:.2g})"
    assert per_step > 1.1  # candidates were accepted


@pytest.mark.slow  # a control (the law test catches this break): CI's -m slow run
@pytest.mark.kernels
def test_a_biased_draw_in_the_default_path_fails_the_same_test():
    """The control: the draws take the backbone's argmax a quarter of the time."""
    broken = Acceptance("biased", on_device(argmax_a_quarter_of_the_time(TEMPERATURE, TOP_P)),
                        rejection(TEMPERATURE, TOP_P).first)
    counts, _ = default_path_samples(broken, DEFAULT_RUNS, DEFAULT_RUNS)
    assert goodness_of_fit(counts, default_path_law()) < ALPHA

"""Greedy and sampled plain decoding: top-p keeps exactly the nucleus, sampling is reproducible
per seed, and the sampled frequencies follow softmax(logits / T)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from minimedusa.decoding import PromptTooLongError, plain_decode
from minimedusa.errors import UserError
from minimedusa.acceptance import Sampling, draw, probabilities
from minimedusa.speed.host_greedy import HostSampling, host_argmax


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.05, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, top_p):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(seed)) * 3
    full = torch.softmax(logits, -1)
    kept = probabilities(logits, 1.0, top_p) > 0
    n = int(kept.sum())
    ranked = full.sort(descending=True).values
    assert kept.tolist() == (full >= ranked[n - 1]).tolist()  # the n most likely tokens
    assert ranked[:n].sum() >= top_p - 1e-6 or n == 20  # they reach top_p ...
    assert n == 1 or ranked[:n - 1].sum() < top_p  # ... and n - 1 would not
    torch.testing.assert_close(probabilities(logits, 1.0, top_p).sum(), torch.tensor(1.0))


def test_greedy_picks_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert Sampling().pick(logits, None).tolist() == [1, 0]


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"),
                                                float("nan")]) | st.floats(-10, 10),
                              min_size=7, max_size=7), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64]), step=st.sampled_from([1, 2]),
       one_row=st.booleans())
def test_the_hosts_argmax_is_torchs_ties_nans_and_strides_alike(rows, dtype, step, one_row):
    """The CPU's argmax (numpy's), which plain and greedy Medusa decoding both use there, picks
    what torch.argmax picks, and so does HostSampling's greedy pick: the first of tied maxima,
    a NaN as the maximum; on strided rows, and on one row (a 0-d result)."""
    logits = torch.tensor(rows, dtype=dtype)[:, ::step]  # (rows, V) possibly strided
    if one_row:
        logits = logits[0]  # (V,)
    got = host_argmax(logits)
    assert got.dtype == torch.int64 and got.shape == logits.shape[:-1]
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert HostSampling().pick(logits, None).tolist() == Sampling().pick(logits, None).tolist()


def test_sampled_frequencies_follow_the_temperature_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    sampling = Sampling(temperature=0.7, seed=0)
    g = sampling.generator("cpu")
    draws = sampling.pick(logits.expand(40_000, 4), g)
    freq = torch.bincount(draws, minlength=4).float() / 40_000
    torch.testing.assert_close(freq, torch.softmax(logits / 0.7, -1), atol=0.01, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draws_follow_the_law_and_never_a_zero_probability_token(seed):
    """sampling.draw (the inverse CDF) against the exact law, as torch.multinomial draws it:
    rows with zeros (a top-p nucleus), a Pearson chi-square over 20,000 draws a row."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(3, 12, generator=g) * 2, dim=-1)
    probs[:, ::3] = 0.0  # tokens outside a nucleus
    probs = probs / probs.sum(dim=-1, keepdim=True)
    n = 20_000
    draws = draw(probs.expand(n, 3, 12).contiguous(), g)  # (n, 3)
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=12).double()
        assert counts[probs[row] == 0].sum() == 0
        expected = n * probs[row].double()
        keep = expected > 0
        stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
        p = torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2),
                                    stat / 2).item()
        assert p > 1e-4, f"row {row}: the draws do not follow the law (p = {p:.2g})"


def test_sampled_decoding_is_reproducible_per_seed():
    model = tiny_model()
    run = lambda seed: [t for s in plain_decode(model, [3, 4, 5], 20,  # noqa: E731
                                                 Sampling(1.0, 0.9, seed), set()) for t in s.tokens]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_decoding_stops_at_eos_and_yields_it():
    model = tiny_model()
    free = [t for s in plain_decode(model, [3, 4, 5], 10, Sampling(), set()) for t in s.tokens]
    stop = free[4]
    out = [t for s in plain_decode(model, [3, 4, 5], 10, Sampling(), {stop}) for t in s.tokens]
    assert out == free[:free.index(stop) + 1]


def test_prompt_longer_than_the_context_is_a_clear_error():
    model = tiny_model(max_position_embeddings=16)
    with pytest.raises(PromptTooLongError, match="the model's context is 16 tokens"):
        next(plain_decode(model, list(range(10)), 8, Sampling(), set()))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5)])
def test_bad_sampling_settings_are_rejected(kwargs):
    with pytest.raises(UserError):
        Sampling(**kwargs)

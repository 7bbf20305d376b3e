"""Medusa decoding: the properties that make it trustworthy, proven on random tiny models.

- tree attention: the logits at every tree node == a plain forward of prefix + that node's path;
- lossless greedy: Medusa greedy output == plain greedy output, token for token;
- KV compaction: after any number of steps the cache == that of a plain forward of the sequence;
- greedy acceptance walked on the host (a CPU's) == the device rule.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import (cached_keys_values, copycat_model, DEVICES, flat, perturbed_heads,
                    tiny_model, trees)
from minimedusa.budget import fixed
from minimedusa.acceptance import Sampling, accepted_on_host, greedy, greedy_acceptance, typical
from minimedusa.heads import HydraHeads
from minimedusa.kv_cache import KVCache
from minimedusa.speed.host_greedy import greedy_on_host
from minimedusa.decoding import (StepStats, medusa_decode, medusa_step, new_cache, plain_decode,
                                 prefill, tree_forward)
from minimedusa.draft import Candidates, tree_tokens
from minimedusa.model import causal_mask
from minimedusa.tree import build_tree

VOCAB = 64


def full_logits(model, tokens: list[int], device):
    T = len(tokens)
    ids = torch.tensor([tokens], device=device)
    logits, _ = model(ids, torch.arange(T, device=device)[None], causal_mask(0, T, device))
    return logits[0]  # (T, V)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None)
@given(choices=trees(max_nodes=16, max_depth=4), seed=st.integers(0, 10_000),
       prefix_len=st.integers(1, 10))
def test_tree_forward_logits_equal_plain_forward_of_each_path(device, choices, seed, prefix_len):
    model = tiny_model(seed, device=device)
    tree = build_tree(choices, device=device)
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (prefix_len,), generator=g).tolist()
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=g).to(device)  # a token per node
    cache = new_cache(model, prefix_len, 1, margin=tree.size)
    prefill(model, cache, torch.tensor([prefix], device=device))
    logits, _ = tree_forward(model, cache, tree, tokens)  # (N, V)
    index = {p: i for i, p in enumerate(tree.nodes)}
    for i, node in enumerate(tree.nodes):
        path = [tokens[index[node[:d]]].item() for d in range(len(node) + 1)]
        expected = full_logits(model, prefix + path, device)[-1]
        torch.testing.assert_close(logits[i], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       shared=st.booleans(), scale=st.sampled_from([0.0, 0.05, 0.5]),
       repetitive=st.sampled_from([None, 2.0, 4.0, 10.0]),
       prompt_len=st.integers(1, 8), max_new=st.integers(1, 30))
def test_medusa_greedy_equals_plain_greedy(device, choices, seed, shared, scale, repetitive,
                                           prompt_len, max_new):
    model = (tiny_model(seed, device=device) if repetitive is None
             else copycat_model(seed, repetitive, device=device))
    heads = perturbed_heads(model, 4, shared, seed, scale)
    tree = build_tree(choices, num_heads=4, device=device)
    prompt = torch.randint(0, VOCAB, (prompt_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    stop = {int(seed % VOCAB)}  # a stop token that sometimes appears, sometimes not
    plain = flat(plain_decode(model, prompt, max_new, Sampling(), stop))
    medusa = flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, max_new, stop))
    assert medusa == plain


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_lossless_test_sees_real_acceptance(kind):
    """Guard against a vacuous lossless test: on a repetitive model steps do accept candidates
    (here all of the chain's), and the output is still plain greedy's. For both kinds of heads."""
    model = copycat_model(3)
    heads = (perturbed_heads(model, 4, False, 3, 0.0) if kind == "medusa" else
             HydraHeads.for_model(model, 4).eval())
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
    stats = StepStats()
    for step in medusa_decode(model, *fixed(heads, tree), greedy(), [5, 6, 7], 60, set()):
        stats.record(len(step.tokens))
    assert stats.acceleration_rate > 1.5
    assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), [5, 6, 7], 60, set())) == \
        flat(plain_decode(model, [5, 6, 7], 60, Sampling(), set()))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=20, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       n_steps=st.integers(1, 8))
def test_cache_after_medusa_steps_equals_plain_forward_of_accepted_sequence(device, choices,
                                                                              seed, n_steps):
    model = tiny_model(seed, device=device)
    heads = perturbed_heads(model, 4, False, seed, 0.05)
    tree = build_tree(choices, num_heads=4, device=device)
    prompt = [3, 1, 4, 1, 5]
    cache = KVCache.for_model(model, capacity=len(prompt) + 5 * n_steps + tree.size)
    logits, hidden = prefill(model, cache, torch.tensor([prompt], device=device))
    sequence, hidden = prompt + [logits[0].argmax().item()], hidden[-1]
    for _ in range(n_steps):
        candidates = Candidates(tree, tree_tokens(heads, model, tree, sequence[-1], hidden), {})
        step, kept = medusa_step(model, candidates, cache, greedy(), None)
        hidden = kept[-1]
        sequence += step.tokens
        n = len(sequence) - 1  # the cache holds all but the newest token (the next root)
        assert cache.length == n
        expected = KVCache.for_model(model, capacity=n)
        model(torch.tensor([sequence[:n]], device=device), torch.arange(n, device=device)[None],
              causal_mask(0, n, device), expected, expected.slots(0, n))
        torch.testing.assert_close(cached_keys_values(cache, n),
                                   cached_keys_values(expected, n), rtol=0, atol=1e-10)


@settings(max_examples=200, deadline=None)
@given(choices=trees(max_nodes=16, max_depth=4), seed=st.integers(0, 10_000),
       agree=st.floats(0.0, 1.0))
def test_greedy_on_the_host_accepts_what_greedy_on_the_device_accepts(choices, seed, agree):
    """The CPU's walk in Python (greedy_on_host) and the device rule plus its one host sync
    (greedy_acceptance, accepted_on_host): the same nodes, the same new tokens. Logits of few
    levels (ties: the first maximum wins in both), candidates that are their parent's argmax
    with probability `agree`, so that long paths are accepted too."""
    tree = build_tree(choices)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (tree.size, VOCAB), generator=g).float()  # (N, V), ties
    draws = logits.argmax(dim=-1)
    parent = {i: tree.paths_host[0][0] for i in range(tree.size)}
    for path in tree.paths_host:
        for a, b in zip(path, path[1:]):
            parent[b] = a
    tokens = torch.tensor([draws[parent[i]].item() if torch.rand((), generator=g) < agree
                           else torch.randint(0, VOCAB, (), generator=g).item()
                           for i in range(tree.size)])
    path, length, next_token, numbers = greedy_acceptance(logits, tree, tokens)
    on_host = greedy_on_host(logits, tree, tokens)
    assert (on_host.kept, on_host.tokens) == accepted_on_host(tree, tokens, path, length,
                                                               next_token)
    assert on_host.numbers["argmax"].tolist() == numbers["argmax"].tolist()


@settings(max_examples=30, deadline=None)
@given(choices=trees(max_nodes=16, max_depth=4), seed=st.integers(0, 10_000),
       temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_typical_with_vanishing_thresholds_accepts_every_path_fully(choices, seed, temperature):
    tree = build_tree(choices)
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(tree.size, VOCAB, generator=g)  # (N, V)
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=g)
    accept = typical(temperature, eps=1e-30, delta=1e-30)
    kept = accept.accept(logits, Candidates(tree, tokens, {}), None).kept
    assert len(kept) - 1 == tree.num_heads  # the deepest path, accepted to its leaf


@settings(max_examples=20, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       temperature=st.sampled_from([0.3, 0.7, 1.5]), eps=st.sampled_from([0.01, 0.09, 0.5]))
def test_every_typical_step_yields_at_least_one_token(choices, seed, temperature, eps):
    model = tiny_model(seed)
    heads = perturbed_heads(model, 4, False, seed, 0.05)
    tree = build_tree(choices, num_heads=4)
    steps = list(medusa_decode(model, *fixed(heads, tree), typical(temperature, eps, 0.3),
                               [1, 2], 25, set()))
    assert all(len(s.tokens) >= 1 for s in steps) and sum(len(s.tokens) for s in steps) == 25

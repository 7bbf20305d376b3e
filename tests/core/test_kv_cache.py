"""The static KV cache: cached incremental decoding == one full forward, and writing at arbitrary
slots then copying the kept slots into place == the cache of a plain forward of the kept tokens
(Medusa's compaction step). Tiny random model, float64, so the comparisons are exact."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import cached_keys_values, DEVICES, tiny_model
from minimedusa.kv_cache import CacheOverflowError, KVCache
from minimedusa.model import causal_mask

VOCAB = 64


def full_forward(model, tokens):
    """Logits (1, T, V) and a cache filled by one causal forward of tokens (1, T)."""
    T = tokens.shape[1]
    cache = KVCache.for_model(model, capacity=T)
    positions = torch.arange(T, device=tokens.device)[None]
    logits, _ = model(tokens, positions, causal_mask(0, T, tokens.device), cache,
                      cache.slots(0, T))
    return logits, cache


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 40), data=st.data())
def test_cached_incremental_decoding_equals_full_forward(device, seed, length, data):
    model = tiny_model(seed, device=device)
    tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)
    expected, _ = full_forward(model, tokens)
    # split [0, length) into random chunks, fed one after another through the cache
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=6)) if length > 1
                  else set())
    bounds = [0, *cuts, length]
    cache = KVCache.for_model(model, capacity=length + 3)  # spare slots must not matter
    chunks = []
    for a, b in zip(bounds, bounds[1:]):
        positions = torch.arange(a, b, device=device)[None]
        logits, _ = model(tokens[:, a:b], positions, causal_mask(a, b - a, device), cache,
                          cache.next_slots(b - a))
        cache.advance(b - a)
        chunks.append(logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), prefix_len=st.integers(1, 12), data=st.data())
def test_slot_writes_then_copy_reproduce_plain_forward_cache(device, seed, prefix_len, data):
    """Like a Medusa step: new tokens, some kept and some junk, are written in ONE forward at
    arbitrary free slots; each kept token sees the prefix and the kept tokens before it and sits
    at position prefix + its rank among them. Copying the kept slots to the end of the prefix
    must give exactly the cache of a plain forward of prefix + kept tokens."""
    model = tiny_model(seed, device=device)
    n_new = data.draw(st.integers(1, 8))
    keep = data.draw(st.lists(st.booleans(), min_size=n_new, max_size=n_new))
    capacity = prefix_len + 16
    slots = data.draw(st.permutations(range(prefix_len, capacity)))[:n_new]
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (1, prefix_len), generator=g).to(device)
    new = torch.randint(0, VOCAB, (1, n_new), generator=g).to(device)

    cache = KVCache.for_model(model, capacity)
    model(prefix, torch.arange(prefix_len, device=device)[None],
          causal_mask(0, prefix_len, device), cache, cache.slots(0, prefix_len))
    mask = torch.zeros(1, n_new, capacity, dtype=torch.bool, device=device)
    mask[:, :, :prefix_len] = True
    positions, kept_slots, rank = [], [], 0
    for i in range(n_new):
        mask[0, i, slots[i]] = True  # every token sees itself ...
        mask[0, i, kept_slots] = True  # ... and the kept tokens written before it
        positions.append(prefix_len + rank)
        if keep[i]:
            kept_slots.append(slots[i])
            rank += 1
    model(new, torch.tensor([positions], device=device), mask, cache,
          torch.tensor(slots, device=device))
    cache.copy_slots(torch.tensor(kept_slots, dtype=torch.long, device=device),
                     cache.slots(prefix_len, len(kept_slots)))

    kept = new[:, torch.tensor(keep, device=device)]
    _, expected = full_forward(model, torch.cat([prefix, kept], dim=1))
    n = prefix_len + len(kept_slots)
    torch.testing.assert_close(cached_keys_values(cache, n),
                               cached_keys_values(expected, n), rtol=0, atol=1e-12)


def test_cache_is_preallocated_once_and_written_in_place():
    model = tiny_model()
    cache = KVCache.for_model(model, capacity=10)
    storage = [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers]
    tokens = torch.randint(0, VOCAB, (1, 10))
    for t in range(10):
        model(tokens[:, t:t + 1], torch.tensor([[t]]), causal_mask(t, 1), cache,
              cache.next_slots(1))
        cache.advance(1)
    assert [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers] == storage
    assert all(layer.k.shape[2] == 10 for layer in cache.layers)


def test_write_past_capacity_is_a_clear_error():
    cache = KVCache.for_model(tiny_model(), capacity=8)
    with pytest.raises(CacheOverflowError, match=r"writing slots \[6, 10\) but the cache holds 8"):
        cache.slots(6, 4)

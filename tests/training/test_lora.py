"""LoRA adapters: switched off or removed they are the original model exactly, merged they equal
the adapters switched on, and at initialisation (B = 0) they change nothing."""
import pytest
import torch

from helpers import tiny_model
from minimedusa.training.lora import (LoRALinear, adapter_state, adapters_off, add_adapters,
                             load_adapter_state, merge_adapters, remove_adapters)
from minimedusa.model import causal_mask


def logits(model, tokens):
    T = tokens.shape[1]
    return model(tokens, torch.arange(T).expand_as(tokens), causal_mask(0, T))[0]


def randomise_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in add_adapters(model, rank=4, alpha=8.0, dropout=0.05):
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


TOKENS = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def test_adapters_off_is_the_original_model_exactly():
    model = tiny_model(3)
    original = logits(model, TOKENS)
    randomise_adapters(model)
    with adapters_off(model):
        assert torch.equal(logits(model, TOKENS), original)
    assert not torch.allclose(logits(model, TOKENS), original)  # on: the adapters do act


def test_fresh_adapters_change_nothing_even_with_dropout():
    model = tiny_model(3)
    original = logits(model, TOKENS)
    add_adapters(model)
    model.train()  # dropout active on the adapters' input: B = 0 still zeroes their output
    assert torch.equal(logits(model, TOKENS), original)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_merged_weights_equal_adapters_on(qkv_bias):
    model = tiny_model(3, qkv_bias=qkv_bias)
    if qkv_bias:  # Qwen2's q, k, v biases: nonzero, so that losing them in the merge shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, dtype=p.dtype))
    randomise_adapters(model)
    model.eval()
    adapted = logits(model, TOKENS)
    merge_adapters(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(tiny_model(3, qkv_bias=qkv_bias).state_dict())
    torch.testing.assert_close(logits(model, TOKENS), adapted, rtol=1e-10, atol=1e-10)


def test_removed_adapters_leave_the_original_model_exactly():
    model = tiny_model(3)
    original = logits(model, TOKENS)
    randomise_adapters(model)
    remove_adapters(model)
    assert set(model.state_dict()) == set(tiny_model(3).state_dict())
    assert torch.equal(logits(model, TOKENS), original)


def test_only_the_adapters_are_trainable():
    model = tiny_model(3)
    adapters = add_adapters(model, rank=4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in adapters}
    assert len(adapters) == 2 * 4 * model.config.num_hidden_layers  # A, B x 4 products x blocks


def test_adapter_state_round_trip():
    model, other = tiny_model(3), tiny_model(3)
    randomise_adapters(model)
    add_adapters(other, rank=4, alpha=8.0)
    load_adapter_state(other, adapter_state(model))
    model.eval(), other.eval()
    assert torch.equal(logits(model, TOKENS), logits(other, TOKENS))

"""The model families beyond Llama 2, held to transformers: Llama 3.x RoPE scaling ("llama3",
"linear") with an explicit head dim, Qwen2's q/k/v biases, Mistral within its sliding window.

The fixtures (tests/fixtures/families/<family>/, made once by make_families.py there) are tiny
random checkpoints and transformers' logits for 3 random prompts, so no test imports
transformers. For each family: a full forward == transformers; prefill + one token at a time ==
transformers; tree-forward logits == a plain forward of each path, at positions where the RoPE
scaling acts; Medusa greedy == plain greedy. And what minimedusa cannot run is one clear error.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import DEVICES, flat, perturbed_heads, REPO
from minimedusa.budget import fixed
from minimedusa.acceptance import Sampling, greedy
from minimedusa.decoding import (PromptTooLongError, decode_step, medusa_decode, new_cache,
                                 plain_decode, prefill, tree_forward)
from minimedusa.model import causal_mask
from minimedusa.speed.packed_linear import ONEDNN_LINEAR, pack_linear_layers
from minimedusa.tree import build_tree
from minimedusa.files.hf_config import ConfigError
from minimedusa.files.weights import load_model, save_model

FIXTURES = REPO / "tests" / "fixtures" / "families"
FAMILIES = ["llama3", "llama_linear", "qwen2", "mistral"]
ATOL = 1e-4  # float32 against float32: the two implementations round differently, no more
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # a small tree, 3 heads deep


def transformers_cases(family: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(prompt ids (T,), transformers' logits (T, V))] for the family's 3 prompts."""
    expected = load_file(FIXTURES / family / "expected.safetensors")
    return [(expected[f"ids_{i}"], expected[f"logits_{i}"]) for i in range(3)]


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(T, V): one forward of the whole sequence ids (T,), no cache."""
    T, device = ids.shape[0], model.embed.weight.device
    with torch.inference_mode():
        logits, _ = model(ids[None].to(device), torch.arange(T, device=device)[None],
                          causal_mask(0, T, device))
    return logits[0]


def folder_with_config(tmp_path, family: str, edit) -> Path:
    """A copy of the family's fixture folder with its config.json edited by edit(dict)."""
    folder = tmp_path / family
    shutil.copytree(FIXTURES / family, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- each family computes what transformers computes -------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, device):
    model = load_model(FIXTURES / family, device)
    for ids, expected in transformers_cases(family):
        torch.testing.assert_close(full_logits(model, ids).cpu(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_logits_equal_transformers(family):
    """Prefill half the prompt, then feed the rest one token at a time: at every position the
    next-token logits are transformers' (the cache and the explicit positions agree with RoPE
    scaling, biases and the window)."""
    model = load_model(FIXTURES / family)
    for ids, expected in transformers_cases(family):
        T, n = len(ids), max(1, len(ids) // 2)
        cache = new_cache(model, n, T - n)
        logits, _ = prefill(model, cache, ids[None, :n])  # (1, V) at position n - 1
        torch.testing.assert_close(logits[0], expected[n - 1], rtol=0, atol=ATOL)
        for t in range(n, T):
            logits, _ = decode_step(model, cache, ids[None, t:t + 1])
            torch.testing.assert_close(logits[0], expected[t], rtol=0, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_equal_plain_forward_of_each_path(family, device):
    """The tree's nodes sit at positions 60-63, beyond the RoPE scalings' 32 trained positions:
    a node's rotation follows its depth, not its cache slot, in every family."""
    model = load_model(FIXTURES / family, device, torch.float64)
    tree = build_tree(CHOICES, device=device)
    ids = transformers_cases(family)[2][0]
    prefix = ids[:60].tolist()
    tokens = ids[60:60 + tree.size].to(device)  # a token per node
    cache = new_cache(model, len(prefix), 1, margin=tree.size)
    prefill(model, cache, torch.tensor([prefix], device=device))
    logits, _ = tree_forward(model, cache, tree, tokens)  # (N, V)
    index = {p: i for i, p in enumerate(tree.nodes)}
    for i, node in enumerate(tree.nodes):
        path = [tokens[index[node[:d]]].item() for d in range(len(node) + 1)]
        expected = full_logits(model, torch.tensor(prefix + path))[-1]
        torch.testing.assert_close(logits[i], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_medusa_greedy_equals_plain_greedy(family, device, scale):
    model = load_model(FIXTURES / family, device, torch.float64)
    heads = perturbed_heads(model, 3, False, 0, scale)
    tree = build_tree(CHOICES, num_heads=3, device=device)
    prompt = transformers_cases(family)[1][0].tolist()  # 48 tokens: decoding runs past 32
    plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
    assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 40, set())) == plain


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_keeps_each_family(tmp_path, family):
    """save_model writes what load_model reads back: the same config (scaling, biases, capped
    context) and the same tensors, so the same logits."""
    model = load_model(FIXTURES / family)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")
def test_packed_layers_keep_the_qkv_biases():
    model = load_model(FIXTURES / "qwen2")
    ids, expected = transformers_cases("qwen2")[1]
    pack_linear_layers(model)
    torch.testing.assert_close(full_logits(model, ids), expected, rtol=0, atol=ATOL)


# --- the fixtures test something ---------------------------------------------------------------

def default_rope(config: dict) -> None:
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("family", ["llama3", "llama_linear"])
def test_rope_scaling_changes_the_logits(tmp_path, family):
    """Read without its scaling, the model is far from transformers: the scaling is exercised."""
    model = load_model(folder_with_config(tmp_path, family, default_rope))
    ids, expected = transformers_cases(family)[2]
    assert (full_logits(model, ids) - expected).abs().max() > 0.1


def test_qkv_biases_change_the_logits():
    model = load_model(FIXTURES / "qwen2")
    for layer in model.layers:
        layer.attn.wqkv.bias.zero_()
    ids, expected = transformers_cases("qwen2")[2]
    assert (full_logits(model, ids) - expected).abs().max() > 0.1


def test_llama3_fixture_has_a_head_dim_other_than_hidden_over_heads():
    cfg = load_model(FIXTURES / "llama3").config
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads


# --- the sliding window: within it or refused --------------------------------------------------

def test_mistral_context_is_capped_at_its_sliding_window():
    """Beyond its window (128) a Mistral attends to the last 128 tokens only, which this Llama
    does not compute: a longer prompt + answer is refused with the context named."""
    model = load_model(FIXTURES / "mistral")
    assert model.config.max_position_embeddings == 128
    with pytest.raises(PromptTooLongError, match="context is 128 tokens"):
        next(plain_decode(model, list(range(100)), 40, Sampling(), set()))


def test_qwen2_sliding_window_caps_the_context_only_when_used(tmp_path):
    def use_window(config):
        config.update(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert load_model(FIXTURES / "qwen2").config.max_position_embeddings == 256
    assert load_model(folder_with_config(tmp_path, "qwen2", use_window)) \
        .config.max_position_embeddings == 64


# --- what is not run is one clear error --------------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(model_type="gemma", architectures=["GemmaForCausalLM"]),
     r"model_type='gemma' architectures=\['GemmaForCausalLM'\], but minimedusa only runs"),
    (lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     "model_type='gpt2'.*only runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"),
     "rope_parameters asks for RoPE scaling 'yarn', which minimedusa's Llama does not implement"),
    (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling asks for RoPE scaling 'dynamic'"),
    (lambda c: c["rope_parameters"].pop("low_freq_factor"),
     "RoPE scaling 'llama3' but lacks low_freq_factor"),
    (lambda c: c.update(attention_bias=True), "attention_bias=True"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias=True"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_config_is_one_clear_line(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_model(folder_with_config(tmp_path, "llama3", edit))
    assert "\n" not in str(error.value)

"""Loading HF-layout weights: an exact round trip, strict errors that name the tensor or field,
dtype casting, sharded checkpoints, the RoPE scalings read from transformers 4's and 5's keys,
and the GGUF Q/K row order undone. (The model families against transformers:
test_model_families.py.)"""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_model
from minimedusa.files.gguf_import import unpermute_qk
from minimedusa.model import LlamaConfig, causal_mask
from minimedusa.files.hf_config import ConfigError, config_from_hf, config_to_hf
from minimedusa.files.weights import WeightsError, load_model, save_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_save_then_load_round_trips_exactly(tmp_path, tied, qkv_bias):
    model = tiny_model(dtype=torch.float32, tie_word_embeddings=tied, qkv_bias=qkv_bias)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert same_weights(model, loaded)
    assert (loaded.lm_head.weight is loaded.embed.weight) == tied
    assert (loaded.layers[0].attn.wqkv.bias is not None) == qkv_bias


@pytest.mark.parametrize("overrides", [
    {}, {"qkv_bias": True}, {"head_dim": 16}, {"rope_scaling": LLAMA3},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "qkv_bias": True},
])
def test_config_to_hf_reads_back_as_the_same_config(overrides):
    cfg = LlamaConfig.tiny(**overrides)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_qkv_biases_are_written_as_a_qwen2():
    """HF's Llama has no switch for q/k/v biases alone (its attention_bias adds one to the output
    projection too): a model with them is written as the Qwen2 it is."""
    hf = config_to_hf(LlamaConfig.tiny(qkv_bias=True))
    assert (hf["model_type"], hf["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    model = tiny_model(dtype=torch.float32)
    save_model(model, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, tmp_path / shard)
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert same_weights(model, load_model(tmp_path))


def test_any_stored_dtype_loads_as_the_requested_dtype(tmp_path):
    save_model(tiny_model(dtype=torch.bfloat16), tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def edit_tensors(folder, edit):
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


def test_missing_tensor_is_an_error_naming_it(tmp_path):
    save_model(tiny_model(), tmp_path)
    edit_tensors(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"lack tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_unexpected_tensor_is_an_error_naming_it(tmp_path):
    save_model(tiny_model(), tmp_path)
    edit_tensors(tmp_path, lambda s: s.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightsError, match=r"unexpected tensor model\.extra\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_an_error_naming_the_tensor(tmp_path):
    save_model(tiny_model(), tmp_path)
    edit_tensors(tmp_path, lambda s: s.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(WeightsError, match=r"tensor model\.norm\.weight has shape \(7,\)"):
        load_model(tmp_path)


def test_a_part_of_a_fused_product_is_checked_on_its_own(tmp_path):
    """q, k and v load into one wqkv: a k_proj with v_proj's rows too many fits the stack's
    size, and is still an error naming it."""
    save_model(tiny_model(), tmp_path)
    k = "model.layers.0.self_attn.k_proj.weight"
    edit_tensors(tmp_path, lambda s: s.update({k: torch.cat([s[k], s[k]])}))
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight "
                                           r"has shape \(32, 32\), the config needs \(16, 32\)"):
        load_model(tmp_path)


def test_truncated_weights_file_is_a_clear_error(tmp_path):
    save_model(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        load_model(tmp_path)


def test_missing_weights_file_is_a_clear_error(tmp_path):
    save_model(tiny_model(), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="missing weights file"):
        load_model(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("hidden_size"), "missing required field.*hidden_size"),
    (lambda c: c.update(model_type="gemma", architectures=["GemmaForCausalLM"]),
     "only runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    (lambda c: c.update(model_type="mistral", architectures=["LlamaForCausalLM"]),
     "model_type='mistral' architectures=\\['LlamaForCausalLM'\\]"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 8.0}),
     "rope_scaling asks for RoPE scaling 'yarn'"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "rope_parameters asks for RoPE scaling 'dynamic'"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "RoPE scaling 'llama3' but lacks low_freq_factor, high_freq_factor, original_max"),
    (lambda c: c.update(rope_scaling=LLAMA3, rope_parameters={"rope_type": "default"}),
     "rope_parameters and rope_scaling ask for different RoPE scalings"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
     "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0"),
])
def test_bad_config_is_a_clear_error(tmp_path, edit, message):
    save_model(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path)


def test_transformers_5_rope_parameters_set_rope_theta(tmp_path):
    """transformers 5 writes rope_theta inside rope_parameters: read there, not left at the
    default, the logits are those of the model with that theta."""
    model = tiny_model(rope_theta=500000.0)
    save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path, dtype=torch.float64)
    assert loaded.config.rope_theta == 500000.0
    tokens = torch.randint(0, 64, (1, 12))
    positions, mask = torch.arange(12)[None], causal_mask(0, 12)
    torch.testing.assert_close(loaded(tokens, positions, mask)[0],
                               model(tokens, positions, mask)[0], rtol=0, atol=0)


@pytest.mark.parametrize("key, scaling", [
    ("rope_scaling", LLAMA3),  # transformers 4
    ("rope_scaling", {"type": "linear", "factor": 2.0}),  # transformers 4, the old key name
    ("rope_parameters", {**LLAMA3, "rope_theta": 10000.0}),  # transformers 5
])
def test_rope_scaling_is_read_from_either_key(tmp_path, key, scaling):
    save_model(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[key] = scaling
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = load_model(tmp_path).config.rope_scaling
    assert read["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    assert read["factor"] == scaling["factor"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to the Q and K rows (the direction we undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(
        w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_qk_inverts_llama_cpp_permutation(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)

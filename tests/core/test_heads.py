"""Medusa heads (paper section 1): the paper's initialisation, both parametrisations, the
reference's file layout, and clear errors for heads that do not fit the model."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_model
from minimedusa.heads import MedusaHeads
from minimedusa.files.export_v1 import export_v1
from minimedusa.files.heads_files import HEADS_FILE, HeadsError, load_heads, save_heads


@pytest.mark.parametrize("shared", [False, True])
def test_fresh_heads_predict_what_the_lm_head_predicts(shared):
    model = tiny_model()
    heads = MedusaHeads.for_model(model, num_heads=3, num_layers=2, shared_lm_head=shared)
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)  # (B, T, C)
    logits = heads(hidden, model.lm_head)  # (K, B, T, V)
    assert logits.shape == (3, 2, 5, 64)
    for k in range(3):
        torch.testing.assert_close(logits[k], model.lm_head(hidden))


def test_every_head_and_block_is_its_own_module():
    heads = MedusaHeads.for_model(tiny_model(), num_heads=3, num_layers=2)
    weights = [p.data_ptr() for p in heads.parameters()]
    assert len(weights) == len(set(weights)) == 3 * (2 * 2 + 1)


@pytest.mark.parametrize("shared, keys", [
    (False, {"0.0.linear.weight", "0.0.linear.bias", "0.1.linear.weight", "0.1.linear.bias",
             "0.2.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.linear.weight",
             "1.1.linear.bias", "1.2.weight"}),
    (True, {"0.0.linear.weight", "0.0.linear.bias", "0.1.linear.weight", "0.1.linear.bias",
            "1.0.linear.weight", "1.0.linear.bias", "1.1.linear.weight", "1.1.linear.bias"}),
])
def test_heads_files_use_the_reference_key_layout(tmp_path, shared, keys):
    model = tiny_model()
    heads = MedusaHeads.for_model(model, num_heads=2, num_layers=2, shared_lm_head=shared)
    save_heads(heads, tmp_path)
    assert set(load_file(tmp_path / HEADS_FILE)) == keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 2
    loaded = load_heads(tmp_path, model)
    hidden = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head))


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 48, "the heads' hidden_size is 48 but the model's is 32"),
    ("vocab_size", 99, "the heads' vocab_size is 99 but the model's is 64"),
])
def test_heads_for_another_model_are_a_clear_error(tmp_path, field, value, message):
    model = tiny_model()
    save_heads(MedusaHeads.for_model(model, 2), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=message):
        load_heads(tmp_path, model)


def test_heads_file_that_disagrees_with_its_config_is_a_clear_error(tmp_path):
    model = tiny_model()
    save_heads(MedusaHeads.for_model(model, 2), tmp_path)
    state = load_file(tmp_path / HEADS_FILE)
    del state["1.1.weight"]
    save_file(state, tmp_path / HEADS_FILE)
    with pytest.raises(HeadsError, match=r"lack tensor 1\.1\.weight"):
        load_heads(tmp_path, model)


def test_missing_heads_config_is_a_clear_error(tmp_path):
    with pytest.raises(HeadsError, match="no config.json"):
        load_heads(tmp_path, tiny_model())


def random_heads(model, shared, seed=0):
    heads = MedusaHeads.for_model(model, 3, num_layers=1, shared_lm_head=shared)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed),
                                     dtype=p.dtype))
    return heads


@pytest.mark.parametrize("shared, fmt", [(False, "safetensors"), (True, "safetensors"),
                                         (False, "pt")])
def test_heads_published_for_the_reference_load(tmp_path, shared, fmt):
    """Published heads: reference keys, a config with only the two medusa_* keys, .safetensors
    or a .pt state dict (read with weights_only=True)."""
    model = tiny_model()
    heads = random_heads(model, shared)
    state = {k.removeprefix("heads."): v for k, v in heads.state_dict().items()}
    if fmt == "pt":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    else:
        save_file(state, tmp_path / HEADS_FILE)
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    loaded = load_heads(tmp_path, model)
    assert loaded.config.shared_lm_head == shared
    hidden = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head))


@pytest.mark.parametrize("shared", [False, True])
def test_v1_export_round_trips(tmp_path, shared):
    model = tiny_model()
    heads = random_heads(model, shared)
    export_v1(heads, model.lm_head, tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert set(load_file(tmp_path / HEADS_FILE)) == {f"{i}.{k}" for i in range(3) for k in
                                                     ("0.linear.weight", "0.linear.bias",
                                                      "1.weight")}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    loaded = load_heads(tmp_path, model)
    assert not loaded.config.shared_lm_head
    hidden = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head))

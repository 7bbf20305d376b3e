"""Medusa heads (paper section 1): the paper's initialisation, both parametrisations, the
reference's file layout, and clear errors for heads that do not fit the model."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from minimedusa.heads import HEADS_FILE, HeadsError, MedusaHeads, load_heads, save_heads


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
    with pytest.raises(HeadsError, match=r"lacks tensor 1\.1\.weight"):
        load_heads(tmp_path, model)


def test_missing_heads_config_is_a_clear_error(tmp_path):
    with pytest.raises(HeadsError, match="no config.json"):
        load_heads(tmp_path, tiny_model())

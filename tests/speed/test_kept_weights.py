"""Kept weights (speed/kept_weights.py): a later run reads a model's rounded blocks back to the
bit, and never serves them for a model file that changed, nor from a damaged file. On a tiny
model, kept here whatever its size (LARGE set to 0)."""
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import tiny_model
from minimedusa.files.weights import save_model
from minimedusa.assembly.load import formatted_model
from minimedusa.speed.kept_weights import (kept_file, layer_tensors,
                                           quantized_layers)
from minimedusa.model import causal_mask
from minimedusa.speed import group_kernel, kept_weights
from minimedusa.speed.weight_formats import format_named

pytestmark = pytest.mark.kernels  # every test here runs a C kernel or operator

FORMATS = ["int8", "int4"] + (["w4a8"] if group_kernel.kernel_problem() is None else [])
CPU = torch.device("cpu")
INT4 = format_named("int4")


@pytest.fixture(autouse=True)
def keep_every_model(monkeypatch):
    monkeypatch.setattr(kept_weights, "LARGE", 0)


def model_folder(tmp_path, seed: int):
    folder = tmp_path / "model"
    save_model(tiny_model(seed, dtype=torch.float32, hidden_size=64, intermediate_size=128),
               folder)
    return folder


def blocks_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of every block, the quantized layers' plain attributes included."""
    state = {}
    for i, block in enumerate(model.layers):
        for path, layer in quantized_layers(block).items():
            state |= {f"{i}.{path}.{n}": t for n, t in layer_tensors(layer).items()}
        state |= {f"{i}.{n}": t for n, t in block.state_dict().items()}
    return state


def logits(model) -> torch.Tensor:
    tokens = torch.arange(9)[None] % model.config.vocab_size
    with torch.inference_mode():
        return model(tokens, torch.arange(9)[None], causal_mask(0, 9))[0]


@pytest.mark.parametrize("name", FORMATS)
def test_kept_blocks_are_read_back_to_the_bit(name, tmp_path, capsys):
    folder = model_folder(tmp_path, 0)
    fresh = formatted_model(folder, CPU, format_named(name))
    assert "weights kept in" in capsys.readouterr().err
    assert kept_file(folder, format_named(name)).is_file()
    read = formatted_model(folder, CPU, format_named(name))
    assert capsys.readouterr().err == ""  # read back, not rounded and kept again
    a, b = blocks_state(fresh), blocks_state(read)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert [type(m) for m in fresh.modules()] == [type(m) for m in read.modules()]
    assert torch.equal(logits(fresh), logits(read))


@pytest.mark.parametrize("change", ["other weights", "the same weights, rewritten"])
def test_a_changed_model_file_is_never_served_its_old_kept_blocks(change, tmp_path, capsys):
    folder = model_folder(tmp_path, 0)
    old = formatted_model(folder, CPU, INT4)
    stat = (folder / "model.safetensors").stat()
    model_folder(tmp_path, 1 if change == "other weights" else 0)  # rewritten in place
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))
    capsys.readouterr()
    new = formatted_model(folder, CPU, INT4)
    assert "weights kept in" in capsys.readouterr().err  # rounded again, and kept anew
    kept_weights.LARGE = 10 ** 12  # the reference: rounded from the file, nothing kept
    fresh = formatted_model(folder, CPU, INT4)
    assert torch.equal(logits(new), logits(fresh))
    assert change != "other weights" or not torch.equal(logits(new), logits(old))


@pytest.mark.parametrize("damage", ["cut short", "garbage", "a block missing"])
def test_a_damaged_kept_file_is_rounded_again_not_read(damage, tmp_path, capsys):
    folder = model_folder(tmp_path, 0)
    fresh = formatted_model(folder, CPU, INT4)
    path = kept_file(folder, INT4)
    data = path.read_bytes()
    if damage == "cut short":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64 + data[64:])
    else:  # a file whose header is whole but one block's tensors are gone
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        save_file({n: t for n, t in load_file(path).items() if not n.startswith("1.")}, path,
                  metadata=metadata)
    capsys.readouterr()
    again = formatted_model(folder, CPU, INT4)
    assert torch.equal(logits(again), logits(fresh))
    assert "weights kept in" in capsys.readouterr().err  # and the file is whole again
    assert torch.equal(logits(formatted_model(folder, CPU, INT4)), logits(fresh))

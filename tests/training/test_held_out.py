"""training/held_out.py: heads compared on the very positions train.py holds out of a
self-distillation folder (its last answers, 1 in 20), their hidden states read from the
shards that hold them alone."""
import json

import torch

from helpers import perturbed
from minimedusa.assembly.heads_reading import read_heads
from minimedusa.files.heads_files import save_heads
from minimedusa.files.weights import load_model
from minimedusa.heads import MedusaHeads
from minimedusa.training import held_out
from minimedusa.training.medusa1 import head_metrics, read_rows
from minimedusa.training.self_distill import tokenizer_fingerprint

CPU = torch.device("cpu")


def saved_heads(model, folder, num_heads: int, seed: int) -> str:
    """Heads randomly perturbed (the paper's zero start would make every head the model's
    next-token guess): each position's hidden state matters to what they guess."""
    save_heads(perturbed(MedusaHeads.for_model(model, num_heads), seed, 0.05), folder)
    return str(folder)


def test_heads_are_measured_on_the_positions_train_holds_out(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    model = load_model(model_dir, CPU, torch.float32).eval()
    fingerprint = tokenizer_fingerprint(model_dir)
    specs = {saved_heads(model, tmp_path / "two", 2, 0): 2,
             saved_heads(model, tmp_path / "three", 3, 1): 3}
    results = held_out.compare(model, data, fingerprint, list(specs))
    for spec, num_heads in specs.items():
        _, validation = read_rows(data, num_heads, fingerprint, model.config.vocab_size)
        heads = read_heads(spec, model, 0)
        expected = head_metrics(heads, model, validation, CPU, vocabulary=heads.vocabulary)
        assert results[spec]["positions"] == validation.targets.shape[0]
        assert {k: results[spec][k] for k in expected} == expected  # the same bits


def test_the_command_writes_each_heads_figures(tiny_setup, tmp_path, capsys):
    model_dir, data = tiny_setup
    model = load_model(model_dir, CPU, torch.float32).eval()
    specs = [saved_heads(model, tmp_path / "a", 2, 0), saved_heads(model, tmp_path / "b", 2, 1)]
    out = tmp_path / "figures.json"
    held_out.main(["--data", str(data), "--model", str(model_dir), "--heads", specs[0],
                   "--heads", specs[1], "--out", str(out)])
    written = json.loads(out.read_text())
    assert list(written["heads"]) == specs
    assert all(len(written["heads"][s]["top1"]) == 2 for s in specs)
    said = capsys.readouterr().err
    assert all(f"{s}: top-1/top-5 per head" in said for s in specs)

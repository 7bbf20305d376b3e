"""training/held_out.py: heads compared on the very positions train.py holds out of a
self-distillation folder (its last answers, 1 in 20), their hidden states read from the
shards that hold them alone."""
import json

import pytest
import torch

from helpers import perturbed, perturbed_hydra
from minimedusa.assembly.heads_reading import read_heads
from minimedusa.files.heads_files import save_heads
from minimedusa.files.weights import load_model
from minimedusa.heads import DraftVocabulary, MedusaHeads
from minimedusa.training import held_out
from minimedusa.training.medusa1 import head_inputs, head_logits, head_metrics, read_rows, rows_of
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
                   "--heads", specs[1], "--temperature", "0.7", "--out", str(out)])
    written = json.loads(out.read_text())
    assert list(written["heads"]) == specs and written["temperature"] == 0.7
    assert all(len(written["heads"][s]["top1"]) == len(written["heads"][s]["accepted"]) == 2
               for s in specs)
    said = capsys.readouterr().err
    assert all(f"{s}: top-1/top-5 per head" in said for s in specs)
    assert all(f"{s}: a drawn candidate accepted, per head" in said for s in specs)


def accepted_answer_by_answer(heads, model, answers, temperature: float) -> list[float]:
    """The definition, one answer and one head at a time: head k's q at answer position i (its
    h_t, and for Hydra the answer's tokens y_{t+1}..y_{t+k}) against the backbone's p at
    position i + k, whose next token is head k's target; sum_x min(p, q), averaged over the
    positions where i + k is still in the answer."""
    K = heads.config.medusa_num_heads
    sums, counts = [0.0] * K, [0] * K
    for _, answer, hidden in answers:
        n = answer.shape[0]
        logits = head_logits(heads, hidden, head_inputs(answer, K), model, heads.vocabulary)
        for k in range(1, K + 1):
            for i in range(n - k):
                q = torch.softmax(logits[k - 1, i].float() / temperature, dim=-1)  # (V')
                p = torch.softmax(model.lm_head(hidden[i + k].float()) / temperature, dim=-1)
                if heads.vocabulary is not None:
                    p = p[heads.vocabulary.ids]
                sums[k - 1] += torch.minimum(p, q).sum().item()
                counts[k - 1] += 1
    return [s / c for s, c in zip(sums, counts)]


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_a_drawn_candidate_is_accepted_with_one_minus_tv_at_its_targets_position(
        tiny_setup, kind, draft_vocab):
    model_dir, data = tiny_setup
    model = load_model(model_dir, CPU, torch.float32).eval()
    heads = (perturbed_hydra(model, 3, 2, 0.05) if kind == "hydra"
             else perturbed(MedusaHeads.for_model(model, 3, shared_lm_head=True), 2, 0.05))
    if draft_vocab:  # half the vocabulary, drawn at random (a draft vocabulary cuts the shared head)
        ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))
        heads.vocabulary = DraftVocabulary(ids[:model.config.vocab_size // 2].sort().values,
                                           model.lm_head)
    answers = held_out.held_out_answers(data, tokenizer_fingerprint(model_dir),
                                        model.config.vocab_size)
    rows = rows_of(answers, 3)
    for temperature in (0.7, 1.3):
        got = held_out.sampled_acceptance(heads, model, rows, temperature, batch_size=5)
        want = accepted_answer_by_answer(heads, model, answers, temperature)
        assert got == pytest.approx(want, abs=1e-5) and all(0 < a < 1 for a in got)

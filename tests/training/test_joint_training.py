"""Medusa-2 on a tiny model: the KL loss is zero at initialisation, the teacher gets no gradient,
the heads learn 4x faster than the adapters, lambda_0 rises as a sine, resume == uninterrupted,
the merged backbone + heads load, and the quality guard fails a run in one clear line."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

import train
from minimedusa.heads import MedusaHeads
from minimedusa.files.heads_files import HEADS_FILE, load_heads
from minimedusa.training.joint_loss import (JointModel, distill_kl, lambda0, make_batch, mean_kl,
                                            state_rows, teacher_log_probs)
from minimedusa.training.lora import adapted_layers, add_adapters
from minimedusa.training.quality_guard import greedy_agreement, original_in_bfloat16
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.training.medusa1 import medusa_loss, read_answers
from minimedusa.files.weights import load_model


@pytest.fixture(scope="module")
def medusa1_heads(tiny_setup, tmp_path_factory):
    """Medusa-1 heads trained on the tiny data: Medusa-2's starting point."""
    model_dir, data = tiny_setup
    out = tmp_path_factory.mktemp("medusa1")
    train.main(["--frozen", "--model", str(model_dir), "--data", str(data), "--out", str(out),
                "--batch-size", "32", "--heads", "3", "--warmup", "2", "--lr", "3e-3"])
    return out


def run_joint(tiny_setup, heads_dir, out, *extra):
    model_dir, data = tiny_setup
    train.main(["--model", str(model_dir), "--data", str(data), "--out", str(out),
                "--init-heads", str(heads_dir), "--answers-per-batch", "4", "--warmup", "2",
                "--eval-every", "3", "--save-every", "2", "--lora-rank", "4",
                "--lora-lr", "3e-3", "--lambda0", "1.0", "--guard-prompts", "4", *extra])
    return json.loads((out / "quality.json").read_text())


def tiny_answers(tiny_setup, model):
    model_dir, data = tiny_setup
    return read_answers(data, tokenizer_fingerprint(model_dir), model.config.vocab_size,
                        with_hidden=False)


def tiny_batch(tiny_setup, model):
    return make_batch(tiny_answers(tiny_setup, model)[:4], 3, "cpu")


def test_batch_rows_are_the_positions_that_predict_the_answer(tiny_setup):
    """Row i of an answer sits at the prompt's last token + i and its head-1 target is
    answer[i + 1]: the rows Medusa-1 trains on, now inside whole sequences."""
    model_dir, data = tiny_setup
    prompt, answer, _ = read_answers(data, tokenizer_fingerprint(model_dir), 64,
                                     with_hidden=False)[0]
    batch = make_batch([(prompt, answer, None)], 3, "cpu")
    seq, pos = batch.rows
    assert pos.tolist() == list(range(len(prompt) - 1, len(prompt) - 1 + len(answer)))
    assert batch.tokens[0, pos[1:]].tolist() == answer[:-1].tolist()  # the token at row i+1
    assert batch.targets[:-1, 0].tolist() == answer[1:].tolist()


def test_kl_loss_is_zero_at_initialisation(tiny_setup):
    model = load_model(tiny_setup[0])
    add_adapters(model, rank=4)
    model.train()  # dropout on: B = 0 makes the adapters' output zero regardless
    batch = tiny_batch(tiny_setup, model)
    logits, _ = JointModel(model, MedusaHeads.for_model(model, 3))(batch)
    assert distill_kl(teacher_log_probs(model, batch), logits).item() == 0.0


def test_guard_reference_is_zero_for_the_same_model_and_positive_in_bfloat16(tiny_setup):
    model = load_model(tiny_setup[0])
    add_adapters(model, rank=4)
    answers = tiny_answers(tiny_setup, model)[:4]
    rows = state_rows(model, answers, 3)
    bf16 = original_in_bfloat16(model)
    assert mean_kl(model.lm_head, rows, rows) == 0.0
    assert 0 < mean_kl(model.lm_head, rows, state_rows(bf16, answers, 3), bf16.lm_head) < 0.05


def test_greedy_agreement_is_total_for_the_untouched_model(tiny_setup):
    model = load_model(tiny_setup[0])
    add_adapters(model, rank=4)  # B = 0: adapters on == off
    prompts = [p.tolist() for p, _, _ in tiny_answers(tiny_setup, model)[:3]]
    same = greedy_agreement(model, prompts, n_tokens=8)
    assert same == {"agreement": 1.0, "identical": 3, "prompts": 3}
    with torch.no_grad():
        for m in adapted_layers(model).values():
            m.B.normal_(std=1.0)  # a tuned model that is far from the original
    assert greedy_agreement(model, prompts, n_tokens=8)["agreement"] < 1.0


def test_teacher_receives_no_gradient(tiny_setup):
    model = load_model(tiny_setup[0])
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    adapters = add_adapters(model, rank=4)
    heads = MedusaHeads.for_model(model, 3)
    batch = tiny_batch(tiny_setup, model)
    teacher = teacher_log_probs(model, batch)
    logits, head_logits = JointModel(model, heads)(batch)
    (distill_kl(teacher, logits) + medusa_loss(head_logits, batch.targets)[0]).backward()
    assert not teacher.requires_grad
    assert all(p.grad is None for n, p in model.named_parameters()
               if not n.endswith((".A", ".B")))  # the original weights: no gradient
    assert all(p.grad is not None for p in adapters)  # the student's adapters: gradient
    assert any(p.grad.abs().sum() > 0 for p in adapters)
    torch.optim.AdamW(adapters + list(heads.parameters()), lr=1e-2).step()
    state = model.state_dict()
    assert all(torch.equal(state[k.replace(w, f"{w}.base")] if k not in state else state[k], v)
               for k, v in frozen.items()
               for w in [next((t for t in (".wqkv", ".wo", ".gate_up", ".down") if t + ".weight" in k), "")])


def test_lambda0_rises_as_a_sine_to_its_peak():
    assert lambda0(0, 100, 0.2) == pytest.approx(0.2 * math.sin(math.pi / 2 / 100))
    assert lambda0(49, 100, 0.2) == pytest.approx(0.2 * math.sin(math.pi / 4))
    assert lambda0(99, 100, 0.2) == lambda0(500, 100, 0.2) == 0.2
    assert all(lambda0(s, 100, 1.0) < lambda0(s + 1, 100, 1.0) for s in range(99))


def test_heads_learn_four_times_faster_than_the_backbone(tiny_setup, medusa1_heads, tmp_path):
    run_joint(tiny_setup, medusa1_heads, tmp_path, "--max-steps", "2")
    groups = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["optimizer"][
        "param_groups"]
    adapters, heads = groups
    assert heads["lr"] == pytest.approx(4 * adapters["lr"]) and adapters["lr"] > 0
    assert len(heads["params"]) == 3 * 3  # per head: its block's weight and bias, its own W2


def test_joint_run_writes_a_merged_backbone_and_heads_that_load(tiny_setup, medusa1_heads,
                                                                 tmp_path):
    report = run_joint(tiny_setup, medusa1_heads, tmp_path, "--epochs", "2")
    model = load_model(tmp_path / "model")  # the merged backbone, HF layout
    heads = load_heads(tmp_path, model)
    assert heads.config.medusa_num_heads == 3
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    assert set(load_file(tmp_path / "adapters.safetensors")) and (
        tmp_path / "calibration.json").is_file()
    assert 0 < report["medusa2"]["kl"] and report["greedy_agreement_64"]["prompts"] == 1  # 1 in 20
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log[-1]["loss"][0] < log[0]["loss"][0]  # head 1 learned on the tuned backbone


def test_resume_after_interruption_equals_uninterrupted_run(tiny_setup, medusa1_heads,
                                                            tmp_path):
    run_joint(tiny_setup, medusa1_heads, tmp_path / "once", "--max-steps", "5")
    run_joint(tiny_setup, medusa1_heads, tmp_path / "twice", "--max-steps", "3")
    run_joint(tiny_setup, medusa1_heads, tmp_path / "twice", "--max-steps", "5", "--resume")
    for name in ("adapters.safetensors", HEADS_FILE):
        a, b = (load_file(tmp_path / d / name) for d in ("once", "twice"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_quality_guard_fails_a_drifted_run_in_one_line(tiny_setup, medusa1_heads, tmp_path,
                                                       capsys):
    with pytest.raises(SystemExit) as stop:
        run_joint(tiny_setup, medusa1_heads, tmp_path, "--max-steps", "3", "--max-kl", "1e-9")
    assert stop.value.code == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: quality guard FAILED")
    assert json.loads((tmp_path / "quality.json").read_text())["good"] is False


def test_medusa2_without_medusa1_heads_is_a_clear_error(tiny_setup, tmp_path):
    with pytest.raises(SystemExit, match="error: Medusa-2 starts from trained Medusa-1 heads"):
        train.main(["--model", str(tiny_setup[0]), "--data", str(tiny_setup[1]),
                    "--out", str(tmp_path)])

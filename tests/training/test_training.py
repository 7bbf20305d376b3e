"""Medusa-1 training on a tiny model: head k learns token t+k+1, only answer tokens carry loss,
the backbone gets no gradient, the loss falls, resume == uninterrupted, checkpoints survive a
kill mid-write, each mode has its own batch and learning-rate flags, and bad data is a clear
error."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from helpers import REPO
from minimedusa.heads import MedusaHeads
from minimedusa.files.heads_files import HEADS_FILE
from minimedusa.model import causal_mask
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.training.medusa1 import (IGNORE, DataError, head_targets, medusa_loss,
                                         read_answers, read_rows, rows_of, split_validation)
from minimedusa.files.weights import load_model


def run_train(model_dir, data, out, *extra):
    train.main(["--frozen", "--model", str(model_dir), "--data", str(data), "--out", str(out),
                "--batch-size", "32", "--heads", "3", "--warmup", "2", "--eval-every", "5",
                "--save-every", "3", "--lr", "3e-3", *extra])
    return json.loads((out / "train_log.json").read_text())


def test_head_k_targets_token_t_plus_k_plus_1():
    assert head_targets(torch.tensor([10, 11, 12, 13]), 2).tolist() == \
        [[11, 12], [12, 13], [13, IGNORE], [IGNORE, IGNORE]]


def test_rows_align_hidden_states_with_the_tokens_they_predict(tiny_setup):
    """Row i holds the hidden state at the token before answer[i] (recomputed here by a plain
    forward) and head 1's target answer[i + 1]. Catches an off-by-one on either side."""
    model_dir, data = tiny_setup
    model = load_model(model_dir)
    train_rows, _ = read_rows(data, 3, tokenizer_fingerprint(model_dir), 64)
    shard = load_file(data / "shard-00000.safetensors")
    prompt = shard["prompt_ids"][:shard["prompt_offsets"][1]].tolist()
    answer = shard["answer_ids"][:shard["answer_offsets"][1]].tolist()
    seq = prompt + answer[:-1]
    T = len(seq)
    expected = model.hidden_states(torch.tensor([seq]), torch.arange(T)[None],
                                   causal_mask(0, T))[0, len(prompt) - 1:]  # (n, C)
    torch.testing.assert_close(train_rows.hidden[:len(answer)].float(), expected,
                               atol=0.05, rtol=0.02)  # stored in bf16
    assert train_rows.targets[:len(answer) - 1, 0].tolist() == answer[1:]


def test_only_answer_tokens_are_rows(tiny_setup):
    model_dir, data = tiny_setup
    train_rows, val_rows = read_rows(data, 3, tokenizer_fingerprint(model_dir), 64)
    answers = sum(int(load_file(p)["answer_ids"].numel()) for p in data.glob("shard-*"))
    assert train_rows.targets.shape[0] + val_rows.targets.shape[0] == answers


def test_rows_read_shard_by_shard_are_the_answers_rows(tiny_setup):
    """read_rows fills one tensor shard by shard (never holding the states twice): the same rows,
    train and validation, as the answers' own concatenated (rows_of)."""
    model_dir, data = tiny_setup
    fingerprint = tokenizer_fingerprint(model_dir)
    read = read_rows(data, 3, fingerprint, 64)
    answers = split_validation(read_answers(data, fingerprint, 64))
    for got, part in zip(read, answers):
        expected = rows_of(part, 3)
        for field in ("hidden", "targets", "tokens"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field


def test_hidden_states_that_do_not_match_their_answers_are_one_line(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    shutil.copy(data / "meta.json", tmp_path / "meta.json")
    shard = load_file(data / "shard-00000.safetensors")
    save_file({**shard, "hidden": shard["hidden"][:-1].contiguous()},
              tmp_path / "shard-00000.safetensors")  # one state short
    with pytest.raises(DataError, match="hidden states"):
        read_rows(tmp_path, 3, tokenizer_fingerprint(model_dir), 64)


def test_loss_falls_when_overfitting_one_batch(tiny_setup):
    model_dir, data = tiny_setup
    model = load_model(model_dir)
    rows, _ = read_rows(data, 3, tokenizer_fingerprint(model_dir), 64)
    hidden, targets = rows.hidden[:32].float(), rows.targets[:32]
    heads = MedusaHeads.for_model(model, 3).train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss, _, _ = medusa_loss(heads(hidden, model.lm_head), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("form", [[], ["--shared"]])
def test_backbone_receives_no_gradient_and_does_not_change(tiny_setup, tmp_path, monkeypatch,
                                                            form):
    model_dir, data = tiny_setup
    before = load_model(model_dir).state_dict()  # float32, as the trainer loads it
    used = []  # the very model the trainer uses, on the device it picks
    monkeypatch.setattr(train, "load_model",
                        lambda *args: used.append(load_model(*args)) or used[0])
    log = run_train(model_dir, data, tmp_path, "--epochs", "2", *form)
    assert log[-1]["train_loss"] < log[0]["train_loss"]  # the heads did learn
    assert all(p.grad is None for p in used[0].parameters())
    assert all(torch.equal(before[k], v.cpu()) for k, v in used[0].state_dict().items())


def test_heads_files_hold_only_heads(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    run_train(model_dir, data, tmp_path, "--shared", "--max-steps", "2")
    assert set(load_file(tmp_path / HEADS_FILE)) == {f"{i}.0.linear.{w}" for i in range(3)
                                                     for w in ("weight", "bias")}


def test_resume_after_interruption_equals_uninterrupted_run(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    run_train(model_dir, data, tmp_path / "once", "--epochs", "2")
    run_train(model_dir, data, tmp_path / "twice", "--epochs", "2", "--max-steps", "4")
    run_train(model_dir, data, tmp_path / "twice", "--epochs", "2", "--resume")
    a, b = (load_file(tmp_path / d / HEADS_FILE) for d in ("once", "twice"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_heads_are_trained_further_not_replaced(tiny_setup, tmp_path):
    """With --init-heads the run starts from those heads, in their form: at lr 0 it ends with
    them exactly, whatever --heads/--layers/--shared say (fresh heads would be identities)."""
    model_dir, data = tiny_setup
    run_train(model_dir, data, tmp_path / "first", "--shared", "--layers", "2", "--max-steps", "6")
    run_train(model_dir, data, tmp_path / "further", "--init-heads", str(tmp_path / "first"),
              "--lr", "0", "--max-steps", "2")
    a, b = (load_file(tmp_path / d / HEADS_FILE) for d in ("first", "further"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a)  # trained, so not the fresh identity blocks
    with pytest.raises(SystemExit, match="never overwrites"):
        run_train(model_dir, data, tmp_path / "first", "--init-heads", str(tmp_path / "first"))


def test_each_mode_has_its_own_batch_size_and_learning_rate(capsys):
    """No default is filled in behind the user's back: --help shows each mode's flags with their
    defaults, and one given to the other mode is refused rather than ignored."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    entries = " ".join(capsys.readouterr().out.split()).split(" --")  # one per flag
    for flag, default in [("batch-size", "256"), ("lr", "1e-3"), ("answers-per-batch", "8"),
                          ("lora-lr", "5e-4")]:
        assert any(e.startswith(flag + " ") and f"(default: {default}" in e for e in entries)
    medusa1 = train.parse_args(["--frozen", "--data", "d", "--out", "o"])
    medusa2 = train.parse_args(["--data", "d", "--out", "o"])
    assert (medusa1.batch_size, medusa1.lr, medusa2.answers_per_batch, medusa2.lora_lr) == \
        (256, 1e-3, 8, 5e-4)
    for wrong in (["--lr", "3e-3"], ["--frozen", "--answers-per-batch", "4"],
                  ["--kind", "hydra"], ["--draft-vocab", "8192"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--data", "d", "--out", "o", *wrong])
        assert f"{wrong[-2]} belongs to the other mode" in capsys.readouterr().err


def test_checkpoint_survives_a_kill_mid_write(tiny_setup, tmp_path, monkeypatch):
    model_dir, data = tiny_setup
    run_train(model_dir, data, tmp_path, "--max-steps", "3")
    good = (tmp_path / train.CHECKPOINT).read_bytes()

    def killed(obj, path):  # half a file, then the process "dies"
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(train.torch, "save", killed)
    with pytest.raises(SystemExit, match="interrupted"):  # Ctrl-C: one line, no traceback
        run_train(model_dir, data, tmp_path, "--resume", "--max-steps", "6")
    assert (tmp_path / train.CHECKPOINT).read_bytes() == good


def test_bad_data_is_a_clear_error(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    fingerprint = tokenizer_fingerprint(model_dir)
    with pytest.raises(DataError, match="no meta.json"):
        read_rows(tmp_path, 3, fingerprint, 64)
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": fingerprint}))
    with pytest.raises(DataError, match="no shards"):
        read_rows(tmp_path, 3, fingerprint, 64)
    shutil.copy(data / "shard-00000.safetensors", tmp_path / "shard-00000.safetensors")
    (tmp_path / "shard-00000.safetensors").write_bytes(b"\x00" * 30)
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_rows(tmp_path, 3, fingerprint, 64)
    with pytest.raises(DataError, match="another tokenizer"):
        read_rows(data, 3, "0123456789abcdef", 64)


@pytest.mark.slow  # two processes started: CI's -m slow run
def test_training_runs_under_torchrun_with_two_processes(tiny_setup, tmp_path):
    """DistributedDataParallel on the CPU (gloo): each process takes half of every batch."""
    model_dir, data = tiny_setup
    done = subprocess.run(
        # --standalone: a free port for the rendezvous, not the fixed 29500 (the one failure of
        # this test seen, in 1 of 5 full runs, was not kept; a port in use is one cause it removes)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "train.py"), "--frozen", "--model", str(model_dir), "--data", str(data),
         "--out", str(tmp_path), "--batch-size", "32", "--heads", "3", "--epochs", "2",
         "--warmup", "2", "--lr", "3e-3", "--eval-every", "5", "--device", "cpu"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    assert "2 process(es)" in done.stderr

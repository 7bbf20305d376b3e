"""python train.py --frozen without --data: one command from a model to its heads, in three
stages (self-distillation, training, tree search). Ctrl-C in any stage, then the same command,
ends with exactly what an uninterrupted run makes; a finished stage is skipped; a model it cannot
run or prompt is refused in one line before any work."""
from argparse import Namespace
import json
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

import generate
import train
from helpers import tiny_model
from minimedusa.speed import group_kernel
from minimedusa.training import pipeline, self_distill
from minimedusa.files.heads_files import CALIBRATION, HEADS_FILE
from minimedusa.files.weights import save_model

# these tests time steps and read their cache: each its own folder (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_latency_cache")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, default_model_dir):
    """A tiny random Llama with the default model's tokenizer and chat template."""
    folder = tmp_path_factory.mktemp("model")
    save_model(tiny_model(3, dtype=torch.float32, vocab_size=49152), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(autouse=True)
def short_answers(monkeypatch):
    """Answers of 12 tokens, in batches of 64 on any device (a GPU's are 256)."""
    monkeypatch.setattr(pipeline, "MAX_NEW_TOKENS", 12)
    monkeypatch.setattr(pipeline, "BATCH_SIZES", {"cpu": 64, "cuda": 64})


def from_model(folder, out, *extra):
    """65 prompts: two shards (batches of 64)."""
    train.main(["--frozen", "--model", str(folder), "--out", str(out), "--prompts", "65",
                "--batch-size", "32", "--warmup", "2", "--save-every", "4", *extra])


def outputs(out) -> tuple[dict, dict]:
    return load_file(out / HEADS_FILE), json.loads((out / CALIBRATION).read_text())["accuracy"]


def interrupt_on_call(monkeypatch, module, name: str, call: int, signal_after: bool = False):
    """Make the call-th call of module.name a Ctrl-C: raised before it runs, or (signal_after)
    delivered as a SIGINT after it has run, as a user's would arrive mid-stage."""
    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call and not signal_after:
            raise KeyboardInterrupt
        result = real(*args, **kwargs)
        if len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        return result
    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.kernels
def test_ctrl_c_in_any_stage_then_the_same_command_loses_no_finished_work(
        chat_model, tmp_path, monkeypatch, capsys):
    from_model(chat_model, tmp_path / "once")
    first = capsys.readouterr().err
    assert [f"stage {i}/3" in first for i in (1, 2, 3)] == [True] * 3
    assert first.count("expected ") >= 3  # each stage announced its time before it started

    out = tmp_path / "interrupted"
    with monkeypatch.context() as m:  # stage 1: Ctrl-C while answering the second batch
        interrupt_on_call(m, self_distill, "save_shard", 2)
        with pytest.raises(SystemExit, match="interrupted"):
            from_model(chat_model, out)
    shard = (out / "data" / "shard-00000.safetensors").read_bytes()
    with monkeypatch.context() as m:  # stage 2: Ctrl-C during step 6
        interrupt_on_call(m, train, "train_step", 6, signal_after=True)
        with pytest.raises(SystemExit, match="interrupted"):
            from_model(chat_model, out)
    assert (out / "data" / "shard-00000.safetensors").read_bytes() == shard  # kept, not redone
    assert torch.load(out / train.CHECKPOINT, weights_only=True)["step"] == 6  # the step ended
    with monkeypatch.context() as m:  # stage 3: Ctrl-C while timing the trees
        interrupt_on_call(m, pipeline, "time_sizes", 1)
        with pytest.raises(SystemExit, match="interrupted"):
            from_model(chat_model, out)
    capsys.readouterr()
    from_model(chat_model, out)
    log = capsys.readouterr().err
    assert "self-distillation: done" in log and "training: done" in log
    a, b = outputs(tmp_path / "once"), outputs(out)
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1] == b[1]

    from_model(chat_model, out)  # all done: every stage skipped
    assert capsys.readouterr().err.count(": done") == 3
    with pytest.raises(SystemExit, match="other settings .*--lr 0.002 -> 0.001"):
        from_model(chat_model, out, "--lr", "1e-3")


def broken_copy(folder, tmp_path, config=None, tokenizer_config=None, drop=None):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    for name, change in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if change:
            path = copy / name
            path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    if drop:
        (copy / drop).unlink()
    return copy


@pytest.mark.parametrize("broken, message", [
    (dict(config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}), "gpt2"),
    (dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), "yarn"),
    (dict(drop="tokenizer.json"), "no tokenizer.json"),
    (dict(tokenizer_config={"chat_template": "{{ messages[0]['content'] | no_such_filter }}"}),
     "chat template"),
])
def test_a_model_it_cannot_run_or_prompt_is_one_line_before_any_work(
        chat_model, tmp_path, broken, message):
    folder = broken_copy(chat_model, tmp_path, **broken)
    with pytest.raises(SystemExit) as e:
        from_model(folder, tmp_path / "out")
    assert str(e.value).startswith("error: ") and message in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt, flags", [
    ("float32", ["--dtype", "float32"]),
    ("bfloat16", ["--dtype", "bfloat16"]),
    ("int4", ["--quantize", "int4"]),
    pytest.param("w4a8", ["--quantize", "w4a8"], marks=pytest.mark.skipif(
        group_kernel.kernel_problem() is not None, reason="w4a8 needs group_kernel.c")),
])
@pytest.mark.kernels
def test_the_one_command_training_finishes_in_every_format_and_its_heads_decode_losslessly(
        chat_model, tmp_path, capsys, fmt, flags):
    """Stage 3 calibrates and times the heads in the format generate.py decodes in (forced by
    --decode-format, so that every format a CPU may default to runs on any CPU): the heads
    then see features of that format's dtype, whatever dtype the training rows had."""
    out = tmp_path / "heads"
    train.main(["--frozen", "--model", str(chat_model), "--out", str(out), "--prompts", "8",
                "--batch-size", "32", "--warmup", "2", "--decode-format", fmt])
    assert "stage 3/3" in capsys.readouterr().err and (out / CALIBRATION).is_file()
    answers = []
    for baseline in ([], ["--baseline"]):
        generate.main(["--model", str(chat_model), "--heads", str(out), "--prompt", "Hi",
                       "--max-new-tokens", "16", "--json", "--no-compile", *flags, *baseline])
        answers.append(json.loads(capsys.readouterr().out))
    medusa, plain = answers
    assert medusa["format"] == plain["format"] == fmt
    assert medusa["output_ids"] == plain["output_ids"] and plain["mode"] == "plain"


@pytest.mark.kernels
def test_a_cpu_format_is_calibrated_on_the_cpu_after_training_on_a_gpu(chat_model, tmp_path):
    """Stage 3 in int4 runs where generate.py will decode in it, the CPU, whatever device
    trained the heads: given the GPU, it never touches it (on a machine without one, a model
    loaded there would fail)."""
    out = tmp_path / "heads"
    from_model(chat_model, out)  # stages 1 and 2 (and 3) here
    (out / CALIBRATION).unlink()
    args = Namespace(decode_format="int4", out=out, data=out / "data")
    pipeline.tree_stage(args, chat_model, torch.device("cuda"), print)
    assert (out / CALIBRATION).is_file()


@pytest.mark.kernels
@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="the fused step runs group_kernel.c's products")
def test_stage_3_times_int4_on_the_step_generate_py_decodes_with(chat_model, tmp_path, capsys):
    """int4's fused step: generate.py (its default step) then finds the latencies stage 3 cached
    instead of timing the steps again, and the stage's advice on trees was about that step."""
    out = tmp_path / "heads"
    train.main(["--frozen", "--model", str(chat_model), "--out", str(out), "--prompts", "8",
                "--batch-size", "32", "--warmup", "2", "--decode-format", "int4"])
    capsys.readouterr()
    generate.main(["--model", str(chat_model), "--heads", str(out), "--prompt", "Hi",
                   "--max-new-tokens", "4", "--json", "--quantize", "int4"])
    answer = json.loads(capsys.readouterr().out)
    assert answer["step"].startswith("fused") and "latencies cached" in answer["mode"]


@pytest.mark.parametrize("flags, needle", [
    (["--max-steps", "0"], "--max-steps"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--lr", "-1"], "--lr"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "0"], "--batch-size"),
    (["--heads", "0"], "--heads"),
    (["--save-every", "0"], "--save-every"),
    (["--decode-format", "int3"], "--decode-format"),
])
def test_bad_training_flags_give_one_clear_line(chat_model, tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as e:
        train.main(["--frozen", "--model", str(chat_model), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.startswith("error: ") and needle in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_an_out_that_is_a_file_gives_one_clear_line_and_keeps_the_file(chat_model, tmp_path,
                                                                         capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(SystemExit) as e:
        train.main(["--frozen", "--model", str(chat_model), "--out", str(file)])
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.startswith("error: --out") and "is a file" in err
    assert file.read_text() == "mine"

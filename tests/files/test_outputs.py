"""Nothing a user has is lost: a file named for output is written beside its name and renamed
into place, so a run that fails leaves the old file as it was; an output that cannot be
written is said before any work; two writers never share a temporary file or a training
folder; the chat takes a pasted line whole."""
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, slow_except
from generate import main as generate_main
from minimedusa.bench import bench
from minimedusa.errors import UserError
from minimedusa.files import outputs
from minimedusa.files.outputs import aside, lock_folder, write_atomically


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "answers.json"
    path.write_text("the user's answers")

    def fails(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomically(path, fails)
    assert path.read_text() == "the user's answers" and os.listdir(tmp_path) == [path.name]


def test_two_writers_never_share_a_temporary_name(tmp_path):
    names = {aside(tmp_path / "checkpoint.pt") for _ in range(100)}
    assert len(names) == 100 and all(str(os.getpid()) in n.name for n in names)


@pytest.fixture
def answers(tmp_path):
    """A prompts file and an answers file a previous run left."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "answers.jsonl"
    prompts.write_text("What is 2 + 2?\nName a colour.\n")
    out.write_text('{"prompt": "an earlier run", "answer": "kept"}\n')
    return prompts, out


@pytest.mark.parametrize("failure", slow_except([
    ["--model", "/no/such/model"], ["--threads", "0"], ["--heads", "/no/such/heads"],
    ["--tree", "nonsense"]], ["--heads", "/no/such/heads"]))
def test_a_failed_run_leaves_out_as_it_was(failure, answers):
    prompts, out = answers
    before = out.read_bytes()
    with pytest.raises(SystemExit):
        generate_main(["--prompts", str(prompts), "--out", str(out), *failure])
    assert out.read_bytes() == before
    assert sorted(os.listdir(out.parent)) == sorted([prompts.name, out.name])


@pytest.mark.parametrize("same", ["the path", "a link to it", "another spelling"])
def test_out_may_not_be_the_prompts_file(same, answers, monkeypatch):
    prompts, _ = answers
    before = prompts.read_bytes()
    out = {"the path": prompts, "another spelling": prompts.parent / "." / prompts.name,
           "a link to it": prompts.parent / "link.txt"}[same]
    if same == "a link to it":
        out.symlink_to(prompts)
    monkeypatch.setattr("generate.ensure_default_model", lambda: pytest.fail("loaded"))
    with pytest.raises(SystemExit, match="is the --prompts file: the answers would replace"):
        generate_main(["--prompts", str(prompts), "--out", str(out)])
    assert prompts.read_bytes() == before


@pytest.mark.parametrize("where", ["a missing folder", "a folder", "under a file"])
def test_an_out_that_cannot_be_written_is_said_before_the_loading(where, answers, monkeypatch):
    prompts, out = answers
    out = {"a missing folder": out.parent / "no" / "answers.jsonl", "a folder": out.parent,
           "under a file": prompts / "answers.jsonl"}[where]
    monkeypatch.setattr("generate.ensure_default_model", lambda: pytest.fail("loaded"))
    with pytest.raises(SystemExit, match=f"^error: --out {out}"):
        generate_main(["--prompts", str(prompts), "--out", str(out)])


@pytest.mark.kernels
def test_a_stopped_run_keeps_the_answers_it_finished_and_the_same_command_resumes(answers,
                                                                                  monkeypatch,
                                                                                  capsys):
    """Ctrl-C during the second prompt: --out as it was, the first answer kept beside it
    (.partial); the same command then answers the second alone, and --out holds both, in
    order, each once."""
    prompts, out = answers
    before = out.read_bytes()
    from minimedusa.cli import prompts as prompts_module
    real, calls = prompts_module.decode_answer, []

    def stopped_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(prompts_module, "decode_answer", stopped_at_the_second)
    command = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
               "--baseline", "--no-compile", "--batch", "1"]
    with pytest.raises(SystemExit, match="interrupted"):
        generate_main(command)
    partial = out.with_name(out.name + ".partial")
    assert out.read_bytes() == before
    [line] = partial.read_text().splitlines()
    assert json.loads(line)["prompt"] == "What is 2 + 2?"
    calls.clear()
    monkeypatch.setattr(prompts_module, "decode_answer", real)
    generate_main(command)
    assert "resuming after the 1 of 2 answers kept" in capsys.readouterr().err
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == [
        "What is 2 + 2?", "Name a colour."]
    assert sorted(os.listdir(out.parent)) == sorted([prompts.name, out.name])


def test_a_cut_line_or_other_prompts_answers_are_not_kept(tmp_path):
    """What .partial holds is kept only as far as it is whole and answers the run's prompts,
    in order."""
    path = tmp_path / "answers.jsonl"
    partial = path.with_name(path.name + ".partial")
    line = lambda p: json.dumps({"prompt": p, "answer": "x"}) + "\n"  # noqa: E731
    for held, kept in ((line("a") + line("b") + '{"prompt": "c", "ans', 2),
                       (line("a") + line("z"), 1), (line("z"), 0), ("not json\n", 0)):
        partial.write_text(held)
        with outputs.KeptLines(path, "--out", ["a", "b", "c"]) as out:
            assert out.kept == kept
        assert path.read_text() == "".join(line(p) for p in "abc"[:kept])


def test_two_runs_writing_one_out_at_once_the_second_is_refused(tmp_path):
    """(Two opens of the file hold two locks, as two processes would: flock's.)"""
    path = tmp_path / "answers.jsonl"
    with outputs.KeptLines(path, "--out", ["a"]):
        with pytest.raises(UserError, match="is being written by another run"):
            outputs.KeptLines(path, "--out", ["a"])


@pytest.mark.parametrize("content", [
    b"not json\n", b"\xff\xfe\x00\x01", b"[1, 2]\n", b'{"category": "math"}\n',
    b'{"category": 5, "turns": ["a"]}\n', b'{"category": "math", "turns": []}\n', b"\n\n"])
def test_a_questions_file_that_is_not_mt_bench_is_one_line_before_the_loading(content, tmp_path,
                                                                              monkeypatch):
    questions = tmp_path / "question.jsonl"
    questions.write_bytes(content)
    monkeypatch.setattr(bench, "ensure_default_model", lambda *a: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as stop:
        bench.main(["--quick", "--questions", str(questions)])
    assert str(stop.value.code).startswith(f"error: --questions {questions}")


def test_a_bench_out_that_cannot_be_written_is_said_before_the_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ensure_default_model", lambda *a: pytest.fail("loaded"))
    for flag in ("--out", "--plot"):
        with pytest.raises(SystemExit, match=f"^error: {flag} {tmp_path / 'no'}"):
            bench.main(["--quick", flag, str(tmp_path / "no" / "bench.json")])


def test_a_training_out_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a file").write_text("not a folder")
    with pytest.raises(UserError, match="cannot be made or written"):
        lock_folder(tmp_path / "a file" / "heads", "train.py")


def test_a_second_run_on_a_locked_out_names_the_first_and_stops(tmp_path):
    """The lock holder is another process (flock locks are per open file, so a lock this
    process took would not stop it)."""
    folder = tmp_path / "heads"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; "
        "from minimedusa.files.outputs import lock_folder; "
        f"lock_folder(Path({str(folder)!r}), 'train.py'); print('held', flush=True); "
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match=f"being written by another train.py \\(process "
                                            f"{holder.pid}\\)"):
            lock_folder(folder, "train.py")
    finally:
        holder.kill()
        holder.wait()
    lock_folder(folder, "train.py")  # the lock goes with its process, however it ended
    outputs._locks.pop(folder.resolve()).close()


def read_until(fd: int, mark: bytes) -> bytes:
    """What the terminal shows until `mark` (a regular expression) has appeared (60 s at most)."""
    got, deadline = b"", time.time() + 60
    while not re.search(mark, got) and time.time() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                got += os.read(fd, 1 << 16)
            except OSError:
                break
    return got


def chat_line_lengths(line: str, editing: bool) -> list[str]:
    """What the chat's reader takes of `line` typed into a terminal (a pseudo-terminal)."""
    reader = ("from minimedusa.cli import chat; "
              + ("" if editing else "chat.line_editing = lambda: None; ")
              + "[print('got', len(line), flush=True) for line in chat.read_lines(True)]")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat's reader on the terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-c", reader])
    read_until(fd, rb"> ")  # the prompt: the line is typed when the chat waits for it
    os.write(fd, line.encode() + b"\r")
    got = read_until(fd, rb"got \d+\s")
    os.kill(pid, signal.SIGKILL)  # not Ctrl-D: the terminal may still hold the cut line's rest
    os.waitpid(pid, 0)
    os.close(fd)
    return re.findall(r"got (\d+)", got.decode(errors="replace"))


def test_the_chat_takes_a_pasted_line_longer_than_the_terminals_whole():
    assert chat_line_lengths("x" * 10_000, editing=True) == ["10000"]
    # the control: without line editing the terminal cuts it (Linux: at 4,095 bytes)
    assert chat_line_lengths("x" * 10_000, editing=False) != ["10000"]

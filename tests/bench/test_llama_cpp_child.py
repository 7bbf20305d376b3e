"""llama.cpp in a process of its own: its replies come back through the pipe, and when its native
code dies (as llama-cpp-python's native build does on AMX CPUs) the benchmark says so in one line
and reports every other engine. A stand-in child (a few lines of Python speaking the same JSON
lines) takes llama.cpp's place, so none of this needs llama-cpp-python or the GGUF file."""
import importlib.util
import json
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from minimedusa.bench import bench, bench_flags, llama_cpp, processes
from minimedusa.bench.llama_cpp_tools import BINDING
from minimedusa.bench.engines import Engines
from minimedusa.files.default_model import DEFAULT_GGUF

# answers `answers` requests (-1: all), then dies by SIGSEGV; says so in `ended` once its input ends
STAND_IN = """
import json, os, resource, signal, sys
answers, ended = int(sys.argv[1]), sys.argv[2]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if answers == 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the repository
        os.kill(os.getpid(), signal.SIGSEGV)
    answers -= 1
    request = json.loads(line)
    reply = {"tokens": request["prompt"][:1] * request["n"], "seconds": 0.25}
    print(json.dumps(reply), flush=True)
open(ended, "w").close()
"""
LLAMA = BINDING
# a stand-in tokenizer: a prompt's ids are its words' lengths
WORDS = SimpleNamespace(chat_prompt=lambda messages: messages[-1]["content"],
                        encode=lambda text: [len(w) for w in text.split()])
QUESTIONS = [{"id": i, "category": c, "prompt": p} for i, (c, p) in
             enumerate([("writing", "Write a poem"), ("math", "What is two plus two"),
                        ("coding", "Sort a list")])]


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """llama_cpp_engine, its child the stand-in that answers `answers` requests then dies."""
    def engine(answers: int, command=None):
        command = command or [sys.executable, "-c", STAND_IN, str(answers),
                              str(tmp_path / "ended")]
        monkeypatch.setattr(llama_cpp, "child_command", lambda gguf, threads, context: command)
        return llama_cpp.llama_cpp_engine(tmp_path / "model.gguf", 1)
    return engine


def plain(ids, n, seed):
    return [1] * n, 0.5, n


def test_the_child_gives_back_its_tokens_and_the_seconds_it_timed(stand_in):
    run = stand_in(-1)
    assert run([7, 8], 3, 0) == ([7, 7, 7], 0.25, 3)
    assert run([9], 2, 1) == ([9, 9], 0.25, 2)


def test_dropping_the_engine_ends_its_process(stand_in, tmp_path):
    run = stand_in(-1)
    run([7], 1, 0)
    del run  # its finalizer closes the child's input, then waits for it
    assert (tmp_path / "ended").is_file()


def test_a_child_killed_by_sigsegv_is_one_line_naming_the_signal_and_the_build(stand_in):
    run = stand_in(1)
    run([7], 1, 0)
    with pytest.raises(llama_cpp.EngineDied) as died:
        run([7], 1, 0)
    message = str(died.value)
    assert "\n" not in message and "killed by SIGSEGV" in message
    assert "-DGGML_AMX_TILE=OFF" in message and "--no-cache-dir" in message


def test_a_child_dying_while_it_loads_is_one_line_with_its_exit_status(stand_in):
    with pytest.raises(llama_cpp.EngineDied, match=r"^llama.cpp's process died \(exit status 3\)"):
        stand_in(0, [sys.executable, "-c", "raise SystemExit(3)"])


@pytest.mark.parametrize("answers", [0, 2])  # dies at the warm-up; on the second question
def test_bench_reports_every_other_engine_when_llama_cpp_dies(stand_in, answers, tmp_path,
                                                              capsys):
    engines = Engines(run={"plain": plain, LLAMA: stand_in(answers)})
    rows = bench.run_questions(engines, QUESTIONS, WORDS, 4)
    assert list(engines.run) == ["plain"] and all(set(r) == {"id", "category", "plain"}
                                                  for r in rows)
    lines = [line for line in capsys.readouterr().err.splitlines() if "SIGSEGV" in line]
    assert len(lines) == 1 and lines[0].startswith(f"{LLAMA} is left out of the comparison: ")
    args = Namespace(reference="plain", heads=["h"], max_new_tokens=4, out=tmp_path / "b.json",
                     plot=None)
    bench.report(args, rows, engines, {"read_gb_s": 1.0, "copy_gb_s": 1.0},
                 torch.device("cpu"), torch.float32)
    result = json.loads((tmp_path / "b.json").read_text())
    assert list(result["totals"]) == ["plain"] and result["totals"]["plain"]["tokens"] == 12


def test_generate_processes_report_the_processes_when_llama_cpp_dies(stand_in, monkeypatch,
                                                                     capsys):
    """--generate: llama.cpp answers the first question, dies on the second; the generate.py
    processes (stood in for here) are reported, llama.cpp nowhere."""
    def process(args, prompt, mode):
        return {"new_tokens": 4, "seconds": 0.5, "mode": mode, "format": "float32",
                "step": "eager", "output_ids": [1] * 4}, 1.0
    monkeypatch.setattr(processes, "generate_process", process)
    monkeypatch.setattr(processes, "llama_cpp_engines",
                        lambda args, folder, threads, tokenizer: {LLAMA: stand_in(1)})
    args = bench_flags.parse_args(["--generate", "--heads", "h", "--threads", "1",
                                   "--max-new-tokens", "4", "--rounds", "1"])  # as a user's
    processes.report_generate_processes(args, QUESTIONS, "cpu", WORDS, None)
    out, err = capsys.readouterr()
    shown = json.loads(out)
    assert LLAMA not in shown and shown["default"]["tokens"] == shown["baseline"]["tokens"] == 12
    assert sum("killed by SIGSEGV" in line for line in err.splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or not DEFAULT_GGUF.is_file(),
                    reason="needs llama-cpp-python and the default model's GGUF already here")
def test_the_real_child_answers_with_llama_cpp():
    run = llama_cpp.llama_cpp_engine(DEFAULT_GGUF, 1, context=256)
    try:
        tokens, seconds, n = run([1, 9690, 314, 253], 4, 0)
    except llama_cpp.EngineDied as died:
        if "killed by" in str(died):  # its native build crashes on this CPU: the line says why
            pytest.skip(str(died))
        raise
    assert len(tokens) == n == 4 and seconds > 0

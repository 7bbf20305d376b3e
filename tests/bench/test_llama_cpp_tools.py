"""llama.cpp's own tools in `bench` (bench/llama_cpp_tools.py): found where the user built them,
run as a user runs them, their own prompt and decoding times read from their log (or, for
llama-batched-bench, its JSON lines). Stand-in programs here print what the real ones print;
the real ones run where they are on PATH."""
import shutil
import stat
import sys
from pathlib import Path

import pytest

from minimedusa.bench.llama_cpp import EngineDied
from minimedusa.bench.llama_cpp_tools import (batched_rates, completion_engine, decoding_rate,
                                              find_tools)
from minimedusa.errors import UserError

COMPLETION = f"""#!{sys.executable}
import sys
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
n = int(args[args.index("-n") + 1])
open(log, "w").write(
    "0.01.000.000 I common_perf_print:        load time =     500.07 ms\\n"
    "0.01.000.001 I common_perf_print: prompt eval time =     225.70 ms /    16 tokens\\n"
    f"0.01.000.002 I common_perf_print:        eval time =    3079.55 ms /    {{n - 1}} runs\\n"
    "0.01.000.003 I common_perf_print:       total time =    3435.56 ms /    79 tokens\\n")
print(args[args.index("-p") + 1])
"""
BENCH = f"""#!{sys.executable}
print('[{{"n_gen": 64, "avg_ts": 143.2345}}]')
"""
BATCHED = f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
n = int(args[args.index("-ntg") + 1])
print("main: n_kv_max = 8192")  # its log lines, then a JSON line a batch size
for pl in map(int, args[args.index("-npl") + 1].split(",")):
    print(json.dumps({{"pp": 64, "tg": n, "pl": pl, "t_pp": 0.1 * pl, "t_tg": 0.5 * pl ** 0.5}}))
"""
WORDS = type("Words", (), {"decode": staticmethod(lambda ids: " ".join(map(str, ids)))})


def stand_ins(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("llama-completion", COMPLETION), ("llama-bench", BENCH)):
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return folder


@pytest.mark.parametrize("where", ["the folder", "its build/bin"])
def test_the_tools_are_found_where_the_user_built_them(where, tmp_path):
    folder = stand_ins(tmp_path / "build" / "bin" if where == "its build/bin" else tmp_path)
    assert find_tools(tmp_path) == {"llama-completion": folder / "llama-completion",
                                    "llama-bench": folder / "llama-bench"}


def test_a_folder_without_the_tools_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no llama-completion or llama-bench there"):
        find_tools(tmp_path)


def test_a_completion_is_timed_from_its_own_log(tmp_path):
    tools = find_tools(stand_ins(tmp_path / "bin"))
    run = completion_engine(tools, tmp_path / "model.gguf", 2, WORDS)
    assert run([1, 2, 3], 64, 0) == (None, pytest.approx(3.30525), 64)
    assert decoding_rate(tools, tmp_path / "model.gguf", 2, 64) == 143.23


def test_batched_rates_count_each_sizes_new_tokens_over_its_prefill_and_decoding(tmp_path,
                                                                                 monkeypatch):
    tools = find_tools(stand_ins(tmp_path / "bin"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # not found on PATH either
    assert batched_rates(tools, tmp_path / "model.gguf", 2, 64, 32, [1, 4]) is None  # not built
    (tmp_path / "bin" / "llama-batched-bench").write_text(BATCHED)
    (tmp_path / "bin" / "llama-batched-bench").chmod(0o755)
    rates = batched_rates(tools, tmp_path / "model.gguf", 2, 64, 32, [1, 4])
    assert rates == {1: {"tokens_per_s": round(32 / 0.6, 1), "decoding_tokens_per_s": 64.0},
                     4: {"tokens_per_s": round(128 / 1.4, 1), "decoding_tokens_per_s": 128.0}}
    (tmp_path / "bin" / "llama-batched-bench").write_text("#!/bin/sh\nexit 2\n")
    with pytest.raises(EngineDied, match="llama-batched-bench failed \\(exit status 2\\)"):
        batched_rates(tools, tmp_path / "model.gguf", 2, 64, 32, [1, 4])


def test_a_completion_that_fails_is_an_engine_that_died(tmp_path):
    tools = find_tools(stand_ins(tmp_path / "bin"))
    (tmp_path / "bin" / "llama-completion").write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(EngineDied, match="exit status 3"):
        completion_engine(tools, tmp_path / "model.gguf", 2, WORDS)([1], 4, 0)


@pytest.mark.skipif(None in (shutil.which("llama-completion"), shutil.which("llama-bench")),
                    reason="llama.cpp's tools are not on PATH")
def test_the_real_tools_decode_the_default_models_gguf():
    from minimedusa.files.default_model import ensure_default_gguf
    tools = find_tools(None)
    _, seconds, n = completion_engine(tools, ensure_default_gguf(), 2, WORDS)([1, 2, 3], 8, 0)
    assert n == 8 and seconds > 0


def test_a_batched_llama_cpp_that_fails_costs_a_line_not_the_engines_results(monkeypatch,
                                                                             capsys):
    from minimedusa.bench import batches
    result = {"engines": {"plain, one at a time": {"tokens_per_s": 100.0}}}

    def dies(args, folder, prompt_len):
        raise EngineDied("llama-batched-bench failed (exit status 2)")
    monkeypatch.setattr(batches, "llama_cpp_batches", dies)
    batches.report_llama_cpp(None, None, [[1, 2], [3, 4, 5, 6]], 100.0, result)
    assert list(result) == ["engines"]
    assert capsys.readouterr().err.splitlines() == [
        "llama.cpp's batched decoding left out: llama-batched-bench failed (exit status 2)"]
    monkeypatch.setattr(batches, "llama_cpp_batches", lambda args, folder, prompt_len: {
        4: {"tokens_per_s": 250.0, "decoding_tokens_per_s": 300.0}})
    batches.report_llama_cpp(None, None, [[1, 2], [3, 4, 5, 6]], 100.0, result)
    assert result["llama-batched-bench"] == {"prompt_tokens": 3, "by_batch": {
        4: {"tokens_per_s": 250.0, "decoding_tokens_per_s": 300.0}}}
    assert "4 at a time: 250.0 tokens/s (300.0 decoding alone), 2.50x" in capsys.readouterr().out

"""llama.cpp's own tools beside this project in `bench`: what its users run, without the Python
binding's per-token overhead (on the default model the binding decoded at about half the rate of
llama.cpp's `llama-completion`).

Found on PATH, or in the folder --llama-cpp names (a folder holding the programs, or llama.cpp's
source folder with its build/bin; the README says how to build them from llama-cpp-python's
source distribution). An engine runs `llama-completion` once per question, as a user runs it,
on the GGUF the default model came from: greedy, the question's chat-templated prompt, exactly
n new tokens (EOS ignored), and counts its own prompt and decoding times from its log (its
loading apart, as generate.py's). `decoding_rate` is `llama-bench`'s decoding alone.
`llama_cpp_engines` gives a benchmark every llama.cpp at hand: the tools, and the binding.
`batched_rates` is `llama-batched-bench`'s: llama.cpp decoding many sequences at once, beside
`bench --batch`'s engines (built beside the other tools: `cmake --build build --target
llama-batched-bench`).
"""
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from minimedusa.bench.llama_cpp import EngineDied, load_llama_cpp
from minimedusa.errors import UserError
from minimedusa.files.default_model import DEFAULT_MODEL_DIR, ensure_default_gguf

TOOLS = ("llama-completion", "llama-bench")
BATCHED = "llama-batched-bench"
COMPLETION = "llama.cpp Q4_1 (llama-completion)"  # the engines' names in bench's reports
BINDING = "llama.cpp Q4_1 (llama-cpp-python)"


def find_tools(folder: Path | None) -> dict[str, Path] | None:
    """{tool: its path} from `folder` (or its build/bin), else from PATH; None where either is
    missing (a folder given and missing them is an error)."""
    if folder is not None:
        for where in (Path(folder), Path(folder) / "build" / "bin"):
            if all((where / tool).is_file() for tool in TOOLS):
                return {tool: where / tool for tool in TOOLS}
        raise UserError(f"--llama-cpp {folder}: no {' or '.join(TOOLS)} there or in its "
                        "build/bin (the README says how to build them)")
    found = {tool: shutil.which(tool) for tool in TOOLS}
    return None if None in found.values() else {t: Path(p) for t, p in found.items()}


def completion_engine(tools: dict[str, Path], gguf: Path, threads: int, tokenizer):
    """A bench engine: (prompt ids, n, seed) -> (None, seconds, n): llama-completion's own
    seconds from the prompt (the ids' text, special tokens and all) to its n-th new token, read
    from its log."""
    def run(prompt_ids: list[int], n: int, seed):
        prompt = tokenizer.decode(prompt_ids)
        with tempfile.TemporaryDirectory() as scratch:
            log = Path(scratch) / "log.txt"
            done = subprocess.run(
                [str(tools["llama-completion"]), "-m", str(gguf), "-t", str(threads), "-p", prompt,
                 "-n", str(n), "--ignore-eos", "--temp", "0", "-no-cnv", "--log-file", str(log)],
                capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
            said = log.read_text(errors="replace") if log.is_file() else ""
        if done.returncode != 0:
            raise EngineDied(f"llama-completion failed (exit status {done.returncode})")
        times = [float(ms) for ms in re.findall(r"(?:prompt eval|[^t] eval) time =\s*([\d.]+) ms",
                                                said)]
        if len(times) != 2:
            raise EngineDied("llama-completion's log gave no prompt and eval times")
        return None, sum(times) / 1000, n
    return run


def decoding_rate(tools: dict[str, Path], gguf: Path, threads: int, n: int) -> float:
    """llama-bench's tokens/s decoding n tokens alone (no prompt), the mean of 3 repetitions."""
    done = subprocess.run([str(tools["llama-bench"]), "-m", str(gguf), "-t", str(threads),
                           "-p", "0", "-n", str(n), "-r", "3", "-o", "json"],
                          capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        raise EngineDied(f"llama-bench failed (exit status {done.returncode})")
    return round(json.loads(done.stdout)[0]["avg_ts"], 2)


def batched_rates(tools: dict[str, Path], gguf: Path, threads: int, prompt_len: int, n: int,
                  batches: list[int]) -> dict[int, dict] | None:
    """llama-batched-bench's rates where it lies beside `tools` (or on PATH), else None: for each
    B of `batches`, B sequences of prompt_len tokens prefilled together, then n new tokens each
    decoded together, {B: {"tokens_per_s": B n / (prefill + decoding seconds), as bench --batch
    counts its engines', "decoding_tokens_per_s": B n / decoding seconds}}."""
    beside = tools["llama-completion"].parent / BATCHED
    program = beside if beside.is_file() else shutil.which(BATCHED)
    if program is None:
        return None
    context = max(batches) * (prompt_len + n)  # every sequence's slots, in one cache
    done = subprocess.run(
        [str(program), "-m", str(gguf), "-t", str(threads), "-c", str(context),
         "-npp", str(prompt_len), "-ntg", str(n), "-npl", ",".join(map(str, batches)),
         "--output-format", "jsonl"], capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        raise EngineDied(f"{BATCHED} failed (exit status {done.returncode})")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["pl"]: {"tokens_per_s": round(row["pl"] * n / (row["t_pp"] + row["t_tg"]), 1),
                        "decoding_tokens_per_s": round(row["pl"] * n / row["t_tg"], 1)}
            for row in rows}


def runs_the_model(folder: Path) -> bool:
    """Whether llama.cpp can run beside this project on the model in `folder`: only the
    default model, whose GGUF is the one; else a line on stderr says it is left out."""
    if Path(folder).resolve() == DEFAULT_MODEL_DIR.resolve():
        return True
    print("llama.cpp runs only the default model's GGUF: left out for --model", file=sys.stderr)
    return False


def llama_cpp_engines(args, folder: Path, threads: int, tokenizer) -> dict:
    """{name: engine} of the llama.cpp engines at hand for `bench`: its own llama-completion
    where found (find_tools), and the binding (llama_cpp.py) where installed; each left out
    with one line where it cannot run. Only on the default model (its GGUF is the one)."""
    if args.no_llama_cpp or not runs_the_model(folder):
        return {}
    engines, tools = {}, find_tools(args.llama_cpp)
    if tools is None:
        print("llama.cpp's own tools (llama-completion, llama-bench) are not on PATH: give "
              "--llama-cpp DIR to compare with them", file=sys.stderr)
    else:
        engines[COMPLETION] = completion_engine(tools, ensure_default_gguf(), threads, tokenizer)
    binding = load_llama_cpp(folder, threads)
    if binding is not None:
        engines[BINDING] = binding
    return engines

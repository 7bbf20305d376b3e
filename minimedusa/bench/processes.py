"""generate.py as a user runs it: `python -m minimedusa.bench --generate`.

One generate.py process per question, its default flags against --baseline (plus
--baseline-flags, e.g. "--dtype float32 --no-compile"), alternating which goes first (with several
--heads, a default process for each, interleaved: heads against heads, as users would run them;
the first is "default", the others "default --heads FOLDER"): each
process's own tokens/s (from the prompt to the last token) and its wall time, loading included,
summed over the questions and rounds, and how many answers the two gave alike (greedy Medusa is
lossless: all, where --baseline-flags keeps the format); and llama.cpp on the same prompts: its
own llama-completion, a process a question, where found (llama_cpp_tools.py: and llama-bench's
decoding alone), and its Python binding, loaded once in a process of its own (llama_cpp.py),
where installed.
"""
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from minimedusa.bench.llama_cpp import EngineDied
from minimedusa.bench.llama_cpp_tools import (COMPLETION, decoding_rate, find_tools,
                                              llama_cpp_engines)
from minimedusa.files.default_model import ensure_default_gguf
from minimedusa.files.outputs import write_json


def model_flags(args) -> list[str]:
    """The benchmark's model, device, dtype, threads, weight format and --compile (where
    given; else generate.py's default), as generate.py's flags."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
             "--quantize", args.quantize]
    if args.compile is not None:
        flags.append("--compile" if args.compile else "--no-compile")
    return flags + (["--model", str(args.model)] if args.model is not None else [])


def heads_modes(args) -> dict[str, str]:
    """Each --heads folder's default mode: the first "default", the others named by it."""
    return {("default" if i == 0 else f"default --heads {spec}"): spec
            for i, spec in enumerate(args.heads)}


def generate_process(args, prompt: str, mode: str) -> tuple[dict, float]:
    """One generate.py process in `mode` (a heads_modes name or "baseline"): (its JSON, its
    wall time)."""
    script = Path(__file__).resolve().parents[2] / "generate.py"
    heads = heads_modes(args).get(mode, args.heads[0])
    cmd = [sys.executable, str(script), "--json", "--prompt", prompt,
           "--max-new-tokens", str(args.max_new_tokens), "--heads", heads,
           *model_flags(args), *shlex.split(args.flags)]
    if mode != "baseline":
        cmd += shlex.split(args.default_flags)
    else:
        cmd += ["--baseline", *shlex.split(args.baseline_flags)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout), time.perf_counter() - start


def in_process_run(args, mode: str, engine, prompt_ids, q: dict, i: int) -> tuple[dict, float]:
    """An in-process engine on question q, as a generate.py process's JSON, and its wall time."""
    _, seconds, _ = engine(prompt_ids(q["prompt"]), args.max_new_tokens, i)
    return {"new_tokens": args.max_new_tokens, "seconds": seconds, "mode": mode, "format": mode,
            "step": ""}, seconds


def generate_processes(args, questions: list[dict], in_process: dict) -> dict:
    """generate.py as a user runs it: one process per question, its default flags against
    --baseline, alternating which goes first, for --rounds rounds. Each process's own
    tokens/s (the prompt to the last token) and its wall time, loading included, are summed.
    in_process: other engines (name -> (engine, the question's prompt ids)), timed between;
    one whose process dies is deleted from it, with one line, and the others go on."""
    defaults = list(heads_modes(args))
    totals = {mode: {"tokens": 0, "steps": 0, "seconds": 0.0, "wall_seconds": 0.0, "modes": [],
                     "formats": []} for mode in (*defaults, "baseline", *in_process)}
    answers = {mode: [] for mode in (*defaults, "baseline")}  # each process's output ids
    for r in range(args.rounds):
        for i, q in enumerate(questions):
            order = [*defaults, "baseline", *in_process]
            for mode in (order if (i + r) % 2 == 0 else order[::-1]):
                t = totals[mode]
                if mode in in_process:
                    try:
                        result, wall = in_process_run(args, mode, *in_process[mode], q, i)
                    except EngineDied as died:  # the others go on without it
                        print(f"{mode} is left out of the comparison: {died}", file=sys.stderr)
                        del in_process[mode], totals[mode]
                        continue
                else:
                    result, wall = generate_process(args, q["prompt"], mode)
                    answers[mode].append(result["output_ids"])
                t["wall_seconds"] += wall
                t["tokens"] += result["new_tokens"]
                t["steps"] += result.get("steps", result["new_tokens"])
                t["seconds"] += result["seconds"]
                t["modes"].append(result["mode"])
                t["formats"].append(f"{result['format']} {result['step']}".strip())
            rates = {m: f"{t['tokens'] / t['seconds']:.2f}" for m, t in totals.items()}
            print(f"[round {r + 1}, {i + 1}/{len(questions)}] {q['category']:<10} tokens/s so "
                  f"far: {rates}", file=sys.stderr, flush=True)
    return compared(totals, answers, defaults)


def compared(totals: dict, answers: dict, defaults: list[str]) -> dict:
    """The sums of generate_processes made rates and ratios: each engine's tokens/s and tokens
    a step, against the baseline; each heads' answers against the baseline's; the other heads
    (--heads repeated) against the first. Returns totals, with the first heads' figures on top."""
    for t in totals.values():
        t["tokens_per_s"] = round(t["tokens"] / t["seconds"], 2)
        t["tokens_per_step"] = round(t["tokens"] / max(t["steps"], 1), 3)
    for mode in totals.keys() - {"baseline"}:
        totals[mode]["vs_baseline"] = round(totals[mode]["tokens_per_s"] /
                                            totals["baseline"]["tokens_per_s"], 3)
    for mode in defaults:
        # lossless where both run the same format (no --baseline-flags): the same answers
        same = sum(a == b for a, b in zip(answers[mode], answers["baseline"]))
        totals[mode]["identical"] = f"{same}/{len(answers[mode])}"
    for mode in defaults[1:]:
        for key, measure in (("vs_default", "tokens_per_s"), ("steps_vs_default",
                                                                 "tokens_per_step")):
            totals[mode][key] = round(totals[mode][measure] / totals["default"][measure], 3)
    totals["speedup"] = totals["default"]["vs_baseline"]
    totals["identical"] = totals["default"]["identical"]
    totals["wall_ratio"] = round(totals["baseline"]["wall_seconds"] /
                                 totals["default"]["wall_seconds"], 3)
    return totals


def report_generate_processes(args, questions: list[dict], machine: str, tokenizer,
                              folder: Path) -> None:
    """--generate: print (and with --out save) generate_processes' totals."""
    def prompt_ids(prompt: str) -> list[int]:  # what generate.py decodes from: the template's
        return tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": prompt}]))
    in_process = {name: (engine, prompt_ids) for name, engine
                  in llama_cpp_engines(args, folder, args.threads, tokenizer).items()}
    tools = None if args.no_llama_cpp else find_tools(args.llama_cpp)
    result = {"machine": machine, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "questions": len(questions), "flags": args.flags,
              "default_flags": args.default_flags, "baseline_flags": args.baseline_flags,
              **generate_processes(args, questions, in_process)}
    if COMPLETION in result:  # and llama.cpp's decoding alone, as its users quote it
        result["llama-bench tokens/s"] = decoding_rate(tools, ensure_default_gguf(), args.threads,
                                                       args.max_new_tokens)
    modes = (*heads_modes(args), "baseline", *in_process)
    shown = {k: v for k, v in result.items() if k not in modes}
    for mode in modes:
        shown[mode] = {k: v for k, v in result[mode].items() if k not in ("modes", "formats")}
        shown[mode]["format"] = result[mode]["formats"][0]
    print(json.dumps(shown, indent=1))
    if args.out:
        write_json(args.out, result)

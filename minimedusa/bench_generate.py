"""generate.py as a user runs it: `python -m minimedusa.bench --generate`.

One generate.py process per question, its default flags against --baseline, alternating which
goes first: each process's own tokens/s (from the prompt to the last token) and its wall time,
loading included, summed over the questions and rounds.
"""
import json
import subprocess
import sys
import time
from pathlib import Path


def model_flags(args) -> list[str]:
    """The benchmark's model, device, dtype and threads, as generate.py's flags."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    return flags + (["--model", str(args.model)] if args.model is not None else [])


def generate_processes(args, questions: list[dict]) -> dict:
    """generate.py as a user runs it: one process per question, its default flags against
    --baseline, alternating which goes first, for --rounds rounds. Each process's own
    tokens/s (the prompt to the last token) and its wall time, loading included, are summed."""
    script = Path(__file__).resolve().parent.parent / "generate.py"
    totals = {mode: {"tokens": 0, "seconds": 0.0, "wall_seconds": 0.0, "modes": []}
              for mode in ("default", "baseline")}
    for r in range(args.rounds):
        for i, q in enumerate(questions):
            order = ["default", "baseline"] if (i + r) % 2 == 0 else ["baseline", "default"]
            for mode in order:
                cmd = [sys.executable, str(script), "--json", "--prompt", q["prompt"],
                       "--max-new-tokens", str(args.max_new_tokens), "--heads", args.heads[0],
                       *model_flags(args)] + (["--baseline"] if mode == "baseline" else [])
                start = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                result, t = json.loads(done.stdout), totals[mode]
                t["wall_seconds"] += time.perf_counter() - start
                t["tokens"] += result["new_tokens"]
                t["seconds"] += result["seconds"]
                t["modes"].append(result["mode"])
            rates = {m: f"{t['tokens'] / t['seconds']:.2f}" for m, t in totals.items()}
            print(f"[round {r + 1}, {i + 1}/{len(questions)}] {q['category']:<10} tokens/s so "
                  f"far: {rates}", file=sys.stderr, flush=True)
    for t in totals.values():
        t["tokens_per_s"] = round(t["tokens"] / t["seconds"], 2)
    totals["speedup"] = round(totals["default"]["tokens_per_s"] /
                              totals["baseline"]["tokens_per_s"], 3)
    totals["wall_ratio"] = round(totals["baseline"]["wall_seconds"] /
                                 totals["default"]["wall_seconds"], 3)
    return totals


def report_generate_processes(args, questions: list[dict], machine: str) -> None:
    """--generate: print (and with --out save) generate_processes' totals."""
    result = {"machine": machine, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "questions": len(questions), **generate_processes(args, questions)}
    shown = {k: v for k, v in result.items() if k not in ("default", "baseline")}
    for mode in ("default", "baseline"):
        shown[mode] = {k: v for k, v in result[mode].items() if k != "modes"}
    print(json.dumps(shown, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

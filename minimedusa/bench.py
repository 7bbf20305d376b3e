"""Benchmark: decoding speed on MT-Bench first turns, engines interleaved in one process.

Engines: this project's plain decoding; Medusa greedy decoding with each --heads given; and
(optional, imported lazily) the transformers library's `generate` on the same weights, the
baseline the paper compares with. Reported in the paper's terms (section 7): acceleration rate
(tokens per step), overhead (step latency / plain step latency), speedup. Every engine
produces exactly --max-new-tokens tokens per question (EOS does not stop it) so that tokens/s
compare like for like; the engines alternate question by question, and a warm-up run of each is
excluded, so machine noise hits all of them alike. Report ratios from one run, not absolute
numbers from different runs.

    python -m minimedusa.bench                      # 1 question per category, 128 tokens
    python -m minimedusa.bench --per-category 2 --out bench.json
    python -m minimedusa.bench --heads untrained:4 --heads untrained-shared:4 --tree cpu_8
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minimedusa.acceptance import greedy
from minimedusa.default_model import DEFAULT_MODEL_DIR, ensure_default_model
from minimedusa.device import pick_device, pick_dtype
from minimedusa.heads import heads_from_spec
from minimedusa.medusa_decoding import medusa_decode
from minimedusa.plain_decoding import plain_decode
from minimedusa.sampling import Sampling
from minimedusa.tokenizer import Tokenizer
from minimedusa.tree import tree_for_heads
from minimedusa.weights import load_model

MT_BENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / \
    "mt_bench_questions.jsonl"


def first_turns(path: Path, per_category: int) -> list[dict]:
    """The first `per_category` questions of each MT-Bench category, first turn only."""
    if not path.is_file():
        raise FileNotFoundError(f"MT-Bench questions not found at {path} (use --questions)")
    taken, counts = [], {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if counts.get(q["category"], 0) < per_category:
            counts[q["category"]] = counts.get(q["category"], 0) + 1
            taken.append({"id": q["question_id"], "category": q["category"],
                          "prompt": q["turns"][0]})
    return taken


def timed(steps) -> tuple[list[int], float, int]:
    """Drain a decoding iterator: (tokens, seconds, steps)."""
    start, out, n = time.perf_counter(), [], 0
    for step in steps:
        out += step
        n += 1
    return out, time.perf_counter() - start, n


def plain_engine(model):
    return lambda ids, n: timed(plain_decode(model, ids, n, Sampling(), set()))


def medusa_engine(model, heads, tree):
    return lambda ids, n: timed(medusa_decode(model, heads, tree, ids, n, greedy(), set()))


def load_transformers(folder: Path, device, dtype):
    """transformers' Llama on the same converted weights, or None if it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def transformers_engine(hf_model):
    def run(prompt_ids: list[int], n: int):
        ids = torch.tensor([prompt_ids], device=hf_model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start, n
    return run


def summarize(rows: list[dict], engines: list[str]) -> dict:
    """Totals per engine in the paper's terms, relative to this project's plain decoding."""
    totals = {}
    for e in engines:
        tokens = sum(r[e]["tokens"] for r in rows)
        seconds = sum(r[e]["seconds"] for r in rows)
        steps = sum(r[e]["steps"] for r in rows)
        totals[e] = {"tokens": tokens, "seconds": round(seconds, 3), "steps": steps,
                     "tokens_per_s": round(tokens / seconds, 2),
                     "acceleration_rate": round(tokens / steps, 3),
                     "step_ms": round(1000 * seconds / steps, 2)}
    plain = totals["plain"]
    for t in totals.values():
        t["overhead"] = round(t["step_ms"] / plain["step_ms"], 3)
        t["speedup"] = round(t["tokens_per_s"] / plain["tokens_per_s"], 3)
    return totals


def markdown(totals: dict) -> str:
    lines = ["| engine | tokens/s | tokens/step | step ms | overhead | speedup | same as plain |",
             "|---|---|---|---|---|---|---|"]
    for name, t in totals.items():
        lines.append(f"| {name} | {t['tokens_per_s']:.1f} | {t['acceleration_rate']:.2f} | "
                     f"{t['step_ms']:.1f} | {t['overhead']:.2f}x | {t['speedup']:.2f}x | "
                     f"{t['identical']}/{t['questions']} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description="Decoding speed on MT-Bench first turns, greedy: "
                                "this project's plain decoding, Medusa with each --heads, and "
                                "the transformers library's generate, interleaved in one process.")
    p.add_argument("--per-category", type=int, default=1,
                   help="questions per MT-Bench category (8 categories; default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per question (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads (default: %(default)s, this project's CI machine)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (default: float32 on CPU, "
                   "bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama folder (default: the default model in weights/)")
    p.add_argument("--heads", action="append", default=[],
                   help="Medusa heads to time (a folder, untrained:K or untrained-shared:K); "
                   "repeat the flag to compare several side by side")
    p.add_argument("--tree", default=None,
                   help="candidate tree for the Medusa engines (default: per device, as "
                   "generate.py)")
    p.add_argument("--questions", type=Path, default=MT_BENCH,
                   help="MT-Bench questions JSONL (default: ../shared/data/...)")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the transformers baseline even if the library is installed")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    folder = args.model or ensure_default_model(DEFAULT_MODEL_DIR)
    tokenizer = Tokenizer.from_folder(folder)
    questions = first_turns(args.questions, args.per_category)
    model = load_model(folder, device, dtype)
    engines = {"plain": plain_engine(model)}
    for spec in args.heads:
        heads = heads_from_spec(spec, model)
        tree_name, tree = tree_for_heads(args.tree, heads, model.config, device)
        engines[f"medusa {spec} {tree_name}"] = medusa_engine(model, heads, tree)
    hf = None if args.no_transformers else load_transformers(folder, device, dtype)
    if hf is not None:
        engines["transformers"] = transformers_engine(hf)
    elif not args.no_transformers:
        print("transformers is not installed: it is left out of the comparison "
              "(pip install transformers, in a scratch environment, to compare)", file=sys.stderr)
    names = list(engines)

    warm = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    for run in engines.values():  # warm-up, excluded
        run(warm, 8)
    rows = []
    for i, q in enumerate(questions):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q["prompt"]}]))
        row, outputs = {"id": q["id"], "category": q["category"]}, {}
        order = names if i % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            outputs[name], seconds, steps = engines[name](ids, args.max_new_tokens)
            row[name] = {"tokens": len(outputs[name]), "seconds": round(seconds, 4),
                         "steps": steps}
        for name in names:
            row[name]["same_as_plain"] = outputs[name] == outputs["plain"]
        rows.append(row)
        speeds = ", ".join(f"{n} {row[n]['tokens'] / row[n]['seconds']:.1f}" for n in names)
        print(f"[{i + 1}/{len(questions)}] {q['category']:<10} tokens/s: {speeds}",
              file=sys.stderr)

    totals = summarize(rows, names)
    for name in names:
        totals[name]["identical"] = sum(r[name]["same_as_plain"] for r in rows)
        totals[name]["questions"] = len(rows)
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "torch": torch.__version__, "totals": totals, "questions": rows}
    print(markdown(totals))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

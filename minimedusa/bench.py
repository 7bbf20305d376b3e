"""Benchmark: decoding speed on MT-Bench first turns, engines interleaved in one process.

Engines: this project's plain decoding, and (optional, imported lazily) the transformers
library's `generate` on the same weights, the baseline the paper compares with. Every engine
produces exactly --max-new-tokens tokens per question (EOS does not stop it) so that tokens/s
compare like for like; the engines alternate question by question, and a warm-up run of each is
excluded, so machine noise hits all of them alike. Report ratios from one run, not absolute
numbers from different runs.

    python -m minimedusa.bench                      # 1 question per category, 128 tokens
    python -m minimedusa.bench --per-category 2 --out bench.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minimedusa.default_model import DEFAULT_MODEL_DIR, ensure_default_model
from minimedusa.device import pick_device, pick_dtype
from minimedusa.plain_decoding import plain_decode
from minimedusa.sampling import Sampling
from minimedusa.tokenizer import Tokenizer
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


def run_plain(model, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = [t for step in plain_decode(model, prompt_ids, n, Sampling(), set()) for t in step]
    return out, time.perf_counter() - start


def load_transformers(folder: Path, device, dtype):
    """transformers' Llama on the same converted weights, or None if it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def run_transformers(hf_model, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    seconds = time.perf_counter() - start
    return out[0, len(prompt_ids):].tolist(), seconds


def summarize(rows: list[dict], engines: list[str]) -> dict:
    totals = {}
    for e in engines:
        tokens = sum(r[e]["tokens"] for r in rows)
        seconds = sum(r[e]["seconds"] for r in rows)
        totals[e] = {"tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 2)}
    return totals


def markdown(totals: dict, rows: list[dict], engines: list[str], identical: int) -> str:
    base = totals["plain"]["tokens_per_s"]
    lines = ["| engine | tokens | seconds | tokens/s | vs plain |", "|---|---|---|---|---|"]
    for e in engines:
        t = totals[e]
        lines.append(f"| {e} | {t['tokens']} | {t['seconds']:.1f} | {t['tokens_per_s']:.1f} | "
                     f"{t['tokens_per_s'] / base:.2f}x |")
    if "transformers" in engines:
        lines.append(f"\nidentical greedy outputs (plain vs transformers): {identical}/{len(rows)}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description="Decoding speed on MT-Bench first turns: this "
                                "project's plain decoding vs the transformers library's "
                                "generate, interleaved in one process.")
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
    engines = {"plain": (load_model(folder, device, dtype), run_plain)}
    hf = None if args.no_transformers else load_transformers(folder, device, dtype)
    if hf is not None:
        engines["transformers"] = (hf, run_transformers)
    elif not args.no_transformers:
        print("transformers is not installed: only this project's plain decoding is timed "
              "(pip install transformers, in a scratch environment, to compare)", file=sys.stderr)
    names = list(engines)

    for name, (model, run) in engines.items():  # warm-up, excluded
        run(model, tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}])), 8)
    rows, identical = [], 0
    for i, q in enumerate(questions):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q["prompt"]}]))
        row, outputs = {"id": q["id"], "category": q["category"]}, {}
        order = names if i % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            model, run = engines[name]
            outputs[name], seconds = run(model, ids, args.max_new_tokens)
            row[name] = {"tokens": len(outputs[name]), "seconds": round(seconds, 4)}
        identical += len(set(map(tuple, outputs.values()))) == 1
        rows.append(row)
        speeds = ", ".join(f"{n} {row[n]['tokens'] / row[n]['seconds']:.1f} tok/s" for n in names)
        print(f"[{i + 1}/{len(questions)}] {q['category']:<10} {speeds}", file=sys.stderr)

    totals = summarize(rows, names)
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "torch": torch.__version__, "totals": totals, "questions": rows,
              "identical_outputs": identical}
    print(markdown(totals, rows, names, identical))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Benchmark: decoding speed on MT-Bench first turns, engines interleaved in one process.

Engines: this project's plain decoding; Medusa with the given heads, verified greedily and (at
--temperature) by typical acceptance and by rejection sampling, its tree's size adapted step by
step as generate.py does (budget.py; the steps run at each size are reported), or with a fixed
--tree; optionally Medusa with trees
of several sizes grown from the heads' calibration (--sizes, the paper's Fig. 4); and
(optional, imported lazily) the transformers library's `generate` on the same weights, the
baseline the paper compares with. Reported in the paper's terms (section 7), per category and
overall: acceleration rate (tokens per step), overhead (step latency / plain step latency),
speedup (tokens/s / plain tokens/s). Every engine produces exactly --max-new-tokens tokens per
question (EOS does not stop it) so that tokens/s compare like for like; the engines alternate
question by question, and a warm-up run of each is excluded, so machine noise hits all of them
alike. Report ratios from one run, not absolute numbers from different runs.

    python -m minimedusa.bench --quick                   # smoke test, < 3 minutes on a CPU
    python -m minimedusa.bench --out bench.json --plot bench.png
    python -m minimedusa.bench --heads untrained-shared:4 --tree cpu_8 --no-sampling
"""
import argparse
import copy
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from minimedusa.acceptance import greedy, rejection, typical
from minimedusa.bench_generate import report_generate_processes
from minimedusa.bench_report import category_table, markdown, plot, summarize
from minimedusa.budget import (expected_length, expected_length_of, grow_tree, nested_trees,
                               read_calibration)
from minimedusa.cli import (add_device_arguments, add_quantize_argument, decoding_budget,
                            decoding_heads, decoding_model, decoding_tree, device_and_format,
                            ranked_vocab_size)
from minimedusa.decoding import adaptive_decode, medusa_decode, plain_decode, ranked_decode
from minimedusa.default_model import DEFAULT_HEADS_DIR, DEFAULT_MODEL_DIR, ensure_default_model
from minimedusa.device import device_name, machine_key
from minimedusa.errors import UserError, entry_point
from minimedusa.sampling import Sampling
from minimedusa.step_profile import profile_steps
from minimedusa.tokenizer import Tokenizer
from minimedusa.weight_formats import activation_dtype

MT_BENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / \
    "mt_bench_questions.jsonl"


def first_turns(path: Path, per_category: int) -> list[dict]:
    """The first `per_category` questions of each MT-Bench category, first turn only."""
    if not path.is_file():
        raise UserError(f"MT-Bench questions not found at {path} (use --questions)")
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
    return lambda ids, n, seed: timed(plain_decode(model, ids, n, Sampling(), set()))


def medusa_engine(model, heads, tree, acceptance):
    return lambda ids, n, seed: timed(medusa_decode(model, heads, tree, ids, n, acceptance,
                                                    set(), seed))


def adaptive_engine(model, heads, trees, budget, acceptance, usage: Counter, ranked=False):
    """Medusa with the tree's size adapted step by step, as generate.py decodes by default (with
    `ranked`: as --tree ranked does): each question starts from the same prior (a fresh copy of
    `budget`), as each generate.py process does; the steps run at each size go to `usage`."""
    def run(ids, n, seed):
        fresh = copy.deepcopy(budget)
        result = timed(adaptive_decode(model, heads, trees, fresh, ids, n, acceptance, set(),
                                       seed, ranked=ranked))
        usage.update(fresh.used)
        return result
    return run


def load_transformers(folder: Path, device, dtype):
    """transformers' Llama on the same converted weights, or None if it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    # local_files_only: the folder is this project's converted model; never ask a hub
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True) \
        .to(device).eval()


def transformers_engine(hf_model):
    def run(prompt_ids: list[int], n: int, seed):
        ids = torch.tensor([prompt_ids], device=hf_model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start, n
    return run


def rule_engines(label, spec, model, heads, tree, args, usage: dict) -> dict:
    """Greedy, and at --temperature typical and rejection sampling: with `tree` (the --tree)
    for every step, or without one with the tree's size adapted (usage[name]: the steps at each
    size)."""
    rules = {"greedy": greedy()}
    if args.temperature > 0:
        T = args.temperature
        rules.update({f"typical T={T}": typical(T), f"rejection T={T}": rejection(T)})
    if tree is not None:
        return {label + r: medusa_engine(model, heads, tree, a) for r, a in rules.items()}
    trees, budget, why = decoding_budget(heads, model, spec)
    print(f"{label.strip()}: tree sizes {list(trees)} or plain, {why}", file=sys.stderr)
    usage.update({label + r: Counter() for r in rules})
    return {label + r: adaptive_engine(model, heads, trees, budget, a, usage[label + r])
            for r, a in rules.items()}


def medusa_engines(args, model, device, usage: dict) -> tuple[dict, dict]:
    """(name -> engine, name -> expected tokens/step from the heads' calibration, if any): for
    every --heads, and for each of them every --draft-vocab."""
    engines, expected = {}, {}
    for spec in args.heads:
        for vocab in args.draft_vocab:
            heads = decoding_heads(spec, model, vocab)
            label = (f"{heads.config.head_kind} {Path(spec).name} " if len(args.heads) > 1
                     else f"{heads.config.head_kind} ")
            if len(args.draft_vocab) > 1:
                label += f"V'={ranked_vocab_size(heads, model)} "
            heads_engines(engines, expected, label, spec, heads, model, device, args, usage)
    return engines, expected


def heads_engines(engines, expected, label, spec, heads, model, device, args, usage) -> None:
    """One heads' engines (the acceptance rules, and --sizes' fixed trees), into engines."""
    accuracy = read_calibration(Path(spec)) if Path(spec).is_dir() else None
    tree = None
    if args.tree is not None:
        tree_name, tree = decoding_tree(args.tree, heads, model)
        print(f"{label.strip()}: tree {tree_name} ({tree.size - 1} nodes)", file=sys.stderr)
        if accuracy is not None:
            expected[label + "greedy"] = expected_length_of(tree.nodes[1:], accuracy)
    engines.update(rule_engines(label, spec, model, heads, tree, args, usage))
    if args.sizes:
        if accuracy is None:
            raise UserError(f"--sizes grows trees from {spec}/calibration.json, "
                            "which does not exist (run python -m minimedusa.tree_search)")
        nodes, probs = grow_tree(accuracy, max(args.sizes))
        trees, _ = nested_trees(nodes, args.sizes, heads.config.medusa_num_heads,
                                ranked_vocab_size(heads, model), device)
        for n, sized in trees.items():
            engines[label + f"greedy {n} nodes"] = medusa_engine(model, heads, sized, greedy())
            expected[label + f"greedy {n} nodes"] = expected_length(probs[:n])
    for n in args.ranked:
        engines[label + f"greedy ranked {n} nodes"] = ranked_engine(model, heads, n)
    if args.ranked_adapted:
        trees, budget, _ = decoding_budget(heads, model, spec)
        usage[label + "greedy ranked"] = Counter()
        engines[label + "greedy ranked"] = adaptive_engine(model, heads, trees, budget, greedy(),
                                                           usage[label + "greedy ranked"], True)


def ranked_engine(model, heads, size: int):
    return lambda ids, n, seed: timed(ranked_decode(model, heads, size, ids, n, greedy(), set()))


def add_engine_flags(p) -> None:
    """What to time: the questions, the heads, their trees and acceptance rules."""
    p.add_argument("--per-category", type=int, default=2,
                   help="questions per MT-Bench category, 8 categories (default: %(default)s; "
                   "10 = all 80)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens generated per question, EOS ignored (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 question per category, 32 tokens, no transformers, "
                   "no --sizes (under 3 minutes on a 2-core CPU)")
    p.add_argument("--heads", action="append", default=None,
                   help="heads to time: a folder, untrained:K, untrained-shared:K or "
                   "untrained-hydra:K; "
                   "repeat to compare several (default: the default model's trained heads)")
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[None], metavar="N",
                   help="the heads rank only their N most frequent tokens (0: the whole "
                   "vocabulary; several values: one engine each; default: the heads' own "
                   "draft_vocab_size, if set)")
    p.add_argument("--tree", default=None,
                   help="a fixed candidate tree for the Medusa engines (default: as "
                   "generate.py, the tree's size adapted step by step on this machine)")
    p.add_argument("--sizes", default="",
                   help="also time greedy Medusa with the best tree of each of these sizes, "
                   "grown from the heads' calibration, e.g. 1,2,4,8,16,32,64 (tokens/s "
                   "against tree size, the paper's Fig. 4)")
    p.add_argument("--ranked", default="",
                   help="also time greedy Medusa with confidence-ranked trees of these sizes "
                   "(ranked_tree.py), e.g. 4,8,16, beside --sizes' static trees")
    p.add_argument("--ranked-adapted", action="store_true",
                   help="also time greedy Medusa with confidence-ranked trees whose size the "
                   "budget adapts step by step (generate.py --tree ranked)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="temperature of the typical and rejection sampling engines "
                   "(default: %(default)s, the paper's)")
    p.add_argument("--no-sampling", action="store_true",
                   help="time greedy Medusa only (no typical / rejection sampling engines)")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the transformers baseline even if the library is installed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Decoding speed on MT-Bench first turns: this "
                                "project's plain decoding, Medusa (greedy, typical and "
                                "rejection sampling) and the transformers library's generate, "
                                "interleaved question by question in one process.")
    add_engine_flags(p)
    add_device_arguments(p, threads_default=2)  # 2: this project's CI machine
    add_quantize_argument(p)
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama folder (default: the default model in weights/)")
    p.add_argument("--questions", type=Path, default=MT_BENCH,
                   help="MT-Bench questions JSONL (default: ../shared/data/...)")
    p.add_argument("--generate", action="store_true",
                   help="instead of the in-process benchmark, run generate.py once per question "
                   "and round, its default flags against --baseline (as a user runs it)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --generate: passes over the questions (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="instead of the benchmark, profile a few plain and Medusa greedy steps on "
                   "the first question (torch.profiler, operators by their own time)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None,
                   help="write a PNG plot here (needs matplotlib, which is optional)")
    args = p.parse_args(argv)
    if args.quick:
        args.per_category, args.max_new_tokens, args.no_transformers = 1, 32, True
        args.sizes = args.ranked = ""
    args.sizes = [int(n) for n in args.sizes.split(",") if n]
    args.ranked = [int(n) for n in args.ranked.split(",") if n]
    if args.no_sampling:
        args.temperature = 0.0
    if args.heads is None:
        if args.model is not None or not DEFAULT_HEADS_DIR.is_dir():
            p.error("no --heads given and no trained heads for the default model in weights/")
        args.heads = [str(DEFAULT_HEADS_DIR)]
    return args


def engines_to_time(args, model, folder: Path, device, dtype) -> tuple[dict, dict, dict]:
    """(name -> engine, name -> expected tokens/step, name -> steps by tree size): plain decoding,
    the Medusa engines and, if it is installed, transformers' generate."""
    engines, usage = {"plain": plain_engine(model)}, {}
    medusa, expected = medusa_engines(args, model, device, usage)
    engines.update(medusa)
    hf = None if args.no_transformers else load_transformers(folder, device, dtype)
    if hf is not None:
        engines["transformers"] = transformers_engine(hf)
    elif not args.no_transformers:
        print("transformers is not installed: it is left out of the comparison "
              "(pip install transformers, in a scratch environment, to compare)", file=sys.stderr)
    return engines, expected, usage


def run_questions(engines: dict, usage: dict, questions: list[dict], tokenizer,
                  max_new_tokens: int) -> list[dict]:
    """Every engine on every question, alternating who goes first, after an excluded warm-up:
    one row per question with each engine's tokens, seconds, steps and sameness to plain."""
    names = list(engines)
    warm = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    for run in engines.values():  # warm-up, excluded
        run(warm, 8, 0)
    for counts in usage.values():  # the warm-up's steps are not the benchmark's
        counts.clear()
    rows = []
    for i, q in enumerate(questions):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q["prompt"]}]))
        row, outputs = {"id": q["id"], "category": q["category"]}, {}
        order = names if i % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            outputs[name], seconds, steps = engines[name](ids, max_new_tokens, i)
            row[name] = {"tokens": len(outputs[name]), "seconds": round(seconds, 4),
                         "steps": steps}
        for name in names:
            row[name]["same_as_plain"] = outputs[name] == outputs["plain"]
        rows.append(row)
        speeds = ", ".join(f"{n} {row[n]['tokens'] / row[n]['seconds']:.1f}" for n in names)
        print(f"[{i + 1}/{len(questions)}] {q['category']:<10} tokens/s: {speeds}",
              file=sys.stderr, flush=True)
    return rows


def report(args, rows: list[dict], names: list[str], expected: dict, usage: dict, device,
           dtype) -> None:
    """Print the totals and the per-category table; with --out / --plot, save them."""
    totals = summarize(rows, names)
    per_category = {c: summarize([r for r in rows if r["category"] == c], names)
                    for c in dict.fromkeys(r["category"] for r in rows)}
    result = {"device": str(device), "device_name": device_name(device),
              "machine": machine_key(device, dtype),
              "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
              "heads": args.heads, "expected_tokens_per_step": expected, "totals": totals,
              "per_category": per_category, "questions": rows,
              "steps_by_tree_size": {name: dict(sorted(c.items())) for name, c in usage.items()}}
    print(f"measured on {result['machine']}")
    for name, counts in result["steps_by_tree_size"].items():
        print(f"{name}: steps by tree size (0 = plain) {counts}")
    print(markdown(totals, expected))
    print()
    print(category_table(per_category))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    device, weight_format = device_and_format(args)
    dtype = activation_dtype(weight_format)
    folder = args.model or ensure_default_model(DEFAULT_MODEL_DIR)
    tokenizer = Tokenizer.from_folder(folder)
    questions = first_turns(args.questions, args.per_category)
    if args.generate:
        report_generate_processes(args, questions, machine_key(device, dtype))
        return
    model = decoding_model(folder, device, weight_format)
    if args.profile:
        heads = decoding_heads(args.heads[0], model)
        _, tree = decoding_tree(args.tree, heads, model)
        prompt = [{"role": "user", "content": questions[0]["prompt"]}]
        print(profile_steps(model, heads, tree, tokenizer.encode(tokenizer.chat_prompt(prompt))))
        return
    engines, expected, usage = engines_to_time(args, model, folder, device, dtype)
    rows = run_questions(engines, usage, questions, tokenizer, args.max_new_tokens)
    report(args, rows, list(engines), expected, usage, device, dtype)


if __name__ == "__main__":
    main()

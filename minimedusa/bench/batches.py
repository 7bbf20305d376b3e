"""Many prompts at once: `python -m minimedusa.bench --batch 1,4,8,16`.

The questions answered as a set, each engine in turn, round after round, alternating which goes
first: plain decoding one prompt after another (batch 1), the default Medusa one prompt after
another (the heads, the adapted trees, context candidates: generate.py --batch 1), and plain
batched decoding and Medusa in a batch at each --batch size (batch_decoding.py,
experiments/batch_medusa.py; Medusa's trees no larger than the batch allows, the Budget
choosing each step's size for the batch, plain steps among them, as it measures them, without
context candidates). Reported per engine: tokens/s over
all the answers (the best round), tokens/s a row (what batching does to one answer's speed), how
many answers equal batch-1 plain's, and the process's peak resident memory after its first
round (which runs the sizes in increasing order, each after its warm-up: the peak is that
size's) beside its KV cache's size.
Every answer is exactly --max-new-tokens long (stop ids ignored), as in the benchmark.
Beside them, on the default model where llama.cpp's tools are at hand, llama.cpp's own batched
decoding (llama-batched-bench) at the same sizes: its sequences as long as the questions' prompts
on average, prefilled together, the same number of new tokens each.
"""
import resource
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from minimedusa.batch_decoding import batch_decode
from minimedusa.bench.engines import engine
from minimedusa.bench.llama_cpp import EngineDied
from minimedusa.bench.llama_cpp_tools import batched_rates, find_tools, runs_the_model
from minimedusa.assembly.recipe import Recipe, build
from minimedusa.budget import Budget, batch_latency
from minimedusa.decoding import plain_decode
from minimedusa.experiments.batch_medusa import BatchMedusa, batch_medusa_decode, max_tree_size
from minimedusa.files.default_model import ensure_default_gguf
from minimedusa.files.outputs import write_json
from minimedusa.speed.machine import machine_key


def batch_engines(args, plain: Recipe, model, prompts: list[list[int]], usage: dict) -> dict:
    """{name: (rows a step, run() -> {prompt index: answer})}; Medusa in a batch counts its
    row-steps by tree size into usage[name]."""
    n = args.max_new_tokens
    sampling = build(plain, model).sampling
    # generate.py --batch 1's default: the heads, the adapted trees, context candidates
    medusa = engine(replace(plain, heads=args.heads[0], draft_vocab=args.draft_vocab[0],
                            context=True), model)
    engines = {"plain, one at a time": (1, lambda: {
                   i: [t for step in plain_decode(model, ids, n, sampling, set()) for t in step]
                   for i, ids in enumerate(prompts)}),
               "medusa, one at a time": (1, lambda: {i: medusa(ids, n, i)[0]
                                               for i, ids in enumerate(prompts)})}
    for B in args.batch:
        engines[f"plain, {B} at a time"] = (B, lambda B=B: dict(
            batch_decode(model, prompts, n, sampling, set(), B)))
        if B > 1:
            engines[f"medusa, {B} at a time"] = (B, batched_medusa(args, plain, model, prompts,
                                                                   B, usage))
    return engines


def batched_medusa(args, plain: Recipe, model, prompts: list[list[int]], B: int, usage: dict):
    """Medusa in a batch of B rows: the recipe's greedy draft and rule (one sequence's, without
    context candidates: a chain is one sequence's), each run from the same Budget priors (fresh
    Budgets, one for each count of rows), its steps by tree size into usage[name] (0: plain)."""
    decoding = build(replace(plain, heads=args.heads[0], draft_vocab=args.draft_vocab[0]), model)
    trees, for_rows = batch_budget(decoding.draft.trees, decoding.budget, B)
    name = f"medusa, {B} at a time"
    usage[name] = Counter()

    def run():
        budgets = []

        def fresh(rows: int):
            budgets.append(for_rows(rows))
            return budgets[-1]
        medusa = BatchMedusa(decoding.draft, fresh(B), decoding.acceptance, fresh)
        answers = dict(batch_medusa_decode(model, prompts, args.max_new_tokens, medusa, set(), B))
        for budget in budgets:
            usage[name].update(budget.used)
        return answers
    return run


def report_batches(args, recipe: Recipe, model, tokenizer, questions: list[dict], device, dtype,
                   folder: Path) -> None:
    """Time every engine on the whole set of questions, --rounds rounds; print and --out.
    recipe: plain decoding's, of the model loaded; folder: the model's (llama.cpp runs beside
    the default model only)."""
    prompts = [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q["prompt"]}]))
               for q in questions]
    usage = {}
    engines = batch_engines(args, recipe, model, prompts, usage)
    times = {name: [] for name in engines}
    answers, peak = {}, {}
    for r in range(args.rounds):
        for name in list(engines)[::1 if r % 2 == 0 else -1]:
            if r == 0:  # a warm-up, uncounted (kernels, the Budget's prior), just before
                engines[name][1]()
            start = time.perf_counter()
            answers[name] = engines[name][1]()
            times[name].append(time.perf_counter() - start)
            if r == 0:  # the first round runs the sizes in increasing order
                peak[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB
            rate = sum(map(len, answers[name].values())) / times[name][-1]
            print(f"round {r + 1}: {name} {rate:.1f} tokens/s", file=sys.stderr, flush=True)
    tokens = len(prompts) * args.max_new_tokens
    reference = answers["plain, one at a time"]
    result = {"machine": machine_key(device, dtype), "questions": len(prompts),
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "engines": {}}
    print("| engine | tokens/s | tokens/s a row | vs plain one at a time | identical | KV cache MB "
          "| peak RSS MB |\n|---|---|---|---|---|---|---|")
    base = tokens / min(times["plain, one at a time"])
    for name, (rows, _) in engines.items():
        rate = tokens / min(times[name])  # the best round: these VMs' noise only slows
        same = sum(answers[name][i] == reference[i] for i in reference)
        cache = kv_cache_mb(model, rows, max(map(len, prompts)) + args.max_new_tokens)
        result["engines"][name] = {"rows": rows, "tokens_per_s": round(rate, 1),
                                   "tokens_per_s_a_row": round(rate / rows, 1),
                                   "speedup": round(rate / base, 3), "identical": same,
                                   "seconds": [round(t, 3) for t in times[name]],
                                   "kv_cache_mb": cache, "peak_rss_mb": round(peak[name], 1)}
        print(f"| {name} | {rate:.1f} | {rate / rows:.1f} | {rate / base:.2f}x | "
              f"{same}/{len(reference)} | {cache} | {peak[name]:.0f} |")
    for name, used in usage.items():  # every round's row-steps (each row's share of a step)
        result["engines"][name]["row_steps_by_tree_size"] = dict(sorted(used.items()))
        print(f"{name}: row-steps by tree size (0 = plain) {dict(sorted(used.items()))}")
    report_llama_cpp(args, folder, prompts, base, result)
    if args.out:
        write_json(args.out, result)


def report_llama_cpp(args, folder: Path, prompts: list[list[int]], base: float,
                     result: dict) -> None:
    """Print llama.cpp's batched rates (llama_cpp_batches), where it runs, against plain one
    at a time's `base` tokens/s, and keep them in result; a llama.cpp that fails costs a line
    on stderr, not the engines' results."""
    prompt_len = round(sum(map(len, prompts)) / len(prompts))  # its sequences' prompts
    try:
        llama_cpp = llama_cpp_batches(args, folder, prompt_len)
    except EngineDied as e:
        print(f"llama.cpp's batched decoding left out: {e}", file=sys.stderr)
        return
    if llama_cpp is None:
        return
    result["llama-batched-bench"] = {"prompt_tokens": prompt_len, "by_batch": llama_cpp}
    for B, rates in llama_cpp.items():
        print(f"llama.cpp Q4_1 (llama-batched-bench), {B} at a time: {rates['tokens_per_s']} "
              f"tokens/s ({rates['decoding_tokens_per_s']} decoding alone), "
              f"{rates['tokens_per_s'] / base:.2f}x plain one at a time")


def llama_cpp_batches(args, folder: Path, prompt_len: int) -> dict | None:
    """llama.cpp's own batched decoding at 1 and each --batch size (batched_rates), prompts of
    prompt_len tokens; None where it cannot run: --no-llama-cpp, a model in `folder` other than
    the default (runs_the_model), or its tools not at hand."""
    if args.no_llama_cpp or not runs_the_model(folder):
        return None
    tools = find_tools(args.llama_cpp)
    if tools is None:
        return None
    return batched_rates(tools, ensure_default_gguf(), args.threads, prompt_len,
                         args.max_new_tokens, sorted({1, *args.batch}))


def kv_cache_mb(model, rows: int, capacity: int) -> float:
    """The keys and values a cache of `rows` sequences of `capacity` slots holds, in MB."""
    cfg, dtype = model.config, model.embed.weight.dtype
    size = 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * capacity * cfg.head_dim
    return round(size * torch.finfo(dtype).bits / 8 / 1e6, 1)


def batch_budget(trees: dict, budget: Budget, batch_size: int):
    """(trees by size, for_rows(r): a fresh Budget for a step of r rows) for Medusa in a batch
    (batch_medusa.batch_medusa_decode: for_rows(batch_size) its budget, for_rows its fewer):
    one sequence's trees and Budget (the recipe's), its sizes cut to the batch's largest tree
    (max_tree_size). A Budget for r rows takes batch-1's latency priors read by rows
    (budget.batch_latency: a step of n nodes is r (n + 1) rows), rescales them by its plain
    steps, timed first, and times each tree size it tries; its rows record a step each."""
    sizes = [n for n in budget.sizes if n <= max_tree_size(batch_size)]

    def for_rows(rows: int) -> Budget:
        latency = batch_latency(budget.latency, rows)
        return Budget(sizes, {n: budget.expected[n] for n in sizes if n in budget.expected},
                      {n: latency[n] for n in sizes}, rows=rows)
    return {n: trees[n] for n in sizes if n}, for_rows

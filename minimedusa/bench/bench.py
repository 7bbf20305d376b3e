"""Benchmark: decoding speed on MT-Bench first turns, engines interleaved in one process.

MT-Bench (Zheng et al. 2023: FastChat's question.jsonl, 80 questions in 8 categories) is other
authors' text and is not shipped: give it with --questions, or put it at ../shared/data/ beside
the repository. Without it the benchmark times the project's own held-out seed prompts instead.

Engines (engines.py): this project's plain decoding (and at --temperature plain sampling);
Medusa with the given heads, verified greedily and (at --temperature) by typical acceptance, by
rejection sampling and by speculative sampling of drawn candidates, its tree's size
adapted step by step as generate.py does (budget.py; the steps run at each size are reported),
or with a fixed --tree; optionally Medusa with trees of several sizes grown from the heads'
calibration (--sizes, the paper's Fig. 4); the same in other weight formats (--formats); and,
where they are installed, the transformers library's `generate` on the same weights (the
paper's baseline) and llama.cpp on the GGUF file the default model came from. Reported in the
paper's terms (section 7), per category and overall: acceleration rate (tokens per step),
overhead (step latency / plain step latency), speedup (tokens/s / plain tokens/s); and how close
each step is to the memory's limit: the bytes of weights it reads, the GB/s that implies, and
what the machine streams (memory_bandwidth.py). Every engine produces exactly --max-new-tokens
tokens per question (EOS does not stop it) so that tokens/s compare like for like; the engines
alternate question by question, and a warm-up run of each is excluded, so machine noise hits
all of them alike. Report ratios from one run, not absolute numbers from different runs.

    python -m minimedusa.bench --quick                   # smoke test, < 3 minutes on a CPU
    python -m minimedusa.bench --out bench.json --plot bench.png
    python -m minimedusa.bench --heads untrained-shared:4 --tree cpu_8 --no-sampling
    python -m minimedusa.bench --per-category 1 --no-sampling --formats float32,int8
"""
import sys

import torch

from minimedusa.bench.batches import report_batches
from minimedusa.bench.bench_flags import parse_args
from minimedusa.bench.draft_engines import draft_engines
from minimedusa.bench.engines import Engines, engines_to_time, plain_of
from minimedusa.bench.llama_cpp import EngineDied
from minimedusa.bench.processes import report_generate_processes
from minimedusa.bench.questions import questions_to_time
from minimedusa.bench.reference_text import reference_answers, same_as_reference_of, verdict
from minimedusa.bench.report import category_table, markdown, plot, summarize
from minimedusa.files.outputs import check_writable, write_json
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.assembly.load import device_and_format
from minimedusa.files.default_model import DEFAULT_MODEL_DIR, ensure_default_model
from minimedusa.speed.machine import device_name, machine_key
from minimedusa.errors import UserError, entry_point
from minimedusa.speed.memory_bandwidth import implied_bandwidth, streaming_bandwidth
from minimedusa.bench.step_profile import report_profile
from minimedusa.files.tokenizer import Tokenizer
from minimedusa.speed.weight_formats import dtype_format


def warm_up(engines: Engines, tokenizer) -> None:
    """One short excluded run of each engine: compiles, caches, and llama.cpp's first
    multi-token evaluation, where a native crash would come (it is dropped, one line)."""
    warm = question_ids(tokenizer, {"prompt": "Hi"})
    for name, run in list(engines.run.items()):
        try:
            run(warm, 8, 0)
        except EngineDied as died:
            left_out(engines, name, died, [])
    for counts in [*engines.usage.values(), *engines.origins.values()]:  # the warm-up's
        counts.clear()  # steps are not the benchmark's


def left_out(engines: Engines, name: str, died: EngineDied, rows: list[dict]) -> None:
    """An engine whose process died leaves the comparison, its rows so far too, with one line;
    every other engine goes on."""
    print(f"{name} is left out of the comparison: {died}", file=sys.stderr, flush=True)
    engines.drop(name)
    for row in rows:
        row.pop(name, None)


def question_ids(tokenizer, question: dict) -> list[int]:
    message = {"role": "user", "content": question["prompt"]}
    return tokenizer.encode(tokenizer.chat_prompt([message]))


def run_questions(engines: Engines, questions: list[dict], tokenizer, max_new_tokens: int,
                  same_as_reference=None) -> list[dict]:
    """Every engine on every question, alternating who goes first, after an excluded warm-up:
    one row per question with each engine's tokens, seconds, steps and sameness to plain
    decoding in its own weight format, and where given to the reference's text
    (same_as_reference(name, question index, answer): True, False, or None, not checked)."""
    warm_up(engines, tokenizer)
    rows = []
    for i, q in enumerate(questions):
        ids = question_ids(tokenizer, q)
        row, outputs = {"id": q["id"], "category": q["category"]}, {}
        for name in list(engines.run)[::1 if i % 2 == 0 else -1]:  # alternate who goes first
            try:
                outputs[name], seconds, steps = engines.run[name](ids, max_new_tokens, i)
            except EngineDied as died:
                left_out(engines, name, died, rows)
                continue
            row[name] = {"tokens": len(outputs[name]), "seconds": round(seconds, 4),
                         "steps": steps}
        names = list(engines.run)  # those still running
        for name in names:
            row[name]["same_as_plain"] = outputs[name] == outputs[plain_of(name)]
            if same_as_reference is not None:
                row[name]["same_as_reference"] = same_as_reference(name, i, outputs[name])
        rows.append(row)
        speeds = ", ".join(f"{n} {row[n]['tokens'] / row[n]['seconds']:.1f}" for n in names)
        print(f"[{i + 1}/{len(questions)}] {q['category']:<10} tokens/s: {speeds}",
              file=sys.stderr, flush=True)
    return rows


def add_bandwidth(totals: dict, step_bytes: dict) -> None:
    """Each engine's bytes of weights a step reads, and the GB/s its steps imply."""
    for name, t in totals.items():
        if name in step_bytes:
            t["weight_bytes"] = step_bytes[name]
            t["gb_s"] = implied_bandwidth(step_bytes[name], t["step_ms"])


def origin_shares(counts: dict, total: dict) -> str:
    """Tokens a step by origin, e.g. "head 1 0.33, head 2 0.10, context 0.61, model 1.00": what
    the heads, the context candidates and the model's own token each add to a step."""
    said = {origin: f"head {origin}" if origin.isdigit() else origin for origin in counts}
    return ", ".join(f"{said[o]} {n / total['steps']:.3f}" for o, n in counts.items())


def report(args, rows: list[dict], engines: Engines, memory: dict, device, dtype) -> None:
    """Print the totals and the per-category table; with --out / --plot, save them."""
    names = list(engines.run)
    totals = summarize(rows, names, args.reference)
    add_bandwidth(totals, engines.step_bytes)
    per_category = {c: summarize([r for r in rows if r["category"] == c], names, args.reference)
                    for c in dict.fromkeys(r["category"] for r in rows)}
    result = {"device": str(device), "device_name": device_name(device),
              "machine": machine_key(device, dtype),
              "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
              "heads": args.heads, "memory_bandwidth": memory,
              "expected_tokens_per_step": engines.expected, "totals": totals,
              "per_category": per_category, "questions": rows,
              "steps_by_tree_size": {name: dict(sorted(c.items()))
                                     for name, c in engines.usage.items()},
              "tokens_by_origin": {name: {str(k): n for k, n in sorted(c.items(), key=str)}
                                   for name, c in engines.origins.items()}}
    if any("same_as_reference" in t for t in totals.values()):
        result["reference_check"] = verdict(totals, device)
        print(result["reference_check"])
    print(f"measured on {result['machine']}; memory streams at {memory['read_gb_s']} GB/s read, "
          f"{memory['copy_gb_s']} GB/s copy (read + write)")
    for name, counts in result["steps_by_tree_size"].items():
        print(f"{name}: steps by tree size (0 = plain) {counts}")
    for name, counts in result["tokens_by_origin"].items():
        print(f"{name}: tokens a step by what guessed them {origin_shares(counts, totals[name])}")
    print(markdown(totals, engines.expected))
    print()
    print(category_table(per_category))
    if args.out:
        write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            check_writable(path, flag)  # before minutes of work
    questions = questions_to_time(args.questions, args.per_category)  # before the loading
    folder = args.model or ensure_default_model(DEFAULT_MODEL_DIR)
    device, fmt = device_and_format(args, folder)
    dtype = fmt.activation_dtype()
    tokenizer = Tokenizer.from_folder(folder)
    if args.generate:
        report_generate_processes(args, questions, machine_key(device, dtype), tokenizer, folder)
        return
    check = None
    if not (args.batch or args.profile or args.no_reference):  # before the run's model loads
        prompts = [question_ids(tokenizer, q) for q in questions]
        references = reference_answers(folder, device, prompts, args.max_new_tokens)
        check = same_as_reference_of(references, fmt, dtype_format(dtype), device)
    recipe = Recipe(folder=folder, device=device, weight_format=fmt,
                    compile=args.compile, seed=0)
    model, step = decoding_model(recipe)
    print(f"decoding step: {step}", file=sys.stderr)
    if args.batch:
        return report_batches(args, recipe, model, tokenizer, questions, device, dtype, folder)
    if args.profile:
        return report_profile(args, recipe, model, tokenizer, questions[0])
    engines = engines_to_time(args, recipe, model, tokenizer)
    if args.draft is not None:
        draft_engines(args, folder, device, engines)
    if args.reference not in engines.run:
        raise UserError(f"--reference {args.reference!r} is not one of the engines: "
                        f"{', '.join(engines.run)}")
    memory = streaming_bandwidth(device)  # before the questions: the machine's limit, alone
    rows = run_questions(engines, questions, tokenizer, args.max_new_tokens, check)
    report(args, rows, engines, memory, device, dtype)


if __name__ == "__main__":
    main()

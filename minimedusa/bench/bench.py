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
from pathlib import Path

import torch

from minimedusa.bench.batches import report_batches
from minimedusa.bench.engines import Engines, engines_to_time, plain_of
from minimedusa.bench.llama_cpp import EngineDied
from minimedusa.bench.processes import report_generate_processes
from minimedusa.bench.questions import questions_to_time
from minimedusa.bench.report import category_table, markdown, plot, summarize
from minimedusa.files.heads_files import read_calibration
from minimedusa.files.outputs import check_writable, write_json
from minimedusa.cli.flags import (Parser, add_compile_argument, add_device_arguments,
                                  add_quantize_argument, format_list, non_negative,
                                  non_negative_int, positive_int, size_list)
from minimedusa.cli.draft_heads import decoding_heads
from minimedusa.cli.load import decoding_model, device_and_format
from minimedusa.cli.trees import decoding_tree
from minimedusa.files.default_model import (DEFAULT_HEADS_DIR, DEFAULT_MODEL_DIR,
                                            ensure_default_model)
from minimedusa.speed.machine import device_name, machine_key
from minimedusa.errors import UserError, entry_point
from minimedusa.speed.memory_bandwidth import implied_bandwidth, streaming_bandwidth
from minimedusa.bench.step_profile import (draft_times, forward_times, product_times,
                                           profile_steps, step_times)
from minimedusa.tokenizer import Tokenizer
from minimedusa.speed.weight_formats import FORMATS, activation_dtype

def add_engine_flags(p) -> None:
    """What to time: the questions, the heads, their trees and acceptance rules."""
    p.add_argument("--per-category", type=positive_int, default=2,
                   help="questions per MT-Bench category, 8 categories (default: %(default)s; "
                   "10 = all 80), or held-out seed prompts per category without MT-Bench")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="tokens generated per question, EOS ignored (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 question per category, 32 tokens, no transformers, "
                   "no --sizes (under 3 minutes on a 2-core CPU)")
    p.add_argument("--heads", action="append", default=None,
                   help="heads to time: a folder, untrained:K, untrained-shared:K or "
                   "untrained-hydra:K; "
                   "repeat to compare several (default: the default model's trained heads)")
    p.add_argument("--draft-vocab", type=non_negative_int, nargs="+", default=[None], metavar="N",
                   help="the heads rank only their N most frequent tokens (0: the whole "
                   "vocabulary; several values: one engine each, --profile the first; "
                   "default: the heads' own draft_vocab_size, if set, at most 2048 on a CPU)")
    p.add_argument("--tree", default=None,
                   help="a fixed candidate tree for the Medusa engines (default: as "
                   "generate.py, the tree's size adapted step by step on this machine)")
    p.add_argument("--sizes", default="",
                   help="also time greedy Medusa with the best tree of each of these sizes, "
                   "grown from the heads' calibration, e.g. 1,2,4,8,16,32,64 (tokens/s "
                   "against tree size, the paper's Fig. 4), with context candidates as "
                   "--context says")
    p.add_argument("--ranked", default="",
                   help="also time greedy Medusa with confidence-ranked trees of these sizes "
                   "(ranked_tree.py), e.g. 4,8,16, beside --sizes' static trees")
    p.add_argument("--ranked-adapted", action="store_true",
                   help="also time greedy Medusa with confidence-ranked trees whose size the "
                   "budget adapts step by step (generate.py --tree ranked)")



def add_engine_variants(p) -> None:
    """Which engines besides plain and Medusa greedy: sampling, baselines, formats, eager."""
    p.add_argument("--temperature", type=non_negative, default=0.7,
                   help="temperature of the sampling engines: plain sampling, and Medusa's "
                   "typical acceptance, rejection sampling and speculative sampling of drawn "
                   "candidates, top-p 1 (default: %(default)s, the paper's)")
    p.add_argument("--no-sampling", action="store_true",
                   help="time greedy decoding only (no sampling engines)")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the transformers baseline even if the library is installed")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp even where its tools or llama-cpp-python are at hand "
                   "(it runs the default model's Q4_1 GGUF file, fetched into weights/ on first "
                   "use)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                   help="llama.cpp's own tools (llama-completion, llama-bench), built: in DIR "
                   "or DIR/build/bin (default: on PATH, if there); the Python binding runs "
                   "beside them where installed")
    p.add_argument("--context", choices=("on", "off", "both"), default="on",
                   help="context candidates in the adapted trees and --sizes' trees (branches "
                   "read from the prompt and the answer so far, context_candidates.py): on "
                   "(default, as generate.py), off, or both: greedy also without them, as "
                   "'NAME (no context)'")
    p.add_argument("--eager-too", action="store_true",
                   help="also time every plain and greedy Medusa engine with its decoding step "
                   "eager, as 'NAME (eager)', beside the compiled one (see --compile)")
    p.add_argument("--reference", default="plain",
                   help="the engine that overhead and speedup are relative to (default: "
                   "%(default)s; e.g. '[float32] plain (eager)' with --formats float32 "
                   "--eager-too)")
    p.add_argument("--formats", type=format_list(FORMATS), default=[],
                   help="also time plain decoding and Medusa greedy with the model in these "
                   f"weight formats ({', '.join(FORMATS)}), e.g. float32,int8: engines named "
                   "'[int8] plain' and so on, each checked against its own format's plain "
                   "decoding")


def parse_args(argv=None):
    p = Parser(description="Decoding speed on MT-Bench first turns: this project's plain "
               "decoding, Medusa (greedy, typical and rejection sampling) and the transformers "
               "library's generate, interleaved question by question in one process.")
    p.prog = "python -m minimedusa.bench"  # as typed (else argparse names the file)
    add_engine_flags(p)
    add_engine_variants(p)
    add_device_arguments(p, threads_default=2)  # 2: this project's CI machine
    add_quantize_argument(p)
    add_compile_argument(p)
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama folder (default: the default model in weights/)")
    p.add_argument("--questions", type=Path, default=None,
                   help="MT-Bench's questions, JSONL (FastChat's question.jsonl; default: "
                   "../shared/data/mt_bench_questions.jsonl beside the repository if there, "
                   "else the project's held-out seed prompts)")
    add_mode_flags(p)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None,
                   help="write a PNG plot here (needs matplotlib, which is optional)")
    args = p.parse_args(argv)
    if args.quick:
        args.per_category, args.max_new_tokens, args.no_transformers = 1, 32, True
        args.no_llama_cpp = True
        args.sizes = args.ranked = ""
    args.sizes = [int(n) for n in args.sizes.split(",") if n]
    args.ranked = [int(n) for n in args.ranked.split(",") if n]
    args.temperature = 0.0 if args.no_sampling else args.temperature
    if args.heads is None:
        if args.model is not None or not DEFAULT_HEADS_DIR.is_dir():
            p.error("no --heads given and no trained heads for the default model in weights/")
        args.heads = [str(DEFAULT_HEADS_DIR)]
    return args


def add_mode_flags(p) -> None:
    """The other things the bench can do instead: generate.py processes, or a profile."""
    p.add_argument("--generate", action="store_true",
                   help="instead of the in-process benchmark, run generate.py once per question "
                   "and round, its default flags against --baseline (as a user runs it); "
                   "--model, --device, --dtype, --threads, --quantize and --compile/--no-compile "
                   "are passed on to both")
    p.add_argument("--baseline-flags", default="",
                   help="with --generate: more generate.py flags for the --baseline processes, "
                   "e.g. \"--dtype float32 --no-compile\" (today's float32 plain decoding)")
    p.add_argument("--flags", default="",
                   help="with --generate: more generate.py flags for every process, e.g. "
                   "\"--temperature 0.7 --seed 1\" (sampling: the answers then differ by their "
                   "draws, so only greedy runs count identical answers)")
    p.add_argument("--default-flags", default="",
                   help="with --generate: more generate.py flags for the default's processes "
                   "only, e.g. \"--acceptance typical\"")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="with --generate or --batch: passes over the questions (default: "
                   "%(default)s)")
    p.add_argument("--batch", type=size_list, default=[], metavar="B,B,...",
                   help="instead of the benchmark, the questions answered as a set: plain and "
                   "Medusa one prompt after another, and plain batched decoding of B prompts at "
                   "a time for each B (e.g. 1,4,8,16), and Medusa in a batch: tokens/s in all "
                   "and a row, identical answers, peak memory; beside them llama.cpp's "
                   "llama-batched-bench where it is built (bench/batches.py)")
    p.add_argument("--profile", action="store_true",
                   help="instead of the benchmark, profile a few plain and Medusa greedy steps on "
                   "the first question (torch.profiler, operators by their own time), then time "
                   "a forward (after 256 and 1,536 cached tokens) and the products alone at 1 to "
                   "17 rows, and a whole step at each tree size grown from the heads' "
                   "calibration against a plain step (after 256 and 1,536 cached tokens)")


def warm_up(engines: Engines, tokenizer) -> None:
    """One short excluded run of each engine: compiles, caches, and llama.cpp's first
    multi-token evaluation, where a native crash would come (it is dropped, one line)."""
    warm = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    for name, run in list(engines.run.items()):
        try:
            run(warm, 8, 0)
        except EngineDied as died:
            left_out(engines, name, died, [])
    for counts in engines.usage.values():  # the warm-up's steps are not the benchmark's
        counts.clear()


def left_out(engines: Engines, name: str, died: EngineDied, rows: list[dict]) -> None:
    """An engine whose process died leaves the comparison, its rows so far too, with one line;
    every other engine goes on."""
    print(f"{name} is left out of the comparison: {died}", file=sys.stderr, flush=True)
    engines.drop(name)
    for row in rows:
        row.pop(name, None)


def run_questions(engines: Engines, questions: list[dict], tokenizer,
                  max_new_tokens: int) -> list[dict]:
    """Every engine on every question, alternating who goes first, after an excluded warm-up:
    one row per question with each engine's tokens, seconds, steps and sameness to plain
    decoding in its own weight format."""
    warm_up(engines, tokenizer)
    rows = []
    for i, q in enumerate(questions):
        ids = tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q["prompt"]}]))
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
                                     for name, c in engines.usage.items()}}
    print(f"measured on {result['machine']}; memory streams at {memory['read_gb_s']} GB/s read, "
          f"{memory['copy_gb_s']} GB/s copy (read + write)")
    for name, counts in result["steps_by_tree_size"].items():
        print(f"{name}: steps by tree size (0 = plain) {counts}")
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
    device, weight_format = device_and_format(args, folder)
    dtype = activation_dtype(weight_format)
    tokenizer = Tokenizer.from_folder(folder)
    if args.generate:
        report_generate_processes(args, questions, machine_key(device, dtype), tokenizer, folder)
        return
    model, step = decoding_model(folder, device, weight_format, args.compile)
    print(f"decoding step: {step}", file=sys.stderr)
    if args.batch:
        return report_batches(args, model, tokenizer, questions, device, dtype, folder)
    if args.profile:
        heads = decoding_heads(args.heads[0], model, args.draft_vocab[0])
        _, tree = decoding_tree(args.tree, heads, model)
        prompt = [{"role": "user", "content": questions[0]["prompt"]}]
        print(profile_steps(model, heads, tree, tokenizer.encode(tokenizer.chat_prompt(prompt))))
        print(forward_times(model))
        print(forward_times(model, cached=1536))  # how a row's cost grows with the context
        print(product_times(model))
        accuracy = read_calibration(Path(args.heads[0])) if Path(args.heads[0]).is_dir() else None
        if accuracy is None:
            print("steps by tree size: the heads have no calibration.json to grow trees from")
        else:
            for cached in (256, 1536):  # how a row's cost grows with the context
                print(step_times(model, heads, accuracy, cached))
            print(draft_times(model, heads, accuracy))
        return
    engines = engines_to_time(args, model, folder, device, dtype, tokenizer)
    if args.reference not in engines.run:
        raise UserError(f"--reference {args.reference!r} is not one of the engines: "
                        f"{', '.join(engines.run)}")
    memory = streaming_bandwidth(device)  # before the questions: the machine's limit, alone
    rows = run_questions(engines, questions, tokenizer, args.max_new_tokens)
    report(args, rows, engines, memory, device, dtype)


if __name__ == "__main__":
    main()

"""bench's flags: what to time (the questions, the heads, their trees and rules), which engines
besides plain and Medusa greedy (sampling, other formats, eager steps, llama.cpp, transformers),
and the other things it can do instead (generate.py processes, batches, a profile)."""
from pathlib import Path

from minimedusa.cli.flags import (Parser, add_compile_argument, add_device_arguments,
                                  add_quantize_argument, format_list, non_negative,
                                  non_negative_int, positive_int, size_list)
from minimedusa.files.default_model import DEFAULT_HEADS_DIR
from minimedusa.speed.weight_formats import FORMATS


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
                   "repeat to compare several (with --generate: a default process for each, "
                   "interleaved) (default: the default model's trained heads)")
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
                   "(draft.RankedDraft), e.g. 4,8,16, beside --sizes' static trees")
    p.add_argument("--ranked-adapted", action="store_true",
                   help="also time greedy Medusa with confidence-ranked trees whose size the "
                   "budget adapts step by step (generate.py --tree ranked)")



def add_engine_variants(p) -> None:
    """Which engines besides plain and Medusa greedy: sampling, baselines, eager."""
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
                   "(default, as generate.py), off, or both: every rule also without "
                   "them, as 'NAME (no context)'")
    p.add_argument("--eager-too", action="store_true",
                   help="also time every plain and greedy Medusa engine with its decoding step "
                   "eager, as 'NAME (eager)', beside the compiled one (see --compile)")


def add_checks_and_models(p) -> None:
    """The reference every greedy engine is checked against, and the other models timed: a
    draft model, weight formats."""
    p.add_argument("--no-reference", action="store_true",
                   help="skip the reference's text (the model as read, eager: float32 on a "
                   "CPU, bfloat16 on CUDA, decoded once before the run), and with it the "
                   "column 'same as the reference': each greedy engine's answers parting from "
                   "it only where its top two tokens were within the format's bound "
                   "(speed/reference_check.py)")
    p.add_argument("--reference", default="plain",
                   help="the engine that overhead and speedup are relative to (default: "
                   "%(default)s; e.g. '[float32] plain (eager)' with --formats float32 "
                   "--eager-too)")
    p.add_argument("--draft", default=None, metavar="FORMAT_OR_DIR",
                   help="also time speculative decoding with a draft model (generate.py "
                   "--draft): the model in float32 verifying the drafts of the model rounded "
                   "to FORMAT (int4, w4a8, int8) or of the model in DIR, beside float32 plain "
                   "decoding: '[float32] plain', '[float32] drafted by int4' (and at "
                   "--temperature, sampled), and the rounded draft decoding with the first "
                   "--heads: '[float32] drafted by int4 with heads'")
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
    add_checks_and_models(p)
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

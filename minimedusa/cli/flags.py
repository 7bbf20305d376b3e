"""Command-line flags: the parser that ends bad input in one line, the value checks every
numeric flag goes through, and the flag groups that several commands share (device, weight
format, compiled step, context candidates, draft vocabulary). What the flags then load is
load.py's.
"""
import argparse
import os


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


THREADS_PER_CORE = 4  # more only queue behind each other (and thousands exhaust the machine)


def max_threads() -> int:
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def thread_count(text: str) -> int:
    value = positive_int(text)
    if value > max_threads():
        raise argparse.ArgumentTypeError(f"at most {max_threads()} on this machine "
                                         f"({THREADS_PER_CORE} a core), got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


MAX_SEED = 2**63 - 1  # torch's generators take 64 bits; the draft's own draws use seed + 1


def seed_int(text: str) -> int:
    """A --seed: an integer in 0..MAX_SEED (a larger one overflowed torch's generator)."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..2**63 - 1, got {text[:40]}")
    return value


def format_list(choices: tuple[str, ...]):
    """An argparse type for a list of weight formats, "a,b" -> ["a", "b"], each of `choices`."""
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown format {unknown[0]!r} (choose from "
                                             f"{', '.join(choices)})")
        return names
    return parse


def positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def dropout(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_device_arguments(parser, threads_default: int | None = None) -> None:
    """--device, --dtype and --threads, the same in every command line."""
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (default: float32 on CPU, "
                        "bfloat16 on CUDA; decoding on a CPU, for a model whose weights came "
                        "from a 4-bit file, as the default model's: w4a8 where the CPU has AVX2 "
                        "and FMA but no avx512_bf16, int4 where it has avx512_bf16 or AMX; for "
                        "other models bfloat16 where the CPU multiplies it natively, else "
                        "float32), float32, bfloat16, float16")
    default = threads_default or "torch's choice, one per core"
    parser.add_argument("--threads", type=thread_count, default=threads_default,
                        help=f"CPU threads for torch, at most {THREADS_PER_CORE} a core "
                        f"({max_threads()} here; default: {default})")


def add_quantize_argument(parser) -> None:
    parser.add_argument("--quantize", choices=("none", "int8", "int4", "w4a8"), default="none",
                        help="int4: the blocks' weights in 4 bits, a scale and a minimum per 32 "
                        "(as the GGUF's Q4_1), the heads' layers rounded to 8-bit groups where "
                        "group_kernel.c multiplies, the LM head in 8-bit groups (as the GGUF's "
                        "Q8_0) if its weights already lie on them or the model is of real size "
                        "(0.3B weights in its blocks or more: rounded to them), else as stored; "
                        "lossless for a model whose weights came from such files. "
                        "w4a8: int4's weights times 8-bit activations (a scale per row and "
                        "group of 32, as llama.cpp's Q4_1 decoding) in the attention's output "
                        "and the MLP's input products, 16-bit ones in the other two: integer "
                        "products, cheaper steps and tree rows, answers a little further from "
                        "float32's (top-1 agreement 99.0%%; llama.cpp's 97.8%%). int8: "
                        "weight-only int8 (a scale per output channel) for every linear layer, "
                        "the LM head and the heads' included. All run on the CPU (--device auto "
                        "picks it, also where a GPU is present), bfloat16 activations, but int4 "
                        "and w4a8 float32 where the CPU has AVX2 and no avx512_bf16 "
                        "(weight_formats.py). For a model of real size the 4-bit formats are "
                        "the fastest on a CPU where group_kernel.c multiplies, in about 0.6 "
                        "bytes a weight (bfloat16: 2; the summary line gives each run's size), "
                        "the faster of them w4a8 on a CPU with AVX2 and no avx512_bf16 (its "
                        "integer products beat AVX2's float ones: 1.2-1.3x int4 on a 1.1B "
                        "model), else int4; a run keeps the rounded weights for the next (the "
                        "cache folder's weights/). Default: none, the weights in --dtype (whose "
                        "auto picks that 4-bit format for a model from a 4-bit file)")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the decoding step with torch.compile (compiled_step.py): "
                        "~20 s the first time on a machine, a few seconds in later runs "
                        "(cached on disk), then faster steps. Default: on a CPU where a C++ "
                        "compiler works, except int4 and w4a8 where group_kernel.c multiplies "
                        "(AVX2 or AVX-512 BF16 CPUs), whose blocks are each one C++ call "
                        "(fused_block.py, faster, nothing to compile); --compile compiles those "
                        "too. On CUDA the step and the heads' draft run in CUDA graphs "
                        "(cuda_graphs.py), of compiled blocks where torch.compile works there "
                        "(~15 s of compiling and capture the first time on an H200, less once "
                        "inductor's cache holds the kernels; else of the eager blocks, ~1 s of "
                        "capture). --no-compile: eager, the reading path")


def add_context_argument(parser) -> None:
    parser.add_argument("--context", action=argparse.BooleanOptionalAction, default=True,
                        help="context candidates: each step's tree also holds a branch read from "
                        "the prompt and the answer so far, where their last tokens occurred "
                        "before (context_candidates.py; output unchanged). With the adapted "
                        "trees only, not with a fixed --tree (default: on)")


def add_draft_vocab_argument(parser) -> None:
    parser.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                        help="the heads rank only the N tokens most frequent in their training "
                        "answers, reading N rows of the LM head instead of all (output "
                        "unchanged: the model still verifies over the whole vocabulary); 0 = "
                        "the whole vocabulary (default: the heads' draft_vocab_size, if their "
                        "config.json sets one, at most 2048 on a CPU)")


def size_list(text: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8], each a positive int, increasing (argparse's type)."""
    sizes = [positive_int(part) for part in text.split(",") if part.strip()]
    if not sizes or sizes != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"expected increasing sizes like 1,4,8, got {text!r}")
    return sizes


def add_batch_argument(parser) -> None:
    parser.add_argument("--batch", type=positive_int, default=None, metavar="N",
                        help="with --prompts: answer N prompts at once, plain decoding of N rows "
                        "a step (continuous batching: a row that finishes takes the next "
                        "prompt). All the answers come several times sooner, each one no "
                        "sooner than alone (a step of N rows takes longer than one of a row), "
                        "and each is the answer --batch 1 gives (greedy: token for token). 1: "
                        "one prompt after another, with Medusa's heads. Default: a size for "
                        "this machine (speed/defaults.py), said in the summary")

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
    parser.add_argument("--dtype", default="auto", help="auto (default: the machine's format, "
                        "README's Flags), float32, bfloat16, float16")
    default = threads_default or "torch's choice, one per core"
    parser.add_argument("--threads", type=thread_count, default=threads_default,
                        help=f"CPU threads for torch, at most {THREADS_PER_CORE} a core "
                        f"({max_threads()} here; default: {default})")


def add_quantize_argument(parser) -> None:
    parser.add_argument("--quantize", choices=("none", "int8", "int4", "w4a8"), default="none",
                        help="round the weights: int4 (Q4_1's groups), w4a8 (int4 times 8-bit "
                        "activations), int8; on the CPU (default: none; README's Flags)")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the decoding step (default: where faster: fused C++ "
                        "blocks for int4/w4a8, CUDA graphs on a GPU); --no-compile: eager")


def add_context_argument(parser) -> None:
    parser.add_argument("--context", action=argparse.BooleanOptionalAction, default=True,
                        help="context candidates: a branch copied from the text so far joins "
                        "the adapted trees (default: on)")


def add_draft_vocab_argument(parser) -> None:
    parser.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                        help="the heads rank only their N most frequent tokens; 0: all "
                        "(default: the heads' own, at most 2048 on a CPU)")


def size_list(text: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8], each a positive int, increasing (argparse's type)."""
    sizes = [positive_int(part) for part in text.split(",") if part.strip()]
    if not sizes or sizes != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"expected increasing sizes like 1,4,8, got {text!r}")
    return sizes


def add_batch_argument(parser) -> None:
    parser.add_argument("--batch", type=positive_int, default=None, metavar="N",
                        help="with --prompts: N prompts at once, plain decoding (default: the "
                        "machine's size); 1: one at a time, with the heads")

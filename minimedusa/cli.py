"""From command-line flags to what decoding needs: the device, the model, the heads, the tree (a
fixed --tree, or by default budget.py's nested trees and the Budget that picks among them) and
the acceptance rule, decided here once for generate.py, bench and tree_search alike.

Also the named trees: the paper's 63-node tree and small ones for a CPU, and the progress bar of
the long commands.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from minimedusa import acceptance
from minimedusa.budget import (SIZES, Budget, expected_length, grow_tree, machine_latency,
                               nested_trees, read_calibration)
from minimedusa.attention_kernel import kernel_problem
from minimedusa.compiled_step import compile_blocks, compiler_problem, warm_up
from minimedusa.device import pick_device, pick_dtype
from minimedusa.errors import UserError
from minimedusa.heads import DraftVocabulary, MedusaHeads
from minimedusa.hydra import HydraHeads
from minimedusa.model import Llama
from minimedusa.tree import MedusaTree, TreeError, build_tree, dense_tree
from minimedusa.heads_files import DRAFT_VOCAB_FILE, HeadsError, load_heads, read_draft_vocab
from minimedusa.weight_formats import (DTYPE_FORMATS, apply_format, bf16_is_native, default_format,
                                       format_of)
from minimedusa.weights import load_model

# The paper's 63-node sparse tree for Vicuna-7B (the reference implementation's mc_sim_7b_63):
# its 63 node paths plus the root make 64 tree tokens, reading 4 heads' top-10.
MC_SIM_7B_63 = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
]

# Small trees for a CPU, where each extra tree token costs real time: the top-1 chain of every
# head plus a few second guesses.
NAMED_TREES = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "chain3": [(0,), (0, 0), (0, 0, 0)],
    "chain5": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "cpu_8": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "cpu_16": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
               (0, 0, 1, 0)],
}

# --- flags --------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
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
                        "bfloat16 on CUDA; decoding, on a CPU that multiplies bfloat16 natively "
                        "(avx512_bf16 or AMX): int4 for a model whose weights came from a 4-bit "
                        "file, as the default model's, else bfloat16), float32, bfloat16, "
                        "float16")
    default = threads_default or "torch's choice, one per core"
    parser.add_argument("--threads", type=positive_int, default=threads_default,
                        help=f"CPU threads for torch (default: {default})")


def add_quantize_argument(parser) -> None:
    parser.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                        help="int4: the blocks' weights in 4 bits, a scale and a minimum per 32 "
                        "(as the GGUF's Q4_1), the heads in bfloat16, the LM head in 8-bit "
                        "groups if its weights already lie on them (as the GGUF's Q8_0), else "
                        "bfloat16; lossless for a model whose weights came from such a file, "
                        "where it is the default on a CPU with native bfloat16. int8: "
                        "weight-only int8 (a scale per output channel) for every linear layer, "
                        "the LM head and the heads' included. Both run bfloat16 activations on "
                        "a CPU (weight_formats.py). "
                        "Default: none, the weights in --dtype (whose auto may pick int4)")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the decoding step with torch.compile (compiled_step.py): "
                        "~20 s the first time on a machine, a few seconds in later runs "
                        "(cached on disk), then faster steps. Default: on a CPU where a C++ "
                        "compiler works; --no-compile: eager, the reading path")


def add_context_argument(parser) -> None:
    parser.add_argument("--context", action=argparse.BooleanOptionalAction, default=True,
                        help="context candidates: each step's tree also holds a branch read from "
                        "the prompt and the answer so far, where their last tokens occurred "
                        "before (context_candidates.py; output unchanged). With the adapted "
                        "trees only, not with a fixed --tree (default: on)")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def say(msg: str) -> None:
    """A line on stderr; on a terminal it first clears the line a progress bar is drawn on, so
    that the bar goes on below the message."""
    print(("\r\x1b[K" if sys.stderr.isatty() else "") + msg, file=sys.stderr, flush=True)


def progress_bar():
    """show(done, total, line): a bar with the elapsed and the remaining time, then `line`;
    redrawn in place on a terminal (at most every second), else a line at most every 10 s and
    at the end (a log keeps them)."""
    start, terminal = time.time(), sys.stderr.isatty()
    shown = [0.0]  # when it last printed

    def show(done: int, total: int, line: str = "") -> None:
        now = time.time()
        if done < total and now - shown[0] < (1 if terminal else 10):
            return
        shown[0], elapsed = now, now - start
        left = elapsed / max(done, 1) * (total - done)
        bar = "#" * (20 * done // max(total, 1))
        text = (f"[{bar:<20}] {done}/{total}, {minutes(elapsed)} elapsed, {minutes(left)} "
                f"left; {line}")
        end = "\n" if done == total or not terminal else ""
        print(("\r\x1b[K" if terminal else "") + text, end=end, file=sys.stderr, flush=True)
    return show


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The flags' device and dtype; sets torch's CPU threads if asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    return device, pick_dtype(args.dtype, device)


def device_and_format(args, folder: Path) -> tuple[torch.device, str]:
    """The flags' device and weight format for decoding the model in `folder`
    (weight_formats.py): --quantize int8 or int4, else --dtype, whose auto is the machine's and
    the model's default_format. Sets torch's CPU threads."""
    device, dtype = device_and_dtype(args)
    if args.quantize != "none":
        if device.type != "cpu" or args.dtype not in ("auto", "bfloat16", "bf16"):
            raise UserError(f"--quantize {args.quantize} runs on a CPU with bfloat16 activations "
                            "(torch's kernel is vectorised for those only): drop --dtype/--device")
        return device, args.quantize
    if args.dtype == "auto":
        return device, default_format(device, folder)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and name == "bfloat16" and not bf16_is_native():
        print("minimedusa: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products run "
              "without native kernels, slower than float32 (--dtype float32 is faster here)",
              file=sys.stderr)
    return device, name


# --- the model and the heads, ready to decode ----------------------------------------------------

def decoding_step(model: Llama, compile_flag: bool | None) -> str:
    """Compile the model's decoding step as --compile asks (compiled_step.py); returns what was
    done, in words: "compiled (warm-up 3.4 s)" or "eager" and why."""
    if model.embed.weight.device.type != "cpu":
        if compile_flag:
            raise UserError("--compile compiles the CPU's step (on CUDA it would be CUDA "
                            "graphs, left out): drop --compile")
        return "eager"
    if compile_flag is False:
        return "eager (--no-compile)"
    problem = compiler_problem()
    if problem is not None:
        say(f"minimedusa: torch.compile does not work here, decoding eagerly ({problem})")
        return "eager (no working compiler)"
    compile_blocks(model)
    kernel = kernel_problem()
    attention = "" if kernel is None else f"; attention in PyTorch, no C kernel: {kernel}"
    return f"compiled (warm-up {warm_up(model):.1f} s{attention})"


def decoding_model(folder: Path, device, weight_format: str) -> Llama:
    """The model for decoding, in a weight format of weight_formats.py (prepacked or quantized
    linear layers on a CPU)."""
    if not Path(folder).is_dir():
        raise UserError(f"model folder {folder} does not exist")
    # int8 and int4 round the float32 weights; a dtype's weights are read straight into it, so
    # that no float32 copy of the model is ever held beside them (peak memory)
    dtype = DTYPE_FORMATS.get(weight_format, torch.float32)
    return apply_format(load_model(folder, device, dtype), weight_format)


def add_draft_vocab_argument(parser) -> None:
    parser.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                        help="the heads rank only the N tokens most frequent in their training "
                        "answers, reading N rows of the LM head instead of all (output "
                        "unchanged: the model still verifies over the whole vocabulary); 0 = "
                        "the whole vocabulary (default: the heads' draft_vocab_size, if their "
                        "config.json sets one)")


def decoding_heads(spec: str, model: Llama, draft_vocab: int | None = None):
    """A heads folder, or 'untrained:K' / 'untrained-shared:K' / 'untrained-hydra:K': K fresh
    heads (own / shared projection / Hydra's) in the paper's initialisation, for trying the
    machinery without training. With a draft vocabulary of draft_vocab tokens (None: the
    folder's default), and in the model's weight format (weight_formats.py)."""
    heads, config = None, {}
    for prefix in ("untrained:", "untrained-shared:", "untrained-hydra:"):
        if spec.startswith(prefix):
            count = spec.removeprefix(prefix)
            if not count.isdigit() or int(count) < 1:
                raise HeadsError(f"bad heads {spec!r}: use {prefix}K with K >= 1")
            heads = (HydraHeads.for_model(model, int(count)) if prefix == "untrained-hydra:" else
                     MedusaHeads.for_model(model, int(count),
                                           shared_lm_head=prefix == "untrained-shared:"))
            heads.eval().requires_grad_(False)
    if heads is None:
        if not Path(spec).is_dir():
            raise HeadsError(f"heads folder {spec} does not exist")
        heads = load_heads(spec, model)
        config = json.loads((Path(spec) / "config.json").read_text())
    size = config.get("draft_vocab_size", 0) if draft_vocab is None else draft_vocab
    if size:
        heads.vocabulary = draft_vocabulary(spec, heads, model, size)
    return apply_format(heads.float(), format_of(model))


def draft_vocabulary(spec: str, heads, model: Llama, size: int) -> DraftVocabulary:
    """The `size` tokens most frequent in the heads' training answers (weights.save_draft_vocab)."""
    if not heads.config.shared_lm_head:
        raise HeadsError("a draft vocabulary cuts the shared LM head: these heads have their "
                         "own projections (use --draft-vocab 0)")
    counted = read_draft_vocab(spec) if Path(spec).is_dir() else None
    if counted is None:
        raise HeadsError(f"--draft-vocab: the heads {spec} have no {DRAFT_VOCAB_FILE} (train.py "
                         "writes it); use --draft-vocab 0")
    ids, _ = counted
    if not 0 < size <= model.config.vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{model.config.vocab_size}, got {size}")
    return DraftVocabulary(ids[:size].sort().values, model.lm_head)


def ranked_vocab_size(heads, model: Llama) -> int:
    """How many tokens the heads rank: their draft vocabulary's, else the model's."""
    return model.config.vocab_size if heads.vocabulary is None else heads.vocabulary.ids.numel()


# --- the tree -----------------------------------------------------------------------------------

def default_tree(device: torch.device) -> str:
    """The paper's 64-token tree on a GPU (compute to spare); a small one on a CPU."""
    return "mc_sim_7b_63" if device.type == "cuda" else "cpu_8"


def tree_choices(spec: str) -> list:
    """A named tree, a dense tree 'dense:3,2,2', or a JSON file holding a list of node paths;
    at most MAX_TREE_NODES nodes."""
    if spec in NAMED_TREES:
        return NAMED_TREES[spec]
    if spec.startswith("dense:"):
        try:
            top_s = [int(s) for s in spec.removeprefix("dense:").split(",")]
        except ValueError:
            raise TreeError(f"bad dense tree {spec!r}: use e.g. dense:3,2,2") from None
        if min(top_s) < 1:
            raise TreeError(f"bad dense tree {spec!r}: each head keeps >= 1 guess")
        check_tree_size(dense_size(top_s), spec)  # before listing: 100,100,100 lists a million
        return dense_tree(top_s)
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"unknown tree {spec!r}: not one of {', '.join(NAMED_TREES)}, "
                        "not dense:s1,s2,..., and no such file")
    try:
        choices = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TreeError(f"tree file {path} is not valid JSON: {e}") from None
    if isinstance(choices, list):
        check_tree_size(len(choices), spec)
    return choices


# The most nodes a tree may have: its nodes are the rows of one forward (and a tree mask of
# nodes x nodes), so past a thousand a step costs far more than it could accept on any machine,
# and tens of thousands exhaust the memory (the paper's largest useful tree had 64).
MAX_TREE_NODES = 1024


def dense_size(top_s: list[int]) -> int:
    """sum_k prod_{i<=k} s_i: the nodes of dense:s_1,...,s_K."""
    return sum(math.prod(top_s[:k]) for k in range(1, len(top_s) + 1))


def check_tree_size(nodes: int, spec: str) -> None:
    """A TreeError naming the bound if a tree of `nodes` nodes is not allowed."""
    if nodes > MAX_TREE_NODES:
        raise TreeError(f"tree {spec!r} has {nodes} nodes; at most {MAX_TREE_NODES} are "
                        "allowed (a step's rows: the paper's largest useful tree had 64)")


def ranked_size(spec: str) -> int | None:
    """N of a --tree ranked:N (ranked_tree.py: each step's N most probable nodes); None for
    --tree ranked, whose N the budget chooses step by step."""
    if spec == "ranked":
        return None
    size = spec.removeprefix("ranked:")
    if not size.isdigit() or not 1 <= int(size) <= MAX_TREE_NODES:
        raise TreeError(f"bad tree {spec!r}: use ranked:N with N >= 1 nodes, at most "
                        f"{MAX_TREE_NODES} (a step's rows: the paper's largest useful tree had 64)")
    return int(size)


def decoding_tree(spec: str | None, heads, model: Llama) -> tuple[str, MedusaTree]:
    """(name, tree) for a --tree value, checked against the heads it will read and the
    vocabulary they rank; without one, the device's default named tree without the paths
    deeper than the heads."""
    device = model.embed.weight.device
    if spec is not None:
        name, choices = spec, tree_choices(spec)
    else:  # a general tree, made for any heads: keep the paths these heads can read
        name, depth = default_tree(device), heads.config.medusa_num_heads
        every = tree_choices(name)
        choices = [path for path in every if len(path) <= depth]
        if len(choices) < len(every):
            name += f" (cut to its paths of at most {depth} nodes: {depth} heads)"
    return name, build_tree(choices, heads.config.medusa_num_heads,
                            ranked_vocab_size(heads, model), device)


def decoding_budget(heads, model: Llama, heads_spec: str):
    """(trees by size, the Budget that picks among them and plain steps, why these): the tree
    grown from the heads' calibration at every size up to 16 nodes on a CPU (where a 16-node
    step already cost 1.5-2x a plain one on the 2-core machines measured) or 64 on a GPU; for
    heads without a calibration, the default tree or plain steps. Step latencies: measured on
    this machine at first use, then cached (budget.py)."""
    weight = model.embed.weight
    folder = Path(heads_spec)
    accuracy = read_calibration(folder) if folder.is_dir() else None
    if accuracy is None:
        name, tree = decoding_tree(None, heads, model)
        nodes, sizes, expected = tree.nodes[1:], [tree.size - 1], {}
        why = f"{name} or plain steps (the heads have no calibration.json)"
    else:
        nodes, probs = grow_tree(accuracy, 64 if weight.device.type == "cuda" else 16)
        sizes = [n for n in SIZES if n <= len(nodes)]
        expected = {n: expected_length(probs[:n]) for n in sizes}
        why = "grown from the heads' calibration"
    trees, rank = nested_trees(nodes, sizes, heads.config.medusa_num_heads,
                               ranked_vocab_size(heads, model), weight.device)
    latency, source = machine_latency(model, heads, trees)
    return trees, Budget([0, *sizes], expected, latency, rank), f"{why}, latencies {source}"


# --- the acceptance rule ------------------------------------------------------------------------

def decoding_acceptance(kind: str, temperature: float, top_p: float = 1.0, eps: float = 0.09,
                        delta: float = 0.3) -> acceptance.Acceptance:
    """'auto' (greedy at temperature 0, lossless rejection sampling above), 'greedy',
    'typical' or 'rejection'."""
    if kind == "auto":
        kind = "greedy" if temperature == 0 else "rejection"
    if kind == "greedy":
        if temperature != 0:
            raise UserError("--acceptance greedy decodes at temperature 0: drop --temperature "
                            "or use --acceptance typical or rejection")
        return acceptance.greedy()
    if kind == "typical":
        return acceptance.typical(temperature, eps, delta)
    return acceptance.rejection(temperature, top_p)

"""Searching the tree (paper section 6, appendix C): calibrate the heads, grow the tree, size it.

1. Calibration (here). a_k^(i) is the accuracy of head k's i-th best guess, measured on held-out
   self-distilled answers (never on MT-Bench: that is the evaluation); saved beside the heads
   as calibration.json.
2. Growth (budget.grow_tree). Assuming the heads err independently, the node [i_1, ..., i_k] is
   accepted with probability prod_j a_j^(i_j); the greedy growth adds the most probable node
   that hangs off the tree, and its first n nodes are the best tree of n nodes, for every n.
3. Budget (budget.py). Each size's step latency, measured on this machine, against its expected
   tokens per step. This command prints the table and caches the latencies for generate.py,
   which also measures them by itself at first use and keeps adapting while it decodes.

    python -m minimedusa.training.tree_search --heads DIR --data data/distill  # calibrate + time
    python -m minimedusa.training.tree_search --heads DIR --budget 16 --out t.json  # one fixed size

Shapes: M rows, K heads, V vocab, R ranks calibrated (top-R guesses per head).
"""
import sys
import time
from pathlib import Path

import torch

from minimedusa import experiments
from minimedusa.budget import SIZES, expected_length, grow_tree, nested_trees, pick_budget
from minimedusa.files.heads_files import CALIBRATION, read_calibration
from minimedusa.assembly.latency_cache import latency_key, write_cached
from minimedusa.assembly.step_latency import step_latency
from minimedusa.files.outputs import write_json
from minimedusa.cli.flags import (Parser, add_compile_argument, add_device_arguments,
                                  add_quantize_argument, positive_int)
from minimedusa.assembly.recipe import Recipe, decoding_heads, decoding_model, timed_parts
from minimedusa.assembly.load import device_and_format
from minimedusa.files.default_model import ensure_default_model
from minimedusa.speed.machine import machine_key
from minimedusa.training.head_rows import rows_for
from minimedusa.errors import UserError, entry_point
from minimedusa.heads import token_ids
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.training.medusa1 import IGNORE, Rows, head_logits

MAX_NODES = 64  # the largest tree considered: the paper's
LATENCY_REPEATS = 8  # timed rounds of every size; the median is kept


# --- calibration ---------------------------------------------------------------------------------

@torch.no_grad()
def head_accuracies(heads, model, rows: Rows, ranks: int = 10,
                    batch_size: int = 256) -> torch.Tensor:
    """(K, R) float: a[k, i] = fraction of rows where head k's i-th best guess is its target,
    the guesses ranked as decoding ranks them (over the heads' draft vocabulary, if set).
    Hydra heads read the true tokens before their target: their a_k^(i) is the accuracy given
    that the draft above them was right, which is when their guess can be accepted."""
    K = rows.targets.shape[1]
    hits, counted = torch.zeros(K, ranks), torch.zeros(K, 1)
    device = model.embed.weight.device
    for a in range(0, rows.targets.shape[0], batch_size):
        hidden = rows.hidden[a:a + batch_size].to(device)  # (B, C): the heads cast it
        targets = rows.targets[a:a + batch_size].to(device).T  # (K, B)
        tokens = None if rows.tokens is None else rows.tokens[a:a + batch_size].to(device)
        logits = head_logits(heads, hidden, tokens, model, heads.vocabulary)  # (K, B, V')
        top = token_ids(heads.vocabulary, logits.topk(ranks, dim=-1).indices)  # (K, B, R)
        hits += (top == targets.unsqueeze(-1)).sum(dim=1).cpu()  # a target is in one rank at most
        counted += (targets != IGNORE).sum(dim=1, keepdim=True).cpu()
    return hits / counted.clamp(min=1)


# --- the files beside the heads --------------------------------------------------------------

def save_calibration(heads_dir: Path, data: Path, rows: int, accuracy: torch.Tensor) -> None:
    write_json(heads_dir / CALIBRATION, {"data": str(data), "rows": rows,
                                         "accuracy": [[round(x, 5) for x in row]
                                                      for row in accuracy.tolist()]})


def calibrate(heads_dir: Path, data: Path | None, heads, model, folder: Path,
              ranks: int = 10) -> torch.Tensor:
    """a_k^(i) (K, R): measured on the held-out answers of `data` and saved beside the heads,
    or (data None) read back from there."""
    if data is None:
        if (accuracy := read_calibration(heads_dir)) is None:
            raise UserError(f"{heads_dir / CALIBRATION} does not exist: calibrate first with "
                            "--data")
        return accuracy
    return calibrate_on(held_out_rows(data, heads, model, folder), heads_dir, data, heads, model,
                        ranks)


def held_out_rows(data: Path, heads, model, folder: Path) -> Rows:
    """The held-out answers of `data`, as the heads' rows: what calibration measures on (as
    their kind reads them: Hydra++ heads their draft layer's output in place of h_t)."""
    return rows_for(heads).held_out_rows(model, data, tokenizer_fingerprint(folder), heads,
                                         model.embed.weight.device)


def calibrate_on(val: Rows, heads_dir: Path, data: Path, heads, model,
                 ranks: int = 10) -> torch.Tensor:
    """a_k^(i) (K, R) measured on `val` (held out from `data`), saved beside the heads."""
    print(f"calibrating on {val.targets.shape[0]} held-out positions", file=sys.stderr)
    accuracy = head_accuracies(heads, model, val, ranks)
    save_calibration(heads_dir, data, val.targets.shape[0], accuracy)
    return accuracy


def size_trees(model, heads, nodes: list[tuple], max_nodes: int) -> dict:
    """{n: the tree of the first n grown nodes} for the sizes generate.py chooses among."""
    sizes = [n for n in SIZES if n <= min(max_nodes, len(nodes))]
    trees, _ = nested_trees(nodes, sizes, heads.config.medusa_num_heads,
                            model.config.vocab_size, model.embed.weight.device)
    return trees


def search_seconds(recipe, heads, model, val: Rows, max_nodes: int = MAX_NODES,
                   probe_rows: int = 512) -> float:
    """The expected time of calibrating on `val` and timing the trees: calibration timed on
    probe_rows of them, and the trees grown from that probe timed for 2 of the rounds."""
    start = time.perf_counter()
    probe = Rows(val.hidden[:probe_rows], val.targets[:probe_rows],
                 None if val.tokens is None else val.tokens[:probe_rows])
    nodes, _ = grow_tree(head_accuracies(heads, model, probe), max_nodes)
    calibration = (time.perf_counter() - start) * val.targets.shape[0] / probe_rows
    start = time.perf_counter()
    trees = size_trees(model, heads, nodes, max_nodes)
    step_latency(model, *timed_parts(recipe, heads, trees, model), list(trees), repeats=1)
    return calibration + (time.perf_counter() - start) * (LATENCY_REPEATS + 1) / 2


def time_sizes(recipe, model, heads, nodes: list[tuple], probs: list[float],
               max_nodes: int) -> int:
    """Time a step of every size here, of the recipe's draft and acceptance (recipe.timed_parts),
    cache the latencies for generate.py, print the table; the size with the most expected
    tokens per second."""
    weight = model.embed.weight
    trees = size_trees(model, heads, nodes, max_nodes)
    sizes = list(trees)
    print(f"timing steps of {sizes} nodes (and a plain step) on "
          f"{machine_key(weight.device, weight.dtype)}", file=sys.stderr)
    draft, rule = timed_parts(recipe, heads, trees, model)
    latency = step_latency(model, draft, rule, sizes, repeats=LATENCY_REPEATS)
    write_cached(latency_key(model, draft, rule), latency)
    best, table = pick_budget(probs, latency)
    plain_rate = 1000 / table[0]["step_ms"]
    for n, row in table.items():
        print(f"{n:4d} nodes: expected {row['expected_length']:.2f} tokens/step, "
              f"{row['step_ms']:7.2f} ms/step, {row['tokens_per_s']:6.1f} tokens/s "
              f"({row['tokens_per_s'] / plain_rate:.2f}x plain){'  <- best' * (n == best)}",
              file=sys.stderr)
    if table[best]["tokens_per_s"] < plain_rate:
        print("no tree beats plain decoding on this machine: generate.py will decode plainly "
              "after a few probing steps", file=sys.stderr)
    return best


@entry_point
def main(argv=None):
    p = Parser(description="Calibrate the heads, grow the candidate tree from their accuracies "
               "(paper section 6) and time each tree size on this machine; writes "
               "calibration.json beside the heads and caches the step latencies that "
               "generate.py starts from.")
    p.prog = "python -m minimedusa.training.tree_search"  # as typed (else argparse names the file)
    p.add_argument("--heads", type=Path, required=True, help="trained heads folder")
    p.add_argument("--data", type=Path, default=None,
                   help="self-distillation data to calibrate on (its held-out answers); "
                   "default: reuse the heads' calibration.json")
    p.add_argument("--model", type=Path, default=None, help="HF Llama folder (default: the "
                   "default model)")
    p.add_argument("--ranks", type=positive_int, default=10, help="guesses per head to calibrate "
                   "(default: %(default)s)")
    p.add_argument("--max-nodes", type=positive_int, default=MAX_NODES,
                   help="largest tree to consider (default: %(default)s)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="skip the latency measurement and take a tree of this many nodes")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the chosen tree's node paths here (a --tree file)")
    add_device_arguments(p)  # time with the thread count you will decode with
    add_quantize_argument(p)
    add_compile_argument(p)  # ... and the step generate.py will decode with
    args = p.parse_args(argv)
    experiments.register_training()  # Hydra++'s heads and their rows, where they are calibrated

    folder = args.model or ensure_default_model()
    device, weight_format = device_and_format(args, folder)
    # the heads are read once on the model as read, so that a missing or mismatched folder is
    # one line in seconds, not after the compiled step's warm-up (dropped: read again below)
    recipe = Recipe(folder=folder, device=device, weight_format=weight_format,
                    compile=args.compile, heads=str(args.heads))
    model, step = decoding_model(recipe, check=lambda model: decoding_heads(recipe.heads, model))
    print(f"decoding step: {step}", file=sys.stderr)
    heads = decoding_heads(str(args.heads), model)
    accuracy = calibrate(args.heads, args.data, heads, model, folder, args.ranks)
    print("a_k^(i), head k per row, guess i per column:\n" + "\n".join(
        " ".join(f"{x:.3f}" for x in row) for row in accuracy.tolist()), file=sys.stderr)
    nodes, probs = grow_tree(accuracy, args.max_nodes)
    size = args.budget or time_sizes(recipe, model, heads, nodes, probs, args.max_nodes)
    print(f"{size} nodes, expected {expected_length(probs[:size]):.3f} tokens/step",
          file=sys.stderr)
    if args.out:
        write_json(args.out, [list(n) for n in nodes[:size]])


if __name__ == "__main__":
    main()

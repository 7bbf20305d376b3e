"""Searching the tree (paper section 6, appendix C): calibration, greedy growth, the budget.

1. Calibration. a_k^(i) is the accuracy of head k's i-th best guess, measured on held-out
   self-distilled answers (never on MT-Bench: that is the evaluation).
2. Growth. Assuming the heads err independently, the node [i_1, ..., i_k] is accepted with
   probability prod_j a_j^(i_j), and a step yields 1 + sum over the tree's nodes of their
   probabilities tokens on average (the 1: the backbone's own next token, always accepted).
   Add the most probable node that hangs off the tree, repeatedly. A child is never more
   probable than its parent (each factor is <= 1), so the n most probable nodes form a tree
   and the greedy growth finds the best tree for EVERY budget n at once: its first n nodes.
3. Budget. A bigger tree accepts more but each step costs more (the paper's Fig. 4). Measure
   the step latency of the grown tree at each size on this device and dtype, and keep the size
   with the most expected tokens per second, 1 + E[accepted] over latency.

The results live beside the heads: calibration.json (a_k^(i)) and trees.json (the tuned tree
per device/dtype, which generate.py uses by default).

    python -m minimedusa.tree_search --heads DIR --data data/distill      # calibrate + tune
    python -m minimedusa.tree_search --heads DIR --budget 16 --out t.json  # one fixed size

Shapes: M rows, K heads, V vocab, R ranks calibrated (top-R guesses per head).
"""
import argparse
import heapq
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from minimedusa.acceptance import greedy
from minimedusa.cli import (TREES, add_device_arguments, decoding_heads, decoding_model,
                            device_and_dtype, device_key)
from minimedusa.decoding import decode_step, medusa_step, new_cache, prefill
from minimedusa.default_model import ensure_default_model
from minimedusa.device import device_name
from minimedusa.errors import UserError, entry_point
from minimedusa.self_distill import tokenizer_fingerprint
from minimedusa.training import IGNORE, Rows, read_rows
from minimedusa.tree import build_tree

CALIBRATION = "calibration.json"


# --- 1. calibration ---------------------------------------------------------------------------

@torch.no_grad()
def head_accuracies(heads, lm_head, rows: Rows, ranks: int = 10,
                    batch_size: int = 256) -> torch.Tensor:
    """(K, R) float: a[k, i] = fraction of rows where head k's i-th best guess is its target."""
    K = rows.targets.shape[1]
    hits, counted = torch.zeros(K, ranks), torch.zeros(K, 1)
    for a in range(0, rows.targets.shape[0], batch_size):
        hidden = rows.hidden[a:a + batch_size].to(lm_head.weight.device, lm_head.weight.dtype)
        targets = rows.targets[a:a + batch_size].to(lm_head.weight.device).T  # (K, B)
        top = heads(hidden, lm_head).topk(ranks, dim=-1).indices  # (K, B, R)
        hits += (top == targets.unsqueeze(-1)).sum(dim=1).cpu()  # a target is in one rank at most
        counted += (targets != IGNORE).sum(dim=1, keepdim=True).cpu()
    return hits / counted.clamp(min=1)


# --- 2. greedy growth ---------------------------------------------------------------------------

def grow_tree(accuracy: torch.Tensor, budget: int) -> tuple[list[tuple], list[float]]:
    """The `budget` most probable node paths, in the order added, and each one's probability.

    accuracy (K, R): a_k^(i). Every prefix of the returned list is the best tree of its size.
    """
    a = accuracy.tolist()
    K, R = len(a), len(a[0])
    frontier = [(-a[0][i], (i,)) for i in range(R)]  # (-probability, path): children of the root
    heapq.heapify(frontier)
    nodes, probs = [], []
    while frontier and len(nodes) < budget:
        neg_p, path = heapq.heappop(frontier)  # ties: the shorter/lower-ranked path, a parent
        nodes.append(path)
        probs.append(-neg_p)
        if len(path) < K:  # its children: the guesses of the next head
            for i in range(R):
                heapq.heappush(frontier, (neg_p * a[len(path)][i], path + (i,)))
    return nodes, probs


def expected_length(probs: list[float]) -> float:
    """Expected tokens per step of a tree whose nodes have these probabilities."""
    return 1.0 + sum(probs)


def expected_length_of(nodes, accuracy: torch.Tensor) -> float:
    """Expected tokens per step of any tree (node paths), under the same independence; a
    guess ranked past the calibrated ones counts as never right."""
    a, R = accuracy.tolist(), accuracy.shape[1]
    probs = [math.prod(a[j][i] if i < R else 0.0 for j, i in enumerate(path)) for path in nodes]
    return expected_length(probs)


# --- 3. the budget --------------------------------------------------------------------------------

def step_latency(model, heads, sizes: list[int], nodes: list[tuple], prompt_len: int = 256,
                 repeats: int = 8) -> dict[int, float]:
    """Seconds per Medusa step with the first n grown nodes, for each n in sizes (0: a plain
    decoding step). Sizes are timed round-robin so that machine noise hits all of them alike;
    the median of `repeats` rounds is kept. Every step starts from the same cached prefix of
    prompt_len tokens (at most half the context)."""
    device = model.embed.weight.device
    prompt_len = min(prompt_len, model.config.max_position_embeddings // 2)
    trees = {n: build_tree(nodes[:n], heads.config.medusa_num_heads, device=device)
             for n in sizes if n > 0}
    cache = new_cache(model, prompt_len, 1, margin=max(sizes) + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    _, hidden = prefill(model, cache, prompt)
    with torch.inference_mode():
        head_logits = heads(hidden[0], model.lm_head)  # (K, V)
    times = {n: [] for n in sizes}
    for r in range(repeats + 1):  # round 0 warms up
        for n in sizes:
            cache.rewind(prompt_len)  # forget the last step: every size starts from the prompt
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if n == 0:
                logits, _ = decode_step(model, cache, torch.zeros(1, 1, dtype=torch.long,
                                                                  device=device))
                logits.argmax().item()  # the host sync a plain step makes too
            else:
                medusa_step(model, heads, trees[n], cache, 0, head_logits, greedy(), None)
            if r > 0:
                times[n].append(time.perf_counter() - start)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def pick_budget(probs: list[float], latency: dict[int, float]) -> tuple[int, dict]:
    """(the size with the most expected tokens/s, a table of every size's estimate)."""
    table = {}
    for n, seconds in sorted(latency.items()):
        length = expected_length(probs[:n])
        table[n] = {"expected_length": round(length, 4), "step_ms": round(1000 * seconds, 3),
                    "tokens_per_s": round(length / seconds, 2)}
    best = max((n for n in table if n > 0), key=lambda n: table[n]["tokens_per_s"])
    return best, table


def read_calibration(heads_dir: Path) -> torch.Tensor | None:
    """The heads' a_k^(i) (K, R) from their calibration.json, or None if not calibrated."""
    path = Path(heads_dir) / CALIBRATION
    return torch.tensor(json.loads(path.read_text())["accuracy"]) if path.is_file() else None


# --- the files beside the heads --------------------------------------------------------------

def write_json(path: Path, obj) -> None:
    """Beside the final name, then renamed: an interrupted run leaves the old file whole."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def default_sizes(limit: int) -> list[int]:
    return [0] + [n for n in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 80, 96, 128)
                  if n <= limit]


@entry_point
def main(argv=None):
    p = argparse.ArgumentParser(description="Grow the candidate tree from the heads' measured "
                                "accuracies (paper section 6) and pick its size from this "
                                "device's step latency; writes calibration.json and trees.json "
                                "beside the heads.")
    p.add_argument("--heads", type=Path, required=True, help="trained heads folder")
    p.add_argument("--data", type=Path, default=None,
                   help="self-distillation data to calibrate on (its held-out answers); "
                   "default: reuse the heads' calibration.json")
    p.add_argument("--model", type=Path, default=None, help="HF Llama folder (default: the "
                   "default model)")
    p.add_argument("--ranks", type=int, default=10, help="guesses per head to calibrate "
                   "(default: %(default)s)")
    p.add_argument("--max-nodes", type=int, default=64,
                   help="largest tree to consider (default: %(default)s)")
    p.add_argument("--budget", type=int, default=None,
                   help="skip the latency measurement and take a tree of this many nodes")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the chosen tree's node paths here (a --tree file)")
    add_device_arguments(p)  # tune with the thread count you will decode with
    args = p.parse_args(argv)

    device, dtype = device_and_dtype(args)
    folder = args.model or ensure_default_model()
    model = decoding_model(folder, device, dtype)
    heads = decoding_heads(str(args.heads), model)
    calibration = args.heads / CALIBRATION
    if args.data is not None:
        _, val = read_rows(args.data, heads.config.medusa_num_heads,
                           tokenizer_fingerprint(folder), model.config.vocab_size)
        print(f"calibrating on {val.targets.shape[0]} held-out positions", file=sys.stderr)
        accuracy = head_accuracies(heads, model.lm_head, val, args.ranks)
        write_json(calibration, {"data": str(args.data), "rows": val.targets.shape[0],
                                 "accuracy": [[round(x, 5) for x in row]
                                              for row in accuracy.tolist()]})
    elif (accuracy := read_calibration(args.heads)) is None:
        raise UserError(f"{calibration} does not exist: calibrate first with --data")
    print("a_k^(i), head k per row, guess i per column:\n" + "\n".join(
        " ".join(f"{x:.3f}" for x in row) for row in accuracy.tolist()), file=sys.stderr)

    nodes, probs = grow_tree(accuracy, args.max_nodes)
    if args.budget is not None:
        chosen = nodes[:args.budget]
        print(f"{len(chosen)} nodes, expected {expected_length(probs[:len(chosen)]):.3f} "
              "tokens/step", file=sys.stderr)
    else:
        sizes = default_sizes(args.max_nodes)
        print(f"timing steps of {sizes[1:]} nodes (and a plain step) on "
              f"{device_key(device, dtype)}", file=sys.stderr)
        best, table = pick_budget(probs, step_latency(model, heads, sizes, nodes))
        plain_rate = 1 / table[0]["step_ms"] * 1000
        for n, row in table.items():
            print(f"{n:4d} nodes: expected {row['expected_length']:.2f} tokens/step, "
                  f"{row['step_ms']:7.2f} ms/step, {row['tokens_per_s']:6.1f} tokens/s "
                  f"({row['tokens_per_s'] / plain_rate:.2f}x plain){'  <- best' * (n == best)}",
                  file=sys.stderr)
        chosen = nodes[:best]
        trees_path = args.heads / TREES
        trees = json.loads(trees_path.read_text()) if trees_path.is_file() else {}
        trees[device_key(device, dtype)] = {
            "nodes": [list(n) for n in chosen], "expected_length": table[best]["expected_length"],
            "threads": torch.get_num_threads(), "device_name": device_name(device),
            "estimates": table}
        write_json(trees_path, trees)
        print(f"wrote the {best}-node tree for {device_key(device, dtype)} to {trees_path}",
              file=sys.stderr)
    if args.out:
        write_json(args.out, [list(n) for n in chosen])


if __name__ == "__main__":
    main()

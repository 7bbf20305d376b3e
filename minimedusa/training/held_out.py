"""Heads side by side on the same held-out positions: each head's top-1 and top-5 accuracy,
teacher-forced, in float32, as train.py validates (medusa1.head_metrics), over the draft
vocabulary each was trained with. The measure of the model card and of the data curve: heads
trained on different data compare only on positions none of them trained on. With
--temperature, sampling's measure too: how often one candidate drawn from a head is accepted.

    python -m minimedusa.training.held_out --data data/mix-card \
        --heads weights/SmolLM2-135M-Instruct-hydra --heads data/hydra-2

The held-out positions are the data folder's last answers, 1 in 20 (medusa1.split_validation,
what train.py holds out of that folder); only their shards' hidden states are read.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from minimedusa.acceptance import probabilities
from minimedusa.assembly.heads_reading import read_heads
from minimedusa.cli.flags import Parser, positive
from minimedusa.errors import UserError, entry_point
from minimedusa.experiments import register_training
from minimedusa.files.default_model import ensure_default_model
from minimedusa.files.outputs import write_json
from minimedusa.files.weights import load_model
from minimedusa.training.head_rows import StoredRows, rows_for
from minimedusa.training.medusa1 import (IGNORE, Rows, head_logits, head_metrics, read_answers,
                                        rows_of, split_validation, teacher_states)
from minimedusa.training.self_distill import tokenizer_fingerprint


def held_out_answers(data: Path, fingerprint: str, vocab_size: int) -> list[tuple]:
    """The held-out answers of `data` (split_validation's), each (prompt ids, answer ids,
    hidden (n, C)): the answers' ids read from every shard, the hidden states from the shards
    that hold held-out answers alone (a large folder's are gigabytes)."""
    answers = read_answers(data, fingerprint, vocab_size, with_hidden=False)
    _, held_out = split_validation(answers)
    first = len(answers) - len(held_out)  # the first held-out answer's place
    shards, seen, kept = sorted(data.glob("shard-*.safetensors")), 0, []
    for shard in shards:
        with safe_open(shard, framework="pt") as st:
            offsets = st.get_tensor("answer_offsets").tolist()
            count = len(offsets) - 1
            if seen + count > first:
                hidden = st.get_tensor("hidden")
                kept += [hidden[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        seen += count
    return [(p, a, h) for (p, a, _), h in zip(held_out, kept[-len(held_out):])]


@torch.no_grad()
def sampled_acceptance(heads, model, rows: Rows, temperature: float,
                       batch_size: int = 256) -> list[float]:
    """Per head k, the chance that one candidate drawn from its q at `temperature` is accepted
    by speculative sampling (speculative_sampling.py): sum_x min(p(x), q(x)) = 1 - TV(p, q), p
    the backbone's next-token law where head k's target is, softmax(W_lm h_{t+k} / T) (row t + k:
    teacher_states), q the head's softmax(logits / T) over its draft vocabulary, as DrawnDraft
    draws; the mean over the rows where head k has a target, teacher-forced as head_metrics.
    Sampling's analogue of top-1: a head can guess p's top token well and still be far from a
    wide p, whose other tokens a sampled text takes often."""
    K, M = rows.targets.shape[1], rows.targets.shape[0]
    accepted, counted = torch.zeros(K), torch.zeros(K)
    for a in range(0, M, batch_size):
        index = torch.arange(a, min(a + batch_size, M))  # (B,)
        tokens = None if rows.tokens is None else rows.tokens[index]
        logits = head_logits(heads, rows.hidden[index], tokens, model, heads.vocabulary)
        q = probabilities(logits, temperature, 1.0)  # (K, B, V')
        teacher = teacher_states(rows.hidden, index, K).float()  # (K, B, C)
        p = probabilities(model.lm_head(teacher), temperature, 1.0)  # (K, B, V): the verifier's
        if heads.vocabulary is not None:
            p = p[..., heads.vocabulary.ids]  # q's columns: outside them q is 0, so is min(p, q)
        has = rows.targets[index].T != IGNORE  # (K, B): head k has a target at this row
        accepted += (torch.minimum(p, q).sum(dim=-1) * has).sum(dim=1)
        counted += has.sum(dim=1)
    return (accepted / counted.clamp(min=1)).tolist()


def compare(model, data: Path, fingerprint: str, specs: list[str],
            temperature: float | None = None) -> dict:
    """{heads: head_metrics' {"loss", "top1", "top5"} per head, and with a temperature
    "accepted": sampled_acceptance's} on the held-out positions."""
    answers = held_out_answers(data, fingerprint, model.config.vocab_size)
    results = {}
    for spec in specs:
        config = json.loads((Path(spec) / "config.json").read_text())
        heads = read_heads(spec, model, config.get("draft_vocab_size") or 0)
        if rows_for(heads) is not StoredRows:
            raise UserError(f"{spec}: heads of kind {heads.config.head_kind} read more than "
                            "the stored h_t; python -m minimedusa.training.tree_search --budget "
                            "measures them on the held-out answers")
        rows = rows_of(answers, heads.config.medusa_num_heads)
        results[spec] = head_metrics(heads, model, rows, model.embed.weight.device,
                                     vocabulary=heads.vocabulary)
        results[spec]["positions"] = int(rows.targets.shape[0])
        if temperature is not None:
            results[spec]["accepted"] = sampled_acceptance(heads, model, rows, temperature)
    return results


def table(results: dict) -> str:
    lines = []
    for spec, metrics in results.items():
        heads = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(metrics["top1"], metrics["top5"]))
        lines.append(f"{spec}: top-1/top-5 per head {heads} ({metrics['positions']} positions)")
        if "accepted" in metrics:
            accepted = " ".join(f"{a:.3f}" for a in metrics["accepted"])
            lines.append(f"{spec}: a drawn candidate accepted, per head {accepted}")
    return "\n".join(lines)


@entry_point
def main(argv=None):
    p = Parser(description="Heads side by side on the same held-out positions of a "
               "self-distillation folder: top-1 and top-5 per head, teacher-forced, float32.")
    p.prog = "python -m minimedusa.training.held_out"  # as typed (else argparse names the file)
    p.add_argument("--data", type=Path, required=True, help="self-distillation folder: its "
                   "last answers, 1 in 20, are the held-out positions")
    p.add_argument("--heads", action="append", required=True, help="a heads folder (repeat to "
                   "compare)")
    p.add_argument("--model", type=Path, default=None, help="HF Llama folder (default: the "
                   "default model)")
    p.add_argument("--temperature", type=positive, default=None, metavar="T",
                   help="also measure, per head, how often one candidate drawn from it at "
                   "temperature T is accepted by lossless sampling (1 - TV(p, q), p the "
                   "backbone's law where the head's target is): what sampling's speed follows; "
                   "costs the backbone's whole LM head at every position and head")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    register_training()  # Hydra++'s heads kind: refused in a line, not as an unknown kind
    folder = args.model or ensure_default_model()
    model = load_model(folder, torch.device("cpu"), torch.float32).eval()
    results = compare(model, args.data, tokenizer_fingerprint(folder), args.heads,
                      args.temperature)
    print(table(results), file=sys.stderr)
    if args.out is not None:
        write_json(args.out, {"data": str(args.data), "temperature": args.temperature,
                              "heads": results})


if __name__ == "__main__":
    main()

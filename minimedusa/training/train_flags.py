"""train.py's flags: the loop's (data, output, schedule, checkpoints, device), then Medusa-1's
(training/medusa1.py), Medusa-2's (medusa2.py) and the pipeline's (pipeline.py), each mode's in
its group; parse_args checks the combinations that cannot run together, before anything loads.
"""
import argparse
from pathlib import Path

from minimedusa.cli.flags import (Parser, non_negative, non_negative_int, positive, positive_int,
                                  seed_int)
from minimedusa.files.outputs import followed
from minimedusa.training import medusa2, pipeline
from minimedusa.training.medusa1 import add_flags as add_medusa1_flags

# Flags whose default depends on where the data comes from: with --data, the paper's Medusa-1;
# from the model alone, the shipped heads' recipe (pipeline.RECIPE).
DEFAULTS = {"kind": "medusa", "layers": 1, "lr": 1e-3, "epochs": 1.0, "draft_vocab": 0,
            "eval_every": 200}


def add_loop_flags(p) -> None:
    p.add_argument("--frozen", action="store_true", help="Medusa-1: freeze the backbone, train "
                   "the heads (from scratch, or on from --init-heads). Without it: Medusa-2 "
                   "(joint training from Medusa-1 heads, see --init-heads)")
    p.add_argument("--data", type=Path, default=None, help="self-distillation folder made by "
                   "python -m minimedusa.training.self_distill. Without it, --frozen runs the "
                   "whole "
                   "recipe from the model alone (see 'From the model alone' below)")
    p.add_argument("--out", type=Path, default=None, help="output folder: heads, train_log.json, "
                   "checkpoint (Medusa-2 adds the merged backbone in OUT/model and "
                   "OUT/adapters.safetensors); needed with --data, else weights/<model>-trained")
    p.add_argument("--model", type=Path, default=None, help="HF Llama-family folder: Llama, "
                   "Llama 3, Qwen2, Mistral (the one --data was made with; default: the default)")
    p.add_argument("--init-heads", type=Path, default=None, help="trained heads to start from. "
                   "Medusa-1: train them further (their form replaces --heads/--layers/--shared; "
                   "default: fresh heads). Medusa-2: the paper's heads warm-up (default: the "
                   "shipped paper-kind heads for the default model)")
    p.add_argument("--epochs", type=positive, default=None,
                   help="passes over the data (default: 1; from the model alone: 2)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="split each batch into this many micro-batches (default: 1)")
    p.add_argument("--warmup", type=non_negative_int, default=50,
                   help="warm-up steps (default: 50)")
    p.add_argument("--weight-decay", type=non_negative, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=positive, default=1.0, help="gradient norm clip (default: 1.0)")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="validate every N steps (default: 200; from the model alone: 500)")
    p.add_argument("--save-every", type=positive_int, default=200, help="checkpoint every N steps")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many steps (the schedule still spans --epochs)")
    p.add_argument("--resume", action="store_true", help="continue from out/checkpoint.pt")
    p.add_argument("--seed", type=seed_int, default=0, help="initialisation and data-order seed")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast for the matrix products (default: on for CUDA, off "
                   "for the CPU, where it pays only on CPUs with AMX or avx512_bf16)")


def parse_args(argv=None):
    p = Parser(description="Train Medusa heads on self-distilled data: with --frozen only the "
               "heads learn (Medusa-1); without it the backbone is tuned too, through LoRA, with "
               "a KL self-distillation loss that keeps it close to the original (Medusa-2). "
               "Each mode has its own batch size and learning rate flags, in its group below.")
    add_loop_flags(p), add_medusa1_flags(p), medusa2.add_flags(p), pipeline.add_flags(p)
    args = p.parse_args(argv)
    if args.data is None and not args.frozen:
        p.error("Medusa-2 trains on --data made beforehand (python -m "
                "minimedusa.training.self_distill); "
                "from the model alone, train Medusa-1 heads with --frozen")
    if args.data is not None and (args.out is None or args.prompts is not None
                                  or args.decode_format != "auto"):
        p.error("with --data, give --out, and no --prompts or --decode-format (the data is "
                "made already; python -m minimedusa.training.tree_search calibrates in a format)")
    if args.out is not None:  # a link: written where it points, nothing beside it
        args.out = followed(args.out)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file: give a folder (made if missing)")
    for name, value in (pipeline.RECIPE if args.data is None else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # note: each mode ignores the other's flags. Both modes have a batch size and a learning
    # rate, so these, given to the wrong mode, are refused rather than ignored without a word;
    # so are Medusa-1's head kind and draft vocabulary, which Medusa-2 has no use for.
    if args.frozen:
        theirs, hint = ["answers_per_batch", "lora_lr"], "Medusa-1's are --batch-size and --lr"
    else:
        theirs = ["batch_size", "lr", "kind", "draft_vocab", "distill"]
        hint = "Medusa-2's are --answers-per-batch and --lora-lr; it tunes the paper's heads"
    for name in theirs:
        if getattr(args, name) != DEFAULTS.get(name, p.get_default(name)):
            p.error(f"--{name.replace('_', '-')} belongs to the other mode ({hint})")
    return args

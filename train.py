"""Train Medusa heads from self-distilled data: Medusa-1 (frozen backbone) or Medusa-2 (joint).

    python train.py --frozen                         # from the model alone: data, heads, tree
    python train.py --frozen --model DIR --out OUT   # the same for your own Llama-family model

Without --data, --frozen runs three stages into OUT (default weights/<model folder>-trained):
self-distillation into OUT/data, training, then calibration and the tree search for this machine
(tree_search.py); each prints its expected time, timed on a probe, before it starts, and resumes
where it stopped (a finished stage is skipped), so Ctrl-C then the same command loses nothing
finished. Its defaults are the shipped heads' recipe. The separate commands, for control:

    python -m minimedusa.self_distill --out data/distill          # the model answers seed prompts
    python train.py --frozen --data data/distill --out weights/my-heads          # Medusa-1
    python train.py --frozen --data data/distill --out weights/my-heads --resume
    torchrun --nproc_per_node 2 train.py --frozen --data data/distill --out weights/my-heads
    python train.py --data data/distill --out data/medusa2 --init-heads weights/my-heads  # Medusa-2

Medusa-1 (paper section 4): loss sum_k 0.8^k CE(head k, token t+k+1) over answer tokens only,
on hidden states stored with the data; a batch is --batch-size answer positions, the heads learn
at --lr. Medusa-2 (sections 4-5, minimedusa/joint_training.py): LoRA adapters on the backbone
and the heads train together on KL(original || tuned) + lambda_0 * the heads' loss; a batch is
--answers-per-batch whole answers, the adapters learn at --lora-lr and the heads at
--heads-lr-ratio times it. Then the adapters are merged into a plain HF-layout backbone, and a
quality guard measures how far the tuned model moved from the original.
One loop, train_loop, runs both: AdamW, cosine schedule with warm-up, gradient clipping and
accumulation, bf16 autocast on CUDA, a validation split, per-head loss and top-1/top-5 accuracy.
The two modes differ only in what learns, the loss and what is validated and saved: the
Medusa1 and Medusa2 dataclasses hold that. A checkpoint is written atomically every
--save-every steps and at the end; --resume continues exactly where it stopped. Under torchrun,
every process takes its share of each batch and DistributedDataParallel averages the gradients.
"""
import argparse
import contextlib
import copy
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from safetensors.torch import save_file

from minimedusa.budget import CALIBRATION, grow_tree, latency_key, read_cached, read_calibration
from minimedusa.cli import (Parser, decoding_heads, decoding_model, minutes, positive_int,
                            progress_bar, say)
from minimedusa.default_model import PAPER_HEADS_DIR, WEIGHTS_DIR, ensure_default_model
from minimedusa.device import pick_device, pick_dtype
from minimedusa.errors import UserError, entry_point
from minimedusa.heads import DraftVocabulary, MedusaHeads, token_ranking
from minimedusa.hydra import HydraHeads
from minimedusa.joint_training import (JointModel, distill_kl, greedy_agreement, joint_metrics,
                                       joint_optimizer, lambda0, make_batch, mean_kl,
                                       original_in_bfloat16, state_rows, teacher_log_probs)
from minimedusa.lora import (adapter_state, adapters_off, add_adapters, load_adapter_state,
                             merge_adapters)
from minimedusa.model import Llama
from minimedusa.seed_prompts import seed_prompts
from minimedusa.self_distill import (Settings, batch_seconds, distill, open_folder,
                                     pending_batches, tokenizer_fingerprint)
from minimedusa.tokenizer import Tokenizer
from minimedusa.training import (DataError, Rows, cosine_lr, draft_columns, head_logits,
                                 head_metrics, medusa_loss, read_answers, read_rows,
                                 split_validation)
from minimedusa.tree_search import (MAX_NODES, calibrate_on, head_accuracies, held_out_rows,
                                    search_seconds, time_sizes, write_json)
from minimedusa.weights import (load_heads, load_model, read_config, save_draft_vocab,
                                save_heads, save_model)

CHECKPOINT = "checkpoint.pt"
# Flags whose default depends on where the data comes from: with --data, the paper's Medusa-1;
# from the model alone, the recipe of the shipped heads (weights/README.md).
DEFAULTS = {"kind": "medusa", "layers": 1, "lr": 1e-3, "epochs": 1.0, "draft_vocab": 0,
            "eval_every": 200}
RECIPE = {"kind": "hydra", "layers": 2, "lr": 2e-3, "epochs": 2.0, "draft_vocab": 8192,
          "eval_every": 500}
CPU_PROMPTS, MAX_NEW_TOKENS = 2048, 192  # about an hour in all on a 2-core CPU


def parse_args(argv=None):
    p = Parser(
        description="Train Medusa heads on self-distilled data: with --frozen the backbone "
        "stays frozen and only the heads learn (Medusa-1); without it the backbone is tuned "
        "too, through LoRA adapters, with a KL self-distillation loss that keeps it close to "
        "the original model (Medusa-2). Each mode has its own batch size and learning rate "
        "flags, in its group below.")
    p.add_argument("--frozen", action="store_true",
                   help="Medusa-1: freeze the backbone, train the heads (from scratch, or on "
                   "from --init-heads). Without "
                   "it: Medusa-2 (joint training from Medusa-1 heads, see --init-heads)")
    p.add_argument("--data", type=Path, default=None,
                   help="self-distillation folder made by python -m minimedusa.self_distill. "
                   "Without it, --frozen runs the whole recipe from the model alone: "
                   "self-distillation into OUT/data, training, then the tree search for this "
                   "machine (see 'From the model alone' below)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder: the heads, train_log.json and the checkpoint "
                   "(Medusa-2 adds the merged backbone in OUT/model and OUT/adapters.safetensors); "
                   "required with --data, else default weights/<model folder>-trained")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama-family folder: Llama, Llama 3, Qwen2, Mistral (the one --data was "
                   "made with; default: the default model)")
    p.add_argument("--init-heads", type=Path, default=None,
                   help="trained heads to start from. Medusa-1: train them further on --data "
                   "(their form replaces --heads/--layers/--shared; default: fresh heads). "
                   "Medusa-2: the paper's heads warm-up (default: the shipped paper-kind heads "
                   "when training the default model)")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the data (default: 1; from the model alone: 2)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="split each batch into this many micro-batches (default: 1)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (default: 50)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (default: 1.0)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validate every N steps (default: 200; from the model alone: 500)")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps (the schedule still spans --epochs)")
    p.add_argument("--resume", action="store_true", help="continue from out/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast for the matrix products (default: on for CUDA, off "
                   "for the CPU; on this project's AMX-capable 2-core CPU a Medusa-1 step of "
                   "256 rows x 5 shared heads took 1.1 s with it, 1.6 s without)")
    m1 = p.add_argument_group("Medusa-1 (with --frozen)")
    m1.add_argument("--kind", choices=("medusa", "hydra"), default=None,
                    help="medusa: the paper's heads, each reads h_t alone (default with "
                    "--data); hydra: each also reads the tokens drafted before it "
                    "(minimedusa/hydra.py; always with the shared LM head; default from the "
                    "model alone)")
    m1.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="train the heads to rank only the N tokens most frequent in the "
                    "training answers, as they will draft with it (a draft vocabulary: a "
                    "fraction of the LM head's cost, in training and decoding; the config "
                    "makes it the heads' default); 0 = the whole vocabulary (default with "
                    "--data; from the model alone: 8192)")
    m1.add_argument("--heads", type=int, default=4, help="number of heads K (default: 4; "
                    "Medusa-2 keeps the form of --init-heads)")
    m1.add_argument("--layers", type=int, default=None,
                    help="residual blocks per head (default: 1; from the model alone: 2)")
    m1.add_argument("--shared", action="store_true",
                    help="heads share the backbone's LM head instead of own projections")
    m1.add_argument("--batch-size", type=int, default=256,
                    help="answer positions per optimizer step (default: 256)")
    m1.add_argument("--lr", type=float, default=None,
                    help="the heads' peak learning rate (default: 1e-3; from the model alone: "
                    "2e-3)")
    m2 = p.add_argument_group("Medusa-2 (without --frozen)")
    m2.add_argument("--answers-per-batch", type=int, default=8,
                    help="whole answers per optimizer step (default: 8)")
    m2.add_argument("--lora-lr", type=float, default=5e-4,
                    help="the adapters' peak learning rate (default: 5e-4, the paper's)")
    m2.add_argument("--heads-lr-ratio", type=float, default=4.0,
                    help="the heads' learning rate over the adapters' (default: 4, the paper's)")
    m2.add_argument("--lora-rank", type=int, default=32, help="adapter rank r (default: 32)")
    m2.add_argument("--lora-alpha", type=float, default=16.0,
                    help="adapter scale alpha; the update is alpha/r B A (default: 16)")
    m2.add_argument("--lora-dropout", type=float, default=0.05,
                    help="dropout on the adapters' input (default: 0.05)")
    m2.add_argument("--lambda0", type=float, default=0.01,
                    help="peak weight of the heads' loss beside the KL (default: 0.01, the "
                    "paper's value with self-distillation)")
    m2.add_argument("--lambda0-warmup", type=int, default=None,
                    help="steps over which lambda_0 rises as a sine from 0 to --lambda0 "
                    "(default: half the run)")
    m2.add_argument("--max-kl", type=float, default=0.05,
                    help="quality guard: the run is good only if the mean next-token KL from "
                    "the original model on held-out answers stays below this, in nats "
                    "(default: 0.05; quality.json reports beside it the KL of the original "
                    "model run in bfloat16, a change people accept as the same model)")
    m2.add_argument("--eval-answers", type=int, default=64,
                    help="held-out answers used by the periodic validation (the final one "
                    "uses all; default: 64)")
    m2.add_argument("--guard-prompts", type=int, default=32,
                    help="held-out prompts for the greedy agreement check (default: 32)")
    alone = p.add_argument_group(
        "From the model alone (--frozen without --data)",
        "python train.py --frozen [--model DIR] makes heads in one command, in three stages: "
        "(1) the model answers seed prompts (self-distillation, paper section 5) into OUT/data, "
        "(2) the heads train on those answers, (3) calibration and the tree search time the "
        "trees on this machine. Each stage prints its expected time before it starts and "
        "resumes where it stopped, or is skipped when done: after Ctrl-C run the same command "
        "again. The defaults are the shipped heads' recipe (4 Hydra heads x 2 blocks, draft "
        "vocabulary 8192, 2 epochs), sized to take about an hour on a 2-core CPU: "
        f"{CPU_PROMPTS} prompts, answers of up to {MAX_NEW_TOKENS} tokens; on a GPU all "
        "the seed prompts, in batches of 256.")
    alone.add_argument("--prompts", type=positive_int, default=None, metavar="N",
                       help=f"seed prompts to answer (default: {CPU_PROMPTS} on a CPU, "
                       "every seed prompt on a GPU)")
    args = p.parse_args(argv)
    if args.data is None and not args.frozen:
        p.error("Medusa-2 trains on --data made beforehand (python -m minimedusa.self_distill); "
                "from the model alone, train Medusa-1 heads with --frozen")
    if args.data is not None and (args.out is None or args.prompts is not None):
        p.error("with --data, give --out, and no --prompts (the data is made already)")
    for name, value in (RECIPE if args.data is None else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # note: each mode ignores the other's flags. Both modes have a batch size and a learning
    # rate, so these, given to the wrong mode, are refused rather than ignored without a word;
    # so are Medusa-1's head kind and draft vocabulary, which Medusa-2 has no use for.
    if args.frozen:
        theirs, hint = ["answers_per_batch", "lora_lr"], "Medusa-1's are --batch-size and --lr"
    else:
        theirs = ["batch_size", "lr", "kind", "draft_vocab"]
        hint = "Medusa-2's are --answers-per-batch and --lora-lr; it tunes the paper's heads"
    for name in theirs:
        if getattr(args, name) != DEFAULTS.get(name, p.get_default(name)):
            p.error(f"--{name.replace('_', '-')} belongs to the other mode ({hint})")
    return args


# --- the loop both modes share -------------------------------------------------------------

def setup_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device): one process per GPU under torchrun, else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, pick_device(device_name)
    cuda = torch.cuda.is_available() and device_name != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if cuda else torch.device("cpu")
    return rank, world, device


def distributed(module: torch.nn.Module, world: int) -> torch.nn.Module:
    """The module to train through: under torchrun wrapped, so that backward averages every
    process's gradients; else the module itself."""
    return torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module


@functools.lru_cache(maxsize=1)
def epoch_order(n_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """A fresh permutation of the rows each epoch, fixed by the seed (made once per epoch)."""
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def batch_rows(n_rows: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The row indices of optimizer step `step`: determined by the step alone, so that a
    resumed run sees exactly the batches the uninterrupted one would."""
    epoch, i = divmod(step, n_rows // batch_size)
    return epoch_order(n_rows, seed, epoch)[i * batch_size:(i + 1) * batch_size]


def total_steps(args, n_rows: int, batch_size: int) -> tuple[int, int]:
    """(steps the schedule spans, the step this run stops at)."""
    total = math.ceil(args.epochs * (n_rows // batch_size))
    if total == 0:
        raise DataError(f"{args.data} has fewer rows than one batch of {batch_size}")
    return total, min(total, args.max_steps or total)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write beside the final name, then rename: a kill mid-write leaves the old checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def resume(mode, path: Path, device, say) -> tuple[int, list]:
    """Restore the mode's tensors and its optimizer from the checkpoint: (step, log so far)."""
    if not path.is_file():
        raise UserError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location=device, weights_only=True)
    mode.load_state(state)
    mode.optimizer.load_state_dict(state["optimizer"])
    say(f"resumed at step {state['step']}")
    return state["step"], json.loads(state["log"])


def progress(show, step: int, first: int, total: int, last: int, loss: float, ce, lr: float,
             extra: str = "") -> None:
    """The progress bar (rank 0 only: show None elsewhere)."""
    if show is not None:
        show(step - first, last - first,
             f"step {step}/{total} loss {loss:.3f} per-head CE "
             f"{' '.join(f'{c:.2f}' for c in ce.tolist())}{extra} lr {lr:.2e}")


@contextlib.contextmanager
def checkpoint_on_interrupt(enabled: bool):
    """Inside, the first Ctrl-C only raises a flag (read by calling the yielded function): the
    loop ends its step, writes the checkpoint and stops, so no finished step is lost. A second
    Ctrl-C interrupts at once. Under torchrun (enabled False) the processes could stop at
    different steps, so Ctrl-C stops them at once and the last periodic checkpoint stays."""
    asked = []
    if not enabled:
        yield lambda: False
        return

    def handler(signum, frame):
        asked.append(signum)
        signal.signal(signal.SIGINT, previous)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def accuracy_line(metrics: dict) -> str:
    return (f"top-1 per head {[round(x, 3) for x in metrics['top1']]} "
            f"top-5 {[round(x, 3) for x in metrics['top5']]}")


@dataclass
class Losses:
    """One micro-batch's losses: the one minimised and what the progress line and log show."""
    total: torch.Tensor  # scalar: what the optimizer minimises
    ce: torch.Tensor  # (K,) per-head CE
    log: dict  # the mode's own numbers for train_log.json (Medusa-2: KL and lambda_0)
    text: str  # the same for the progress line


def train_step(mode, args, step: int, total: int, index: torch.Tensor, autocast) -> Losses:
    """One optimizer step on this process's rows `index` of the step's batch, in --grad-accum
    micro-batches. Returns the last micro-batch's losses."""
    for group, peak in zip(mode.optimizer.param_groups, mode.peak_lrs()):
        group["lr"] = cosine_lr(step, total, args.warmup, peak)
    torch.manual_seed(args.seed * 1_000_003 + step)  # dropout: a resumed run draws the same
    mode.optimizer.zero_grad(set_to_none=True)
    for micro in index.chunk(args.grad_accum):
        with autocast():
            losses = mode.loss(step, micro)
        (losses.total / args.grad_accum).backward()
    params = [p for group in mode.optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, args.clip)
    mode.optimizer.step()
    return losses


def train_loop(mode, args, rank: int, world: int, device, say) -> int:
    """Train `mode` (a Medusa1 or a Medusa2) from step 0 or the checkpoint to the last step,
    validating every --eval-every steps and checkpointing every --save-every; returns the step
    it stopped at. The mode brings its optimizer, loss, evaluate, state and load_state."""
    total, last = total_steps(args, mode.rows(), mode.batch_size())
    step, log = resume(mode, args.out / CHECKPOINT, device, say) if args.resume else (0, [])
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"{mode.intro}, {total} steps of {mode.batch_size()}, {world} process(es) on {device}")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=bf16)
    show, first = progress_bar() if rank == 0 else None, step
    with checkpoint_on_interrupt(world == 1) as interrupted:
        while step < last:
            index = batch_rows(mode.rows(), step, mode.batch_size(), args.seed)[rank::world]
            losses = train_step(mode, args, step, total, index, autocast)
            step += 1
            progress(show, step, first, total, last, losses.total.item(), losses.ce,
                     mode.optimizer.param_groups[0]["lr"],
                     losses.text)  # group 0: the heads (Medusa-1), the adapters (Medusa-2)
            if step % args.eval_every == 0 or step == last:
                metrics, line = mode.evaluate()
                log.append({"step": step, "train_loss": losses.total.item(), **losses.log,
                            **metrics})
                say(f"  validation {line}")
            if rank == 0 and (step % args.save_every == 0 or step == last or interrupted()):
                save_checkpoint(args.out / CHECKPOINT, {**mode.state(), "step": step,
                                                        "optimizer": mode.optimizer.state_dict(),
                                                        "log": json.dumps(log)})
            if interrupted():
                say(f"interrupted: checkpoint at step {step} in {args.out} (go on with "
                    "--resume; train.py without --data resumes by itself)")
                raise KeyboardInterrupt
    if rank == 0:
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return step


# --- Medusa-1: frozen backbone -------------------------------------------------------------

def check_out_is_not(out: Path, init: Path) -> None:
    if out.resolve() == init.resolve():
        raise UserError(f"--out {out} is the --init-heads folder: training writes a new "
                        "folder and never overwrites the heads it starts from")


def medusa1_heads(args, model) -> MedusaHeads:
    """Fresh heads in the paper's initialisation or, with --init-heads, trained heads to train
    further (e.g. on new data: heads trained on templated prompts, then on model-written ones)."""
    if args.init_heads is None and args.kind == "hydra":
        return HydraHeads.for_model(model, args.heads, args.layers)
    if args.init_heads is None:
        return MedusaHeads.for_model(model, args.heads, args.layers, args.shared)
    check_out_is_not(args.out, args.init_heads)
    return load_heads(args.init_heads, model).requires_grad_(True)


@dataclass
class Medusa1:
    """The heads learn alone, on hidden states stored with the data: the backbone is frozen, so
    they are the states it would compute. A row is one answer position."""
    args: argparse.Namespace
    device: torch.device
    folder: Path  # the backbone's
    intro: str  # the run's first line
    model: Llama
    heads: MedusaHeads | HydraHeads
    trained: torch.nn.Module  # the heads, wrapped under torchrun (distributed)
    train_rows: Rows
    val_rows: Rows
    optimizer: torch.optim.Optimizer
    ranking: tuple[torch.Tensor, torch.Tensor]  # the answers' token ids by frequency, counts
    vocabulary: DraftVocabulary | None  # with --draft-vocab: the tokens the heads rank

    def rows(self) -> int:
        return self.train_rows.targets.shape[0]

    def batch_size(self) -> int:
        return self.args.batch_size

    def peak_lrs(self) -> list[float]:
        return [self.args.lr]

    def loss(self, step: int, index: torch.Tensor) -> Losses:
        hidden = self.train_rows.hidden[index].to(self.device, torch.float32)  # (B, C)
        targets = self.train_rows.targets[index].to(self.device)  # (B, K)
        tokens = self.train_rows.tokens[index].to(self.device)  # (B, K): read by Hydra heads
        logits = head_logits(self.trained, hidden, tokens, self.model, self.vocabulary)
        loss, ce, _ = medusa_loss(logits, draft_columns(targets, self.vocabulary))
        return Losses(loss, ce, {}, "")

    def evaluate(self) -> tuple[dict, str]:
        metrics = head_metrics(self.heads.eval(), self.model, self.val_rows, self.device,
                               vocabulary=self.vocabulary)
        self.heads.train()
        return metrics, accuracy_line(metrics)

    def state(self) -> dict:
        return {"heads": self.heads.state_dict()}

    def load_state(self, state: dict) -> None:
        self.heads.load_state_dict(state["heads"])

    def finish(self, step: int, say) -> bool:
        """Save the heads and the training answers' token counts (their draft vocabulary); True:
        there is no quality guard, the backbone is untouched."""
        extra = {"base_model_name_or_path": str(self.folder), "trained_steps": step}
        if self.vocabulary is not None:
            extra["draft_vocab_size"] = len(self.vocabulary.ids)
        save_draft_vocab(self.args.out, *self.ranking)
        save_heads(self.heads.eval(), self.args.out, extra)  # config.json last: heads are whole
        return True


def medusa1(args, device, world: int) -> Medusa1:
    folder = args.model or ensure_default_model()
    model = load_model(folder, device, torch.float32)  # frozen: no gradient anywhere in it
    torch.manual_seed(args.seed)
    heads = medusa1_heads(args, model).train()
    cfg = heads.config
    train_rows, val_rows = read_rows(args.data, cfg.medusa_num_heads,
                                     tokenizer_fingerprint(folder), model.config.vocab_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ranking = token_ranking(train_rows.tokens[:, 0])  # column 0: every answer token once
    vocabulary = (DraftVocabulary(ranking[0][:args.draft_vocab].sort().values, model.lm_head)
                  if args.draft_vocab else None)
    intro = (f"training {cfg.medusa_num_heads} {cfg.head_kind} heads "
             f"({'shared' if cfg.shared_lm_head else 'own'}"
             f" projection{', from ' + str(args.init_heads) if args.init_heads else ''}) on "
             f"{train_rows.targets.shape[0]} positions ({val_rows.targets.shape[0]} held out)")
    if vocabulary is not None:
        covered = ranking[1][:args.draft_vocab].sum() / ranking[1].sum()
        intro += f", ranking a draft vocabulary of {args.draft_vocab} tokens ({covered:.1%} of them)"
    return Medusa1(args, device, folder, intro, model, heads, distributed(heads, world),
                   train_rows, val_rows, optimizer, ranking, vocabulary)


# --- Medusa-2: joint training --------------------------------------------------------------

def starting_heads(args) -> Path:
    """The Medusa-1 heads Medusa-2 starts from (the paper's heads warm-up)."""
    init = args.init_heads or (PAPER_HEADS_DIR if args.model is None else None)
    if init is None or not init.is_dir():
        raise UserError(
            "Medusa-2 starts from trained Medusa-1 heads (the paper's heads warm-up): give "
            "--init-heads DIR, made by train.py --frozen" + (f" ({init} does not exist)"
                                                             if init else ""))
    check_out_is_not(args.out, init)
    return init


@dataclass
class Medusa2:
    """The adapters and the heads learn together on the backbone's live states. A row is one
    whole answer (with its prompt): the backbone runs over the sequence."""
    args: argparse.Namespace
    device: torch.device
    world: int
    folder: Path  # the original backbone's
    intro: str  # the run's first line
    model: Llama  # with adapters; switched off, it is the original model (the teacher)
    heads: MedusaHeads
    init_heads: MedusaHeads
    trained: torch.nn.Module  # JointModel(model, heads), wrapped under torchrun (distributed)
    train_answers: list[tuple]
    val_answers: list[tuple]
    probe: list[tuple]  # the held-out answers of the periodic validation
    probe_teacher: Rows  # the original model's states at them
    optimizer: torch.optim.Optimizer
    lambda_warmup: int

    def rows(self) -> int:
        return len(self.train_answers)

    def batch_size(self) -> int:
        return self.args.answers_per_batch

    def peak_lrs(self) -> list[float]:
        return [group["peak_lr"] for group in self.optimizer.param_groups]

    def loss(self, step: int, index: torch.Tensor) -> Losses:
        """KL(original || tuned) + lambda_0 * the heads' loss, at the answers' positions."""
        lam = lambda0(step, self.lambda_warmup, self.args.lambda0)
        batch = make_batch([self.train_answers[i] for i in index.tolist()],
                           self.heads.config.medusa_num_heads, self.device)
        teacher = teacher_log_probs(self.model, batch)
        logits, head_logits = self.trained(batch)
        kl = distill_kl(teacher, logits)
        heads_loss, ce, _ = medusa_loss(head_logits, batch.targets)
        return Losses(kl + lam * heads_loss, ce, {"train_kl": kl.item(), "lambda0": lam},
                      f" KL {kl.item():.4f} lambda0 {lam:.4f}")

    def evaluate(self) -> tuple[dict, str]:
        self.model.eval()
        metrics, _ = joint_metrics(self.model, self.heads.eval(), self.probe, self.probe_teacher,
                                   self.device)
        self.model.train(), self.heads.train()
        return metrics, (f"({len(self.probe)} answers) KL {metrics['kl']:.4f} "
                         f"{accuracy_line(metrics)}")

    def state(self) -> dict:
        return {"adapters": adapter_state(self.model), "heads": self.heads.state_dict()}

    def load_state(self, state: dict) -> None:
        load_adapter_state(self.model, state["adapters"])
        self.heads.load_state_dict(state["heads"])

    def finish(self, step: int, say) -> bool:
        """The final validation and the quality guard, then the merged backbone, the heads and
        the reports; returns whether the guard passed."""
        self.model.eval(), self.heads.eval()
        if self.device.type == "cpu":  # the other processes are done: rank 0 may use their cores
            torch.set_num_threads(min(os.cpu_count(), self.world * torch.get_num_threads()))
        say(f"final validation on {len(self.val_answers)} held-out answers and the quality guard")
        report = quality_report(self.model, self.heads, self.init_heads, self.val_answers,
                                self.args, self.device)
        save_joint(self.model, self.heads, self.folder, self.args.out, report, self.args, step)
        m1, m2, out = report["medusa1_heads_original_backbone"], report["medusa2"], self.args.out
        say(f"Medusa-1 heads, original backbone: {accuracy_line(m1)}")
        say(f"Medusa-2 heads, tuned backbone:    {accuracy_line(m2)}")
        say(f"wrote {out}/model (merged backbone), the heads and adapters.safetensors; "
            f"generate with: python generate.py --model {out}/model --heads {out}")
        say(quality_verdict(report))
        return report["good"]


def medusa2(args, device, world: int) -> Medusa2:
    folder = args.model or ensure_default_model()
    init = starting_heads(args)
    model = load_model(folder, device, torch.float32)
    heads = load_heads(init, model).train()
    if heads.config.head_kind != "medusa":
        raise UserError(f"{init} holds {heads.config.head_kind} heads: Medusa-2 tunes the "
                        "paper's heads with the backbone; train these with --frozen")
    init_heads = copy.deepcopy(heads).eval()  # the Medusa-1 heads, for the side-by-side report
    K = heads.config.medusa_num_heads
    train_answers, val_answers = split_validation(read_answers(
        args.data, tokenizer_fingerprint(folder), model.config.vocab_size, with_hidden=False))
    torch.manual_seed(args.seed)
    adapters = add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_dropout)
    optimizer = joint_optimizer(adapters, heads, args.lora_lr, args.weight_decay,
                                args.heads_lr_ratio)
    total, _ = total_steps(args, len(train_answers), args.answers_per_batch)
    probe = val_answers[:args.eval_answers]
    with torch.no_grad(), adapters_off(model):
        probe_teacher = state_rows(model, probe, K)
    intro = (f"Medusa-2: LoRA r={args.lora_rank} on {len(adapters) // 2} layers "
             f"({sum(p.numel() for p in adapters) / 1e6:.1f}M parameters) + {K} heads from "
             f"{init}, {len(train_answers)} answers ({len(val_answers)} held out)")
    model.train()  # the adapters' dropout
    return Medusa2(args, device, world, folder, intro, model, heads, init_heads,
                   distributed(JointModel(model, heads), world), train_answers, val_answers,
                   probe, probe_teacher, optimizer, args.lambda0_warmup or max(1, total // 2))


def quality_report(model, heads, init_heads, val_answers, args, device) -> dict:
    """The final validation on every held-out answer, beside the Medusa-1 heads on the original
    backbone, and the quality guard's verdict."""
    K = heads.config.medusa_num_heads
    with adapters_off(model):
        teacher = state_rows(model, val_answers, K)
    medusa1 = head_metrics(init_heads, model, teacher, device)
    medusa2, student = joint_metrics(model, heads, val_answers, teacher, device)
    prompts = [p.tolist() for p, _, _ in val_answers[:args.guard_prompts]]
    agreement = greedy_agreement(model, prompts)
    bf16 = original_in_bfloat16(model)  # the yardstick: the same model, rounded differently
    bf16_kl = mean_kl(model.lm_head, teacher, state_rows(bf16, val_answers, K), bf16.lm_head)
    bf16_agreement = greedy_agreement(model, prompts, candidate=bf16)
    return {"held_out_answers": len(val_answers), "held_out_positions": student.targets.shape[0],
            "medusa1_heads_original_backbone": medusa1, "medusa2": medusa2,
            "kl_threshold": args.max_kl, "kl_original_in_bfloat16": bf16_kl,
            "greedy_agreement_64": agreement,
            "greedy_agreement_64_original_in_bfloat16": bf16_agreement,
            "good": medusa2["kl"] <= args.max_kl,
            "calibration": head_accuracies(heads, model, student)}


def save_joint(model, heads, folder: Path, out: Path, report: dict, args, step: int) -> None:
    """OUT/adapters.safetensors (the adapters alone), OUT/model (the merged backbone, HF layout,
    with the tokenizer), OUT's heads, calibration.json and quality.json."""
    save_file(adapter_state(model), out / "adapters.safetensors",
              metadata={"rank": str(args.lora_rank), "alpha": str(args.lora_alpha)})
    merge_adapters(model)
    save_model(model, out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, out / "model" / name)
    save_heads(heads, out, {"base_model_name_or_path": str(out / "model"), "trained_steps": step,
                            "medusa2": {"base_model": str(folder), "lora_rank": args.lora_rank,
                                        "lora_alpha": args.lora_alpha, "lambda0": args.lambda0}})
    accuracy = report.pop("calibration")
    write_json(out / CALIBRATION, {"data": str(args.data), "rows": report["held_out_positions"],
                                   "accuracy": [[round(x, 5) for x in row]
                                                for row in accuracy.tolist()]})
    write_json(out / "quality.json", report)


def quality_verdict(report: dict) -> str:
    """One line: the quality guard's numbers and whether the run may be called good."""
    agree, bf16 = report["greedy_agreement_64"], report["greedy_agreement_64_original_in_bfloat16"]
    numbers = (f"mean next-token KL from the original model {report['medusa2']['kl']:.4f} nats "
               f"(threshold {report['kl_threshold']}; the original model in bfloat16: "
               f"{report['kl_original_in_bfloat16']:.4f}), greedy agreement over 64 tokens "
               f"{agree['agreement']:.2f} ({agree['identical']}/{agree['prompts']} identical; "
               f"bfloat16: {bf16['agreement']:.2f}, {bf16['identical']}/{bf16['prompts']})")
    if report["good"]:
        return f"quality guard passed: {numbers}"
    return (f"error: quality guard FAILED, this run is not good and must not replace the "
            f"shipped defaults: {numbers}")


# --- from the model alone: self-distillation, training, tree search ---------------------------

STAGES = 3


def check_model_folder(folder: Path) -> None:
    """Refuse in one line, before an hour of work, a model this code cannot run (another
    architecture, a rope scaling it does not implement) or cannot ask in its own chat format."""
    read_config(folder)
    Tokenizer.from_folder(folder).chat_prompt([{"role": "user", "content": "Hello"}])


def check_recipe(args) -> None:
    """OUT/recipe.json keeps the training flags OUT was started with: resuming with others would
    mix two runs in one checkpoint."""
    names = ("kind", "heads", "layers", "shared", "draft_vocab", "epochs", "lr", "batch_size",
             "warmup", "weight_decay", "clip", "grad_accum", "seed", "prompts")
    recipe = {n: getattr(args, n) for n in names}
    path = args.out / "recipe.json"
    if path.is_file() and (old := json.loads(path.read_text())) != recipe:
        changed = ", ".join(f"--{n.replace('_', '-')} {old.get(n)} -> {recipe[n]}"
                            for n in names if old.get(n) != recipe[n])
        raise UserError(f"{args.out} was started with other settings ({changed}); run it with "
                        "its own or give another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(path, recipe)


def distillation_stage(args, folder: Path, device, say) -> None:
    """Stage 1: the model answers seed prompts into OUT/data, one shard per batch."""
    cpu, dtype = device.type == "cpu", pick_dtype("auto", device)
    settings = Settings(limit=args.prompts or (CPU_PROMPTS if cpu else None),
                        batch_size=64 if cpu else 256, max_new_tokens=MAX_NEW_TOKENS)
    prompts = seed_prompts(settings.seed)
    if settings.limit is not None and settings.limit > len(prompts):
        raise UserError(f"--prompts {settings.limit}: there are {len(prompts)} seed prompts")
    prompts = prompts[:settings.limit]
    open_folder(args.data, folder, settings, len(prompts), dtype)
    todo = pending_batches(args.data, prompts, settings.batch_size)
    if not todo:
        return say(f"stage 1/{STAGES}, self-distillation: done ({args.data})")
    model, tokenizer = load_model(folder, device, dtype), Tokenizer.from_folder(folder)
    seconds = len(todo) * batch_seconds(model, tokenizer, todo[0][1], settings)
    say(f"stage 1/{STAGES}, self-distillation: the model answers {len(prompts)} seed prompts "
        f"(up to {settings.max_new_tokens} tokens each) in batches of {settings.batch_size}, "
        f"{len(todo)} batches to go, into {args.data}: expected {minutes(seconds)}")
    distill(model, tokenizer, args.data, prompts, settings, progress_bar())


def training_seconds(mode, args, steps: int) -> float:
    """The expected time of `steps` optimizer steps and their validations: one step's loss and
    backward timed after a warm-up one, and one validation (the heads do not change)."""
    index = batch_rows(mode.rows(), 0, mode.batch_size(), args.seed)
    mode.loss(0, index).total.backward()
    start = time.perf_counter()
    mode.loss(0, index).total.backward()
    step = time.perf_counter() - start
    mode.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    mode.evaluate()
    return steps * step + (steps // args.eval_every + 1) * (time.perf_counter() - start)


def training_stage(args, device, say) -> None:
    """Stage 2: Medusa-1 on OUT/data, from the checkpoint if there is one. The heads' config.json
    is the last file training writes (weights.save_heads): with it, the stage is done."""
    if (args.out / "config.json").is_file():
        return say(f"stage 2/{STAGES}, training: done ({args.out})")
    args.resume = (args.out / CHECKPOINT).is_file()
    mode = medusa1(args, device, 1)
    _, last = total_steps(args, mode.rows(), mode.batch_size())
    first = (torch.load(args.out / CHECKPOINT, weights_only=True)["step"] if args.resume else 0)
    say(f"stage 2/{STAGES}, training: {last - first} steps to go, expected "
        f"{minutes(training_seconds(mode, args, last - first))}")
    mode.finish(train_loop(mode, args, 0, 1, device, say), say)


def tree_stage(args, folder: Path, device, say) -> None:
    """Stage 3: calibrate the heads on held-out answers and time each tree size here, for
    generate.py (tree_search.py). Done when both the calibration and this machine's step
    latencies are there."""
    dtype = pick_dtype("auto", device)
    model = decoding_model(folder, device, dtype)
    heads = decoding_heads(str(args.out), model)
    if read_calibration(args.out) is not None and read_cached(latency_key(model, heads, device,
                                                                          dtype)):
        return say(f"stage 3/{STAGES}, tree search: done (calibrated, this machine timed)")
    val = held_out_rows(args.data, heads, model, folder)
    say(f"stage 3/{STAGES}, tree search: calibration on {val.targets.shape[0]} held-out "
        f"positions, then each tree size timed on this machine: expected "
        f"{minutes(search_seconds(heads, model, val))}")
    nodes, probs = grow_tree(calibrate_on(val, args.out, args.data, heads, model), MAX_NODES)
    time_sizes(model, heads, nodes, probs, MAX_NODES)


def from_model(args) -> None:
    """python train.py --frozen [--model DIR]: the three stages, each resumed or skipped."""
    device = pick_device(args.device)
    folder = args.model or ensure_default_model()
    check_model_folder(folder)
    args.out = args.out or WEIGHTS_DIR / f"{folder.name}-trained"
    args.data = args.out / "data"
    check_recipe(args)
    say(f"heads for {folder} in {args.out}, from the model alone (sized for about an hour on "
        f"a 2-core CPU; Ctrl-C, then the same command, resumes)")
    start = time.time()
    for stage in (lambda: distillation_stage(args, folder, device, say),
                  lambda: training_stage(args, device, say),
                  lambda: tree_stage(args, folder, device, say)):
        began = time.time()
        stage()
        say(f"  ({minutes(time.time() - began)})")
    model = f" --model {args.model}" if args.model else ""
    say(f"done in {minutes(time.time() - start)}: python generate.py{model} --heads {args.out} "
        "--prompt ...")


@entry_point
def main(argv=None):
    args = parse_args(argv)
    if args.data is None:
        return from_model(args)
    rank, world, device = setup_distributed(args.device)
    tell = say if rank == 0 else (lambda msg: None)
    mode = medusa1(args, device, world) if args.frozen else medusa2(args, device, world)
    step = train_loop(mode, args, rank, world, device, tell)
    good = mode.finish(step, tell) if rank == 0 else True
    if world > 1:
        dist.destroy_process_group()
    if not good:
        sys.exit(2)


if __name__ == "__main__":
    main()

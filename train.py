"""Train Medusa heads from self-distilled data: Medusa-1 (frozen backbone) or Medusa-2 (joint).

    python -m minimedusa.self_distill --out data/distill          # the model answers seed prompts
    python train.py --frozen --data data/distill --out weights/my-heads          # Medusa-1
    python train.py --frozen --data data/distill --out weights/my-heads --resume
    torchrun --nproc_per_node 2 train.py --frozen --data data/distill --out weights/my-heads
    python train.py --data data/distill --out data/medusa2 --init-heads weights/my-heads  # Medusa-2

Medusa-1 (paper section 4): loss sum_k 0.8^k CE(head k, token t+k+1) over answer tokens only,
on hidden states stored with the data. Medusa-2 (sections 4-5, minimedusa/joint_training.py):
LoRA adapters on the backbone and the heads train together on KL(original || tuned) + lambda_0
* the heads' loss, then the adapters are merged into a plain HF-layout backbone, and a quality
guard measures how far the tuned model moved from the original.
Both: AdamW, cosine schedule with warm-up, gradient clipping and accumulation, bf16 autocast on
CUDA, a validation split, per-head loss and top-1/top-5 accuracy. A checkpoint is written
atomically every --save-every steps and at the end; --resume continues exactly where it
stopped. Under torchrun, every process takes its share of each batch and
DistributedDataParallel averages the gradients.
"""
import argparse
import copy
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from safetensors.torch import save_file

from minimedusa.default_model import DEFAULT_HEADS_DIR, ensure_default_model
from minimedusa.device import pick_device
from minimedusa.heads import MedusaHeads
from minimedusa.joint_training import (JointModel, distill_kl, greedy_agreement, joint_optimizer,
                                       lambda0, make_batch, mean_kl, original_in_bfloat16,
                                       state_rows, teacher_log_probs)
from minimedusa.lora import (adapter_state, adapters_off, add_adapters, load_adapter_state,
                             merge_adapters)
from minimedusa.self_distill import tokenizer_fingerprint
from minimedusa.training import (DataError, Rows, cosine_lr, medusa_loss, read_answers,
                                 read_rows, split_validation, topk_hits)
from minimedusa.tree_search import CALIBRATION, head_accuracies, write_json
from minimedusa.errors import UserError, entry_point
from minimedusa.weights import load_heads, load_model, save_heads, save_model

CHECKPOINT = "checkpoint.pt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train Medusa heads on self-distilled data: with --frozen the backbone "
        "stays frozen and only the heads learn (Medusa-1); without it the backbone is tuned "
        "too, through LoRA adapters, with a KL self-distillation loss that keeps it close to "
        "the original model (Medusa-2).")
    p.add_argument("--frozen", action="store_true",
                   help="Medusa-1: freeze the backbone, train the heads (from scratch, or on "
                   "from --init-heads). Without "
                   "it: Medusa-2 (joint training from Medusa-1 heads, see --init-heads)")
    p.add_argument("--data", type=Path, required=True,
                   help="self-distillation folder made by python -m minimedusa.self_distill")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: the heads, train_log.json and the checkpoint "
                   "(Medusa-2 adds the merged backbone in OUT/model and OUT/adapters.safetensors)")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama folder the data was made with (default: the default model)")
    p.add_argument("--heads", type=int, default=4, help="Medusa-1: number of heads K "
                   "(default: 4; Medusa-2 keeps the form of --init-heads)")
    p.add_argument("--layers", type=int, default=1,
                   help="Medusa-1: residual blocks per head (default: 1)")
    p.add_argument("--shared", action="store_true",
                   help="Medusa-1: heads share the backbone's LM head instead of own projections")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default: 1)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per optimizer step: answer positions for Medusa-1 (default: 256), "
                   "whole answers for Medusa-2 (default: 8)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="split each batch into this many micro-batches (default: 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate: the heads' for "
                   "Medusa-1 (default: 1e-3), the adapters' for Medusa-2 (default: 5e-4, the "
                   "paper's; the heads get --heads-lr-ratio times it)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (default: 50)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (default: 1.0)")
    p.add_argument("--eval-every", type=int, default=200, help="validate every N steps")
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
    p.add_argument("--init-heads", type=Path, default=None,
                   help="trained heads to start from. Medusa-1: train them further on --data "
                   "(their form replaces --heads/--layers/--shared; default: fresh heads). "
                   "Medusa-2: the paper's heads warm-up (default: the shipped heads when "
                   "training the default model)")
    m2 = p.add_argument_group("Medusa-2 (without --frozen)")
    m2.add_argument("--lora-rank", type=int, default=32, help="adapter rank r (default: 32)")
    m2.add_argument("--lora-alpha", type=float, default=16.0,
                    help="adapter scale alpha; the update is alpha/r B A (default: 16)")
    m2.add_argument("--lora-dropout", type=float, default=0.05,
                    help="dropout on the adapters' input (default: 0.05)")
    m2.add_argument("--heads-lr-ratio", type=float, default=4.0,
                    help="the heads' learning rate over the adapters' (default: 4, the paper's)")
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
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 256 if args.frozen else 8
    if args.lr is None:
        args.lr = 1e-3 if args.frozen else 5e-4
    return args


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


@functools.lru_cache(maxsize=1)
def epoch_order(n_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """A fresh permutation of the rows each epoch, fixed by the seed (made once per epoch)."""
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def batch_rows(n_rows: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The row indices of optimizer step `step`: determined by the step alone, so that a
    resumed run sees exactly the batches the uninterrupted one would."""
    epoch, i = divmod(step, n_rows // batch_size)
    return epoch_order(n_rows, seed, epoch)[i * batch_size:(i + 1) * batch_size]


def total_steps(args, n_rows: int) -> tuple[int, int]:
    """(steps the schedule spans, the step this run stops at)."""
    total = math.ceil(args.epochs * (n_rows // args.batch_size))
    if total == 0:
        raise DataError(f"{args.data} has fewer rows than one batch of {args.batch_size}")
    return total, min(total, args.max_steps or total)


@torch.no_grad()
def evaluate(heads, lm_head, rows: Rows, device, batch_size=1024) -> dict:
    """Per-head validation loss and top-1 / top-5 accuracy."""
    K = rows.targets.shape[1]
    ce_sum, n, top1, top5 = torch.zeros(K), torch.zeros(K), torch.zeros(K), torch.zeros(K)
    for a in range(0, rows.targets.shape[0], batch_size):
        hidden = rows.hidden[a:a + batch_size].to(device, lm_head.weight.dtype)
        targets = rows.targets[a:a + batch_size].to(device)
        logits = heads(hidden, lm_head)  # (K, B, V)
        _, ce, counted = medusa_loss(logits, targets)
        ce_sum += (ce * counted).cpu()
        n += counted.cpu()
        top1 += topk_hits(logits, targets, 1).cpu()
        top5 += topk_hits(logits, targets, 5).cpu()
    n = n.clamp(min=1)
    return {"loss": (ce_sum / n).tolist(), "top1": (top1 / n).tolist(),
            "top5": (top5 / n).tolist()}


def save_checkpoint(path: Path, state: dict) -> None:
    """Write beside the final name, then rename: a kill mid-write leaves the old checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device) -> dict:
    if not path.is_file():
        raise UserError(f"--resume: no checkpoint at {path}")
    return torch.load(path, map_location=device, weights_only=True)


def progress(say, step: int, total: int, last: int, rate: float, loss: float, ce, lr: float,
             extra: str = "") -> None:
    """The progress line: every 10 steps, or every step when a step takes over 6 s (rate:
    steps per second)."""
    if step % 10 == 0 or step == last or rate * 60 < 10:
        say(f"step {step}/{total} loss {loss:.3f} per-head CE "
            f"{' '.join(f'{c:.2f}' for c in ce.tolist())}{extra} lr {lr:.2e} "
            f"eta {(last - step) / max(rate, 1e-9) / 60:.1f} min")


def accuracy_line(metrics: dict) -> str:
    return (f"top-1 per head {[round(x, 3) for x in metrics['top1']]} "
            f"top-5 {[round(x, 3) for x in metrics['top5']]}")


# --- Medusa-1: frozen backbone -------------------------------------------------------------

def medusa1_heads(args, model) -> MedusaHeads:
    """Fresh heads in the paper's initialisation or, with --init-heads, trained heads to train
    further (e.g. on new data: heads trained on templated prompts, then on model-written ones)."""
    if args.init_heads is None:
        return MedusaHeads.for_model(model, args.heads, args.layers, args.shared)
    check_out_is_not(args.out, args.init_heads)
    return load_heads(args.init_heads, model).requires_grad_(True)


def check_out_is_not(out: Path, init: Path) -> None:
    if out.resolve() == init.resolve():
        raise UserError(f"--out {out} is the --init-heads folder: training writes a new "
                                "folder and never overwrites the heads it starts from")


def train_frozen(args) -> dict:
    rank, world, device = setup_distributed(args.device)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    folder = args.model or ensure_default_model()
    model = load_model(folder, device, torch.float32)  # frozen: no gradient anywhere in it
    torch.manual_seed(args.seed)
    heads = medusa1_heads(args, model).train()
    cfg = heads.config
    train_rows, val_rows = read_rows(args.data, cfg.medusa_num_heads,
                                     tokenizer_fingerprint(folder), model.config.vocab_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    n_rows = train_rows.targets.shape[0]
    total, last = total_steps(args, n_rows)
    step, log = 0, []
    ckpt = args.out / CHECKPOINT
    if args.resume:
        state = load_checkpoint(ckpt, device)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], json.loads(state["log"])
        say(f"resumed at step {step}")
    ddp_heads = torch.nn.parallel.DistributedDataParallel(heads) if world > 1 else heads
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"training {cfg.medusa_num_heads} heads ({'shared' if cfg.shared_lm_head else 'own'} "
        f"projection{', from ' + str(args.init_heads) if args.init_heads else ''}) on "
        f"{n_rows} positions ({val_rows.targets.shape[0]} held out), "
        f"{total} steps of {args.batch_size}, {world} process(es) on {device}")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    start, first = time.time(), step
    while step < last:
        lr = cosine_lr(step, total, args.warmup, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = batch_rows(n_rows, step, args.batch_size, args.seed)[rank::world]
        optimizer.zero_grad(set_to_none=True)
        for micro in index.chunk(args.grad_accum):
            hidden = train_rows.hidden[micro].to(device, torch.float32)
            targets = train_rows.targets[micro].to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss, ce, _ = medusa_loss(ddp_heads(hidden, model.lm_head), targets)
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), args.clip)
        optimizer.step()
        step += 1
        progress(say, step, total, last, (step - first) / max(time.time() - start, 1e-9),
                 loss.item(), ce, lr)
        if step % args.eval_every == 0 or step == last:
            metrics = evaluate(heads.eval(), model.lm_head, val_rows, device)
            heads.train()
            log.append({"step": step, "train_loss": loss.item(), **metrics})
            say(f"  validation {accuracy_line(metrics)}")
        if rank == 0 and (step % args.save_every == 0 or step == last):
            save_checkpoint(ckpt, {"heads": heads.state_dict(), "step": step,
                                   "optimizer": optimizer.state_dict(), "log": json.dumps(log)})
    if rank == 0:
        save_heads(heads.eval(), args.out, {"base_model_name_or_path": str(folder),
                                            "trained_steps": step})
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    if world > 1:
        dist.destroy_process_group()
    return log[-1] if log else {}


# --- Medusa-2: joint training --------------------------------------------------------------

def starting_heads(args) -> Path:
    """The Medusa-1 heads Medusa-2 starts from (the paper's heads warm-up)."""
    init = args.init_heads or (DEFAULT_HEADS_DIR if args.model is None else None)
    if init is None or not init.is_dir():
        raise UserError(
            "Medusa-2 starts from trained Medusa-1 heads (the paper's heads warm-up): give "
            "--init-heads DIR, made by train.py --frozen" + (f" ({init} does not exist)"
                                                             if init else ""))
    check_out_is_not(args.out, init)
    return init


@torch.no_grad()
def validate_joint(model, heads, answers, teacher: Rows, device) -> dict:
    """Heads' loss and accuracy on the tuned backbone's states, and the KL from the original."""
    student = state_rows(model, answers, heads.config.medusa_num_heads)
    return {**evaluate(heads, model.lm_head, student, device),
            "kl": mean_kl(model.lm_head, teacher, student)}, student


def quality_report(model, heads, init_heads, val_answers, args, device) -> dict:
    """The final validation on every held-out answer, beside the Medusa-1 heads on the original
    backbone, and the quality guard's verdict."""
    K = heads.config.medusa_num_heads
    with adapters_off(model):
        teacher = state_rows(model, val_answers, K)
    medusa1 = evaluate(init_heads, model.lm_head, teacher, device)
    medusa2, student = validate_joint(model, heads, val_answers, teacher, device)
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
            "calibration": head_accuracies(heads, model.lm_head, student)}


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


def train_joint(args) -> dict:
    rank, world, device = setup_distributed(args.device)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    folder = args.model or ensure_default_model()
    init = starting_heads(args)
    model = load_model(folder, device, torch.float32)
    heads = load_heads(init, model).train()
    init_heads = copy.deepcopy(heads).eval()  # the Medusa-1 heads, for the side-by-side report
    K = heads.config.medusa_num_heads
    train_answers, val_answers = split_validation(read_answers(
        args.data, tokenizer_fingerprint(folder), model.config.vocab_size, with_hidden=False))
    torch.manual_seed(args.seed)
    adapters = add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_dropout)
    optimizer = joint_optimizer(adapters, heads, args.lr, args.weight_decay, args.heads_lr_ratio)
    total, last = total_steps(args, len(train_answers))
    lambda_warmup = args.lambda0_warmup or max(1, total // 2)
    step, log = 0, []
    ckpt = args.out / CHECKPOINT
    if args.resume:
        state = load_checkpoint(ckpt, device)
        load_adapter_state(model, state["adapters"])
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], json.loads(state["log"])
        say(f"resumed at step {step}")
    joint = JointModel(model, heads)
    ddp = torch.nn.parallel.DistributedDataParallel(joint) if world > 1 else joint
    params = adapters + list(heads.parameters())
    probe = val_answers[:args.eval_answers]
    with torch.no_grad(), adapters_off(model):
        probe_teacher = state_rows(model, probe, K)
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"Medusa-2: LoRA r={args.lora_rank} on {len(adapters) // 2} layers "
        f"({sum(p.numel() for p in adapters) / 1e6:.1f}M parameters) + {K} heads from {init}, "
        f"{len(train_answers)} answers ({len(val_answers)} held out), {total} steps of "
        f"{args.batch_size}, {world} process(es) on {device}")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    start, first = time.time(), step
    model.train()  # the adapters' dropout
    while step < last:
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, total, args.warmup, group["peak_lr"])
        lam = lambda0(step, lambda_warmup, args.lambda0)
        torch.manual_seed(args.seed * 1_000_003 + step)  # dropout: a resumed run draws the same
        index = batch_rows(len(train_answers), step, args.batch_size, args.seed)[rank::world]
        optimizer.zero_grad(set_to_none=True)
        for micro in index.chunk(args.grad_accum):
            batch = make_batch([train_answers[i] for i in micro.tolist()], K, device)
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                teacher = teacher_log_probs(model, batch)
                logits, head_logits = ddp(batch)
                kl = distill_kl(teacher, logits)
                heads_loss, ce, _ = medusa_loss(head_logits, batch.targets)
                loss = kl + lam * heads_loss
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        step += 1
        progress(say, step, total, last, (step - first) / max(time.time() - start, 1e-9),
                 loss.item(), ce, optimizer.param_groups[0]["lr"],
                 f" KL {kl.item():.4f} lambda0 {lam:.4f}")
        if step % args.eval_every == 0 or step == last:
            model.eval()
            metrics, _ = validate_joint(model, heads.eval(), probe, probe_teacher, device)
            model.train(), heads.train()
            log.append({"step": step, "train_loss": loss.item(), "train_kl": kl.item(),
                        "lambda0": lam, **metrics})
            say(f"  validation ({len(probe)} answers) KL {metrics['kl']:.4f} "
                f"{accuracy_line(metrics)}")
        if rank == 0 and (step % args.save_every == 0 or step == last):
            save_checkpoint(ckpt, {"adapters": adapter_state(model), "heads": heads.state_dict(),
                                   "optimizer": optimizer.state_dict(), "step": step,
                                   "log": json.dumps(log)})
    report = {}
    if rank == 0:
        model.eval(), heads.eval()
        if device.type == "cpu":  # the other processes are done: rank 0 may use their cores
            torch.set_num_threads(min(os.cpu_count(), world * torch.get_num_threads()))
        say(f"final validation on {len(val_answers)} held-out answers and the quality guard")
        report = quality_report(model, heads, init_heads, val_answers, args, device)
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
        save_joint(model, heads, folder, args.out, report, args, step)
        m1, m2 = report["medusa1_heads_original_backbone"], report["medusa2"]
        say(f"Medusa-1 heads, original backbone: {accuracy_line(m1)}")
        say(f"Medusa-2 heads, tuned backbone:    {accuracy_line(m2)}")
        say(f"wrote {args.out}/model (merged backbone), the heads and adapters.safetensors; "
            f"generate with: python generate.py --model {args.out}/model --heads {args.out}")
    if world > 1:
        dist.destroy_process_group()
    return report


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


@entry_point
def main(argv=None):
    args = parse_args(argv)
    if args.frozen:
        train_frozen(args)
        return
    report = train_joint(args)
    if report:
        verdict = quality_verdict(report)
        print(verdict, file=sys.stderr)
        if not report["good"]:
            sys.exit(2)


if __name__ == "__main__":
    main()

"""Train Medusa heads on a frozen backbone (Medusa-1, paper section 4) from self-distilled data.

    python -m minimedusa.self_distill --out data/distill          # the model answers seed prompts
    python train.py --frozen --data data/distill --out weights/my-heads
    python train.py --frozen --data data/distill --out weights/my-heads --resume
    torchrun --nproc_per_node 2 train.py --frozen --data data/distill --out weights/my-heads

Loss sum_k 0.8^k CE(head k, token t+k+1) over answer tokens only; AdamW, cosine schedule with
warm-up, gradient clipping and accumulation, bf16 autocast on CUDA, a validation split, per-head
loss and top-1/top-5 accuracy. A checkpoint is written atomically every --save-every steps and at
the end; --resume continues exactly where it stopped. Under torchrun, every process takes its
share of each batch and DistributedDataParallel averages the gradients.
"""
import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minimedusa.default_model import ensure_default_model
from minimedusa.device import pick_device
from minimedusa.heads import MedusaHeads, save_heads
from minimedusa.self_distill import tokenizer_fingerprint
from minimedusa.training import (DataError, Rows, cosine_lr, medusa_loss, read_rows,
                                 topk_hits)
from minimedusa.weights import WeightsError, load_model

CHECKPOINT = "checkpoint.pt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train Medusa heads (Medusa-1: frozen backbone) on "
                                "self-distilled data.")
    p.add_argument("--frozen", action="store_true",
                   help="Medusa-1: the backbone stays frozen, only the heads learn (required: "
                   "joint training, Medusa-2, is a separate mode)")
    p.add_argument("--data", type=Path, required=True,
                   help="self-distillation folder made by python -m minimedusa.self_distill")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: the heads, train_log.json and the checkpoint")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Llama folder the data was made with (default: the default model)")
    p.add_argument("--heads", type=int, default=4, help="number of heads K (default: 4)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head (default: 1)")
    p.add_argument("--shared", action="store_true",
                   help="heads share the backbone's LM head instead of own projections")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default: 1)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="rows (answer positions) per optimizer step (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="split each batch into this many micro-batches (default: 1)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
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
                   help="bfloat16 autocast for the heads' matrix products (default: on for "
                   "CUDA, off for the CPU; on this project's AMX-capable 2-core CPU a step of "
                   "256 rows x 5 shared heads took 1.1 s with it, 1.6 s without)")
    return p.parse_args(argv)


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


def batch_rows(rows: Rows, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The row indices of optimizer step `step`: determined by the step alone, so that a
    resumed run sees exactly the batches the uninterrupted one would."""
    n_rows = rows.targets.shape[0]
    epoch, i = divmod(step, n_rows // batch_size)
    return epoch_order(n_rows, seed, epoch)[i * batch_size:(i + 1) * batch_size]


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


def save_checkpoint(path: Path, heads, optimizer, step: int, log: list) -> None:
    """Write beside the final name, then rename: a kill mid-write leaves the old checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "log": json.dumps(log)}, tmp)
    os.replace(tmp, path)


def train(args) -> dict:
    rank, world, device = setup_distributed(args.device)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    folder = args.model or ensure_default_model()
    model = load_model(folder, device, torch.float32)  # frozen: no gradient anywhere in it
    train_rows, val_rows = read_rows(args.data, args.heads, tokenizer_fingerprint(folder),
                                     model.config.vocab_size)
    torch.manual_seed(args.seed)
    heads = MedusaHeads.for_model(model, args.heads, args.layers, args.shared).train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = math.ceil(args.epochs * (train_rows.targets.shape[0] // args.batch_size))
    if total == 0:
        raise DataError(f"{args.data} has fewer rows than one batch of {args.batch_size}")
    last = min(total, args.max_steps or total)
    step, log = 0, []
    ckpt = args.out / CHECKPOINT
    if args.resume:
        if not ckpt.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
        state = torch.load(ckpt, map_location=device, weights_only=True)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], json.loads(state["log"])
        say(f"resumed at step {step}")
    ddp_heads = torch.nn.parallel.DistributedDataParallel(heads) if world > 1 else heads
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"training {args.heads} heads ({'shared' if args.shared else 'own'} projection) on "
        f"{train_rows.targets.shape[0]} positions ({val_rows.targets.shape[0]} held out), "
        f"{total} steps of {args.batch_size}, {world} process(es) on {device}")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    start, first = time.time(), step
    while step < last:
        lr = cosine_lr(step, total, args.warmup, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = batch_rows(train_rows, step, args.batch_size, args.seed)[rank::world]
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
        if step % 10 == 0 or step == last:
            rate = (step - first) / max(time.time() - start, 1e-9)  # steps per second
            say(f"step {step}/{total} loss {loss.item():.3f} per-head CE "
                f"{' '.join(f'{c:.2f}' for c in ce.tolist())} lr {lr:.2e} "
                f"eta {(last - step) / max(rate, 1e-9) / 60:.1f} min")
        if step % args.eval_every == 0 or step == last:
            metrics = evaluate(heads.eval(), model.lm_head, val_rows, device)
            heads.train()
            log.append({"step": step, "train_loss": loss.item(), **metrics})
            say(f"  validation top-1 per head {[round(x, 3) for x in metrics['top1']]} "
                f"top-5 {[round(x, 3) for x in metrics['top5']]}")
        if rank == 0 and (step % args.save_every == 0 or step == last):
            save_checkpoint(ckpt, heads, optimizer, step, log)
    if rank == 0:
        save_heads(heads.eval(), args.out, {"base_model_name_or_path": str(folder),
                                            "trained_steps": step})
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    if world > 1:
        dist.destroy_process_group()
    return log[-1] if log else {}


def main(argv=None):
    args = parse_args(argv)
    if not args.frozen:
        sys.exit("error: only Medusa-1 (--frozen: the backbone stays frozen, the heads learn) "
                 "is implemented; joint training of backbone and heads (Medusa-2) is a separate "
                 "mode that does not exist yet")
    try:
        train(args)
    except (DataError, WeightsError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

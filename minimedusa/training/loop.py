"""What both training modes (train.py's Medusa-1, medusa2.py's Medusa-2) share around the loop:
the batches' order (fixed by the step alone, so that a resumed run sees exactly the batches the
uninterrupted one would), the steps a run spans, a step's losses, one process or several under
torchrun, 
"""
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minimedusa.assembly.device import pick_device
from minimedusa.training.medusa1 import DataError

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


@dataclass
class Losses:
    """One micro-batch's losses: the one minimised and what the progress line and log show."""
    total: torch.Tensor  # scalar: what the optimizer minimises
    ce: torch.Tensor  # (K,) per-head CE
    log: dict  # the mode's own numbers for train_log.json (Medusa-2: KL and lambda_0)
    text: str  # the same for the progress line

    def progress(self, step: int, total: int, lr: float) -> str:
        ce = " ".join(f"{c:.2f}" for c in self.ce.tolist())
        return f"step {step}/{total} loss {self.total.item():.3f} per-head CE {ce}{self.text} " \
            f"lr {lr:.2e}"


def accuracy_line(metrics: dict) -> str:
    return (f"top-1 per head {[round(x, 3) for x in metrics['top1']]} "
            f"top-5 {[round(x, 3) for x in metrics['top5']]}")


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

"""Medusa-2's loss (paper sections 4, 5): the backbone's KL from the original model plus the
heads' Medusa-1 loss, over whole answers; medusa2.py makes it a training mode.

    L = KL( p_original,t || p_t ) + lambda_0(step) * sum_k 0.8^k CE( p_t^(k), y_{t+k+1} )

Here: the batch of whole sequences (prompt + answer, losses at the answer positions), the
backbone's states and the KL, lambda_0's sine warm-up, the optimizer with differential learning
rates (heads 4x the adapters'), and the KL / accuracy the quality guard and validation read.

Shapes: B sequences, T padded length, N answer positions in the batch, C model dim, K heads,
V vocab.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimedusa.model import causal_mask
from minimedusa.training.lora import adapters_off
from minimedusa.training.medusa1 import Rows, head_metrics, head_targets


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) prompt + answer[:-1], right-padded (causal: padding unseen)
    rows: tuple[torch.Tensor, torch.Tensor]  # (N,) sequence index, (N,) position: answer rows
    targets: torch.Tensor  # (N, K) head k's target y_{t+k+1}, or IGNORE


def make_batch(answers: list[tuple], num_heads: int, device) -> Batch:
    """answers: (prompt ids, answer ids, _) each. Row i of an answer is the position whose state
    predicts answer[i] (position len(prompt) - 1 + i), exactly the rows Medusa-1 trains on."""
    seqs = [torch.cat([p, a[:-1]]) for p, a, _ in answers]
    tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    seq_index = torch.cat([torch.full((len(a),), b) for b, (_, a, _) in enumerate(answers)])
    position = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(a)) for p, a, _ in answers])
    targets = torch.cat([head_targets(a, num_heads) for _, a, _ in answers])
    return Batch(tokens.to(device), (seq_index.to(device), position.to(device)),
                 targets.to(device))


def answer_states(model, batch: Batch) -> torch.Tensor:
    """The last hidden state at every answer row: (N, C)."""
    B, T = batch.tokens.shape
    positions = torch.arange(T, device=batch.tokens.device).expand(B, T)
    hidden = model.hidden_states(batch.tokens, positions, causal_mask(0, T, batch.tokens.device))
    return hidden[batch.rows]


class JointModel(nn.Module):
    """Backbone (with adapters) and heads as one module: what DistributedDataParallel wraps,
    so that the adapters' and the heads' gradients are averaged across processes."""

    def __init__(self, model, heads):
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, batch: Batch):
        """(backbone logits (N, V), head logits (K, N, V)) at the answer rows."""
        hidden = answer_states(self.model, batch)
        return self.model.lm_head(hidden), self.heads(hidden, self.model.lm_head)


@torch.no_grad()
def teacher_log_probs(model, batch: Batch) -> torch.Tensor:
    """log p_original at the answer rows (N, V) float32: the model with its adapters off."""
    with adapters_off(model):
        return F.log_softmax(model.lm_head(answer_states(model, batch)).float(), dim=-1)


def distill_kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p_original || p) = sum_v p_orig (log p_orig - log p), in nats."""
    return F.kl_div(F.log_softmax(student_logits.float(), dim=-1), teacher_logp,
                    log_target=True, reduction="batchmean")


def lambda0(step: int, warmup: int, peak: float) -> float:
    """The heads' loss weight: peak * sin(pi/2 * progress) over `warmup` steps, then peak."""
    return peak * math.sin(math.pi / 2 * min(1.0, (step + 1) / max(1, warmup)))


def joint_optimizer(adapters: list, heads: nn.Module, lr: float, weight_decay: float,
                    heads_lr_ratio: float = 4.0):
    """AdamW with two groups: the adapters at lr, the heads at heads_lr_ratio x lr (paper: 4x).
    Each group keeps its peak in "peak_lr"; the schedule scales both alike."""
    groups = [{"params": adapters, "peak_lr": lr},
              {"params": list(heads.parameters()), "peak_lr": heads_lr_ratio * lr}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)


@torch.no_grad()
def state_rows(model, answers: list[tuple], num_heads: int, batch_size: int = 8) -> Rows:
    """The model's hidden states at every answer row, as Medusa-1 rows (hidden, targets): what
    the Medusa-1 tools (evaluation, calibration) read, made by the tuned backbone."""
    hidden, targets = [], []
    for a in range(0, len(answers), batch_size):
        batch = make_batch(answers[a:a + batch_size], num_heads, model.lm_head.weight.device)
        hidden.append(answer_states(model, batch).cpu())
        targets.append(batch.targets.cpu())
    return Rows(torch.cat(hidden), torch.cat(targets))


@torch.no_grad()
def mean_kl(lm_head, teacher: Rows, student: Rows, student_head=None, batch_size: int = 512
            ) -> float:
    """Mean next-token KL(p_original || p) over rows whose states the two models computed
    (the student's through its own LM head when it has one, e.g. in another dtype)."""
    student_head = student_head or lm_head
    total = 0.0
    for a in range(0, teacher.hidden.shape[0], batch_size):
        logp = F.log_softmax(lm_head(teacher.hidden[a:a + batch_size].to(
            lm_head.weight.device, lm_head.weight.dtype)).float(), dim=-1)
        total += distill_kl(logp, student_head(student.hidden[a:a + batch_size].to(
            student_head.weight.device, student_head.weight.dtype))).item() * logp.shape[0]
    return total / teacher.hidden.shape[0]


@torch.no_grad()
def joint_metrics(model, heads, answers: list[tuple], teacher: Rows, device) -> tuple[dict, Rows]:
    """(the heads' loss and accuracy on the tuned backbone's states with the KL from the original,
    those states as rows). teacher: the original model's states at the same rows."""
    student = state_rows(model, answers, heads.config.medusa_num_heads)
    return {**head_metrics(heads, model, student, device),
            "kl": mean_kl(model.lm_head, teacher, student)}, student

"""Medusa-2: joint training of the backbone (through LoRA) and the heads (paper sections 4, 5).

    L = KL( p_original,t || p_t ) + lambda_0(step) * sum_k 0.8^k CE( p_t^(k), y_{t+k+1} )

The backbone's own loss is self-distillation: the KL from the ORIGINAL model's next-token
distribution (there is no original training data), and the original model is the same model
with its adapters switched off (lora.adapters_off), so no second copy is held. lambda_0 rises
from 0 with a sine schedule so that the heads' loss, large at first, cannot drag the backbone
away before the KL has a say. The heads start from Medusa-1 heads (heads warm-up) and learn 4x
faster than the adapters (differential learning rates).

Unlike Medusa-1, the hidden states change as the backbone learns, so they cannot be read from
the data: every step runs the backbone over whole sequences (prompt + answer), twice (teacher
without gradient, student with), and the losses are taken at the answer positions only.
Here: Medusa-2 as a training mode (its flags, setup, loss, validation, quality guard and saved
files); its batches, losses and optimizer are joint_loss.py's; the training loop, shared with
Medusa-1, is train.py's.

Shapes: B sequences, T padded length, N answer positions in the batch, C model dim, K heads,
V vocab.
"""
import argparse
import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from safetensors.torch import save_file

from minimedusa.files.heads_files import CALIBRATION, load_heads, save_heads
from minimedusa.files.outputs import check_out_is_not, write_atomically, write_json
from minimedusa.cli.flags import dropout, non_negative, non_negative_int, positive, positive_int
from minimedusa.files.default_model import PAPER_HEADS_DIR, ensure_default_model
from minimedusa.errors import UserError
from minimedusa.heads import MedusaHeads
from minimedusa.training.lora import (adapter_state, adapters_off, add_adapters, load_adapter_state,
                             merge_adapters)
from minimedusa.model import Llama
from minimedusa.training.joint_loss import (JointModel, distill_kl, joint_metrics, joint_optimizer,
                                            lambda0, make_batch, mean_kl, state_rows,
                                            teacher_log_probs)
from minimedusa.training.quality_guard import (greedy_agreement, original_in_bfloat16,
                                               quality_verdict)
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.training.medusa1 import (Rows, head_metrics, medusa_loss, read_answers,
                                         split_validation)
from minimedusa.training.loop import Losses, accuracy_line, batch_rows, distributed, total_steps
from minimedusa.training.tree_search import head_accuracies
from minimedusa.files.weights import load_model, save_model




# --- Medusa-2 as train.py's training mode -------------------------------------------------------

def add_flags(p) -> None:
    """train.py's flags of Medusa-2 (without --frozen)."""
    m2 = p.add_argument_group("Medusa-2 (without --frozen)")
    m2.add_argument("--answers-per-batch", type=positive_int, default=8,
                    help="whole answers per optimizer step (default: 8)")
    m2.add_argument("--lora-lr", type=positive, default=5e-4,
                    help="the adapters' peak learning rate (default: 5e-4, the paper's)")
    m2.add_argument("--heads-lr-ratio", type=positive, default=4.0,
                    help="the heads' learning rate over the adapters' (default: 4, the paper's)")
    m2.add_argument("--lora-rank", type=positive_int, default=32,
                    help="adapter rank r (default: 32)")
    m2.add_argument("--lora-alpha", type=positive, default=16.0,
                    help="adapter scale alpha; the update is alpha/r B A (default: 16)")
    m2.add_argument("--lora-dropout", type=dropout, default=0.05,
                    help="dropout on the adapters' input (default: 0.05)")
    m2.add_argument("--lambda0", type=non_negative, default=0.01,
                    help="peak weight of the heads' loss beside the KL (default: 0.01, the "
                    "paper's value with self-distillation)")
    m2.add_argument("--lambda0-warmup", type=non_negative_int, default=None,
                    help="steps over which lambda_0 rises as a sine from 0 to --lambda0 "
                    "(default: half the run)")
    m2.add_argument("--max-kl", type=non_negative, default=0.05,
                    help="quality guard: the run is good only if the mean next-token KL from "
                    "the original model on held-out answers stays below this, in nats "
                    "(default: 0.05; quality.json reports beside it the KL of the original "
                    "model run in bfloat16, a change people accept as the same model)")
    m2.add_argument("--eval-answers", type=positive_int, default=64,
                    help="held-out answers used by the periodic validation (the final one "
                    "uses all; default: 64)")
    m2.add_argument("--guard-prompts", type=positive_int, default=32,
                    help="held-out prompts for the greedy agreement check (default: 32)")


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

    def batch(self, step: int) -> torch.Tensor:
        """The step's answers (whole answers: the backbone runs over each)."""
        return batch_rows(self.rows(), step, self.batch_size(), self.args.seed)

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
    adapters = adapter_state(model)
    write_atomically(out / "adapters.safetensors", lambda tmp: save_file(
        adapters, tmp, metadata={"rank": str(args.lora_rank), "alpha": str(args.lora_alpha)}))
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

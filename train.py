"""Train Medusa heads: Medusa-1 (frozen backbone, this file) or Medusa-2
(training/medusa2.py).

    python train.py --frozen                                              # from the model alone
    python -m minimedusa.training.self_distill --out data/distill        # or: the data first,
    python train.py --frozen --data data/distill --out weights/my-heads  # then Medusa-1 on it
    python train.py --data data/distill --out data/medusa2 --init-heads weights/my-heads

Medusa-1 (paper section 4), in the order it runs: the data (h_t at every answer position, stored
with the self-distilled answers: the backbone is frozen), the heads, the loss sum_k 0.8^k
CE(head k, token t+k+1), AdamW with warm-up and cosine decay, the step, the validation and an
atomic checkpoint that --resume continues from exactly. Medusa-2 (medusa2.Medusa2) is a
second mode of the same loop. Without --data, --frozen runs pipeline.py: data, training, trees.
"""
import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from minimedusa.errors import entry_point, quiet_interrupt

with quiet_interrupt():  # torch loads for seconds: Ctrl-C there ends in one line too
    import torch
    import torch.distributed as dist

    from minimedusa import experiments
    from minimedusa.training import medusa2, pipeline
    from minimedusa.training.train_flags import parse_args
    from minimedusa.files.checkpoint import (CHECKPOINT, checkpoint_on_interrupt, resume,
                                             save_checkpoint)
    from minimedusa.files.outputs import lock_folder, write_atomically
    from minimedusa.training.progress import progress_bar, say
    from minimedusa.files.default_model import ensure_default_model
    from minimedusa.training.head_rows import StoredRows, rows_for
    from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads, token_ranking
    from minimedusa.files.heads_files import save_draft_vocab, save_heads
    from minimedusa.model import Llama
    from minimedusa.training.self_distill import tokenizer_fingerprint
    from minimedusa.training.medusa1 import (cosine_lr, distill_loss, draft_columns,
                                             head_logits, head_metrics, medusa1_heads,
                                             medusa_loss, read_meta, teacher_states)
    from minimedusa.training.loop import (Losses, accuracy_line, distributed, setup_distributed,
                                          total_steps)
    from minimedusa.files.weights import load_model

# --- Medusa-1: the data, the heads, the loss, the optimizer ---------------------------------

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
    data: StoredRows  # the rows (head_rows.py: as stored, or a kind's own, e.g. Hydra++'s)
    optimizer: torch.optim.Optimizer
    ranking: tuple[torch.Tensor, torch.Tensor]  # the answers' token ids by frequency, counts
    vocabulary: DraftVocabulary | None  # with --draft-vocab: the tokens the heads rank

    def rows(self) -> int:
        return self.data.train.targets.shape[0]

    def batch_size(self) -> int:
        return self.args.batch_size

    def batch(self, step: int) -> torch.Tensor:
        """The step's rows: shuffled rows, or as the heads' kind draws them (Hydra++: from a
        few whole answers, which its draft layer reads whole)."""
        return self.data.batch(step, self.batch_size(), self.args.seed)

    def peak_lrs(self) -> list[float]:
        return [self.args.lr]

    def loss(self, step: int, index: torch.Tensor) -> Losses:
        """sum_k 0.8^k CE(head k, y_{t+k+1}) at the batch's rows (with --distill, CE against the
        backbone's distribution at t + k)."""
        rows = self.data.train
        hidden = self.data.hidden(self.heads, index, self.device)  # (B, C): h_t (or f_t)
        targets = rows.targets[index].to(self.device)  # (B, K)
        tokens = rows.tokens[index].to(self.device)  # (B, K): read by Hydra heads
        logits = head_logits(self.trained, hidden, tokens, self.model, self.vocabulary)
        if self.args.distill:
            teacher = teacher_states(rows.hidden, index, targets.shape[1])
            loss, ce, _ = distill_loss(logits, teacher.to(self.device, torch.float32), targets,
                                       self.model.lm_head, self.vocabulary)
        else:
            loss, ce, _ = medusa_loss(logits, draft_columns(targets, self.vocabulary))
        return Losses(loss, ce, {}, "")

    def evaluate(self) -> tuple[dict, str]:
        self.heads.eval()
        val = self.data.held_out(self.heads, self.device)
        metrics = head_metrics(self.heads, self.model, val, self.device,
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
    data = rows_for(heads).read(model, args.data, tokenizer_fingerprint(folder), heads, device,
                                world)
    train_rows, val_rows = data.train, data.val
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ranking = token_ranking(train_rows.tokens[:, 0])  # column 0: every answer token once
    vocabulary = (DraftVocabulary(ranking[0][:args.draft_vocab].sort().values, model.lm_head)
                  if args.draft_vocab else None)
    intro = (f"training {cfg.medusa_num_heads} {cfg.head_kind} heads "
             f"({'shared' if cfg.shared_lm_head else 'own'}"
             f" projection{', from ' + str(args.init_heads) if args.init_heads else ''}) on "
             f"{train_rows.targets.shape[0]} positions ({val_rows.targets.shape[0]} held out)"
             f"{data.words}"
             f"{', against the backbone distribution (--distill)' if args.distill else ''}")
    if vocabulary is not None:
        covered = ranking[1][:args.draft_vocab].sum() / ranking[1].sum()
        intro += f", ranking a draft vocabulary of {args.draft_vocab} tokens ({covered:.1%} of " \
            "them)"
    return Medusa1(args, device, folder, intro, model, heads, distributed(heads, world), data,
                   optimizer, ranking, vocabulary)


# --- the loop both modes share: the step, validation, checkpoint ----------------------------

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
    """Train `mode` (Medusa1, or medusa2.Medusa2) from step 0 or the checkpoint to the
    last step, validating every --eval-every steps and checkpointing every --save-every; returns
    the step it stopped at."""
    total, last = total_steps(args, mode.rows(), mode.batch_size())
    step, log = resume(mode, args.out / CHECKPOINT, device, say) if args.resume else (0, [])
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"{mode.intro}, {total} steps of {mode.batch_size()}, {world} process(es) on {device}")
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=bf16)
    show, first = progress_bar() if rank == 0 else None, step
    with checkpoint_on_interrupt(world == 1) as interrupted:
        while step < last:
            index = mode.batch(step)[rank::world]
            losses = train_step(mode, args, step, total, index, autocast)
            step += 1
            if show is not None:  # group 0: the heads (Medusa-1), the adapters (Medusa-2)
                lr = mode.optimizer.param_groups[0]["lr"]
                show(step - first, last - first, losses.progress(step, total, lr))
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
        write_atomically(args.out / "train_log.json",
                         lambda tmp: tmp.write_text(json.dumps(log, indent=2) + "\n"))
    return step


@entry_point
def main(argv=None):
    args = parse_args(argv)
    experiments.register_training()  # Hydra++'s heads and training rows (--kind hydra++)
    if args.data is None:
        return pipeline.from_model(args, medusa1, train_loop)
    read_meta(args.data)  # a folder that is not self-distilled data: one line, before loading
    if os.environ.get("RANK", "0") == "0":  # under torchrun, the first process holds it
        lock_folder(args.out, "train.py")
    rank, world, device = setup_distributed(args.device)
    tell = say if rank == 0 else (lambda msg: None)
    mode = (medusa1 if args.frozen else medusa2.medusa2)(args, device, world)
    step = train_loop(mode, args, rank, world, device, tell)
    good = mode.finish(step, tell) if rank == 0 else True
    if world > 1:
        # note: every process waits for rank 0's finish (it alone saves) and the group is torn
        # down by all of them together: a rank that left first could abort on gloo's threads
        # as it exited ("terminate called without an active exception", seen under load)
        dist.barrier()
        dist.destroy_process_group()
    if not good:
        sys.exit(2)


if __name__ == "__main__":
    main()

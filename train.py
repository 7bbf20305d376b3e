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

from minimedusa.errors import UserError, entry_point, quiet_interrupt

with quiet_interrupt():  # torch loads for seconds: Ctrl-C there ends in one line too
    import torch
    import torch.distributed as dist

    from minimedusa.training import medusa2, pipeline
    from minimedusa.files.checkpoint import (CHECKPOINT, checkpoint_on_interrupt, resume,
                                             save_checkpoint)
    from minimedusa.files.outputs import lock_folder, write_atomically
    from minimedusa.cli.flags import (Parser, non_negative, non_negative_int, positive,
                                      positive_int, seed_int)
    from minimedusa.training.progress import progress_bar, say
    from minimedusa.files.default_model import ensure_default_model
    from minimedusa.experiments.draft_layer import HydraPlusPlusHeads
    from minimedusa.training.draft_layer_rows import (ANSWERS_PER_BATCH, AnswerRows, answer_rows,
                                                      featured_rows)
    from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads, token_ranking
    from minimedusa.files.heads_files import save_draft_vocab, save_heads
    from minimedusa.model import Llama
    from minimedusa.training.self_distill import tokenizer_fingerprint
    from minimedusa.training.medusa1 import (Rows, add_flags as add_medusa1_flags, cosine_lr,
                                             distill_loss, draft_columns, head_logits,
                                             head_metrics, medusa1_heads, medusa_loss,
                                             read_answers, read_meta, read_rows,
                                             split_validation,
                                             teacher_states)
    from minimedusa.training.loop import (Losses, accuracy_line, batch_rows, distributed,
                                          setup_distributed, total_steps)
    from minimedusa.files.weights import load_model

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
    train_rows: Rows
    val_rows: Rows
    optimizer: torch.optim.Optimizer
    ranking: tuple[torch.Tensor, torch.Tensor]  # the answers' token ids by frequency, counts
    vocabulary: DraftVocabulary | None  # with --draft-vocab: the tokens the heads rank
    # Hydra++: the rows with their prompts' states (train, validation)
    answers: tuple[AnswerRows, AnswerRows] | None = None

    def rows(self) -> int:
        return self.train_rows.targets.shape[0]

    def batch_size(self) -> int:
        return self.args.batch_size

    def batch(self, step: int) -> torch.Tensor:
        """The step's rows: shuffled rows, or (Hydra++) rows drawn from a few whole answers,
        which the draft layer reads whole."""
        if self.answers is None:
            return batch_rows(self.rows(), step, self.batch_size(), self.args.seed)
        return self.answers[0].sample_rows(step, self.batch_size(), self.args.seed)

    def peak_lrs(self) -> list[float]:
        return [self.args.lr]

    def loss(self, step: int, index: torch.Tensor) -> Losses:
        """sum_k 0.8^k CE(head k, y_{t+k+1}) at the batch's rows (with --distill, CE against the
        backbone's distribution at t + k)."""
        if self.answers is None:
            hidden = self.train_rows.hidden[index].to(self.device, torch.float32)  # (B, C)
        else:  # the draft layer reads the rows' answers whole
            hidden = self.answers[0].features_at(self.heads.draft_layer, index, self.device)
        targets = self.train_rows.targets[index].to(self.device)  # (B, K)
        tokens = self.train_rows.tokens[index].to(self.device)  # (B, K): read by Hydra heads
        logits = head_logits(self.trained, hidden, tokens, self.model, self.vocabulary)
        if self.args.distill:
            teacher = teacher_states(self.train_rows.hidden, index, targets.shape[1])
            loss, ce, _ = distill_loss(logits, teacher.to(self.device, torch.float32), targets,
                                       self.model.lm_head, self.vocabulary)
        else:
            loss, ce, _ = medusa_loss(logits, draft_columns(targets, self.vocabulary))
        return Losses(loss, ce, {}, "")

    def evaluate(self) -> tuple[dict, str]:
        self.heads.eval()
        val = self.val_rows if self.answers is None else featured_rows(self.heads,
                                                                       self.answers[1],
                                                                       self.device)
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
    answers = None
    if isinstance(heads, HydraPlusPlusHeads):
        if world > 1:
            raise UserError("--kind hydra++ trains in one process (its draft layer runs outside "
                            "DistributedDataParallel's forward): run train.py without torchrun")
        say("computing the prompts' hidden states for the draft layer")
        answers = tuple(answer_rows(model, part, cfg.medusa_num_heads, device)
                        for part in split_validation(read_answers(
                            args.data, tokenizer_fingerprint(folder), model.config.vocab_size)))
        train_rows, val_rows = answers[0].rows, answers[1].rows
    else:
        train_rows, val_rows = read_rows(args.data, cfg.medusa_num_heads,
                                         tokenizer_fingerprint(folder), model.config.vocab_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ranking = token_ranking(train_rows.tokens[:, 0])  # column 0: every answer token once
    vocabulary = (DraftVocabulary(ranking[0][:args.draft_vocab].sort().values, model.lm_head)
                  if args.draft_vocab else None)
    intro = (f"training {cfg.medusa_num_heads} {cfg.head_kind} heads "
             f"({'shared' if cfg.shared_lm_head else 'own'}"
             f" projection{', from ' + str(args.init_heads) if args.init_heads else ''}) on "
             f"{train_rows.targets.shape[0]} positions ({val_rows.targets.shape[0]} held out)"
             f"{f', {ANSWERS_PER_BATCH} whole answers a batch' if answers else ''}"
             f"{', against the backbone distribution (--distill)' if args.distill else ''}")
    if vocabulary is not None:
        covered = ranking[1][:args.draft_vocab].sum() / ranking[1].sum()
        intro += f", ranking a draft vocabulary of {args.draft_vocab} tokens ({covered:.1%} of " \
            "them)"
    return Medusa1(args, device, folder, intro, model, heads, distributed(heads, world),
                   train_rows, val_rows, optimizer, ranking, vocabulary, answers)


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

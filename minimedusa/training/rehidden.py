"""Move self-distillation data as token ids, and recompute its hidden states where it lands.

A shard's hidden states are most of its size: C bf16 values a token (1,152 bytes for SmolLM2),
against 4 bytes for the token's id. To train on another machine (a GPU), copy the ids alone
(`--ids-only`) and recompute the states there. The frozen backbone makes this exact up to
rounding: the state that predicts answer token i is the last hidden state at the token before
it, whether self_distill.py saved it while answering, one step a token, or one teacher-forced
forward over prompt + answer computes it, as here (tests/training/test_rehidden.py checks
they agree).

    python -m minimedusa.training.rehidden data/distill --out moved/distill --ids-only
    python -m minimedusa.training.rehidden moved/distill --out data/distill --device cuda

The states are computed in the dtype the data was made in (its meta.json), so that training
reads what it would have read on the machine that answered. Resumable: written shards are kept.

Shapes: B answers in a shard, T prompt + answer tokens, C model dim.
"""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from minimedusa.assembly.device import pick_device
from minimedusa.cli.flags import Parser
from minimedusa.errors import UserError, entry_point, unreadable
from minimedusa.files.default_model import ensure_default_model
from minimedusa.files.outputs import followed, lock_folder, write_atomically
from minimedusa.files.weights import load_model
from minimedusa.training.joint_loss import answer_states, make_batch
from minimedusa.training.medusa1 import DataError, read_meta
from minimedusa.training.progress import progress_bar
from minimedusa.training.self_distill import save_shard, tokenizer_fingerprint


def read_shard(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A shard's answers, (prompt ids (p,), answer ids (n,)) each, its states left out."""
    try:
        with safe_open(path, framework="pt") as st:
            prompts, p_off = st.get_tensor("prompt_ids"), st.get_tensor("prompt_offsets").tolist()
            answers, a_off = st.get_tensor("answer_ids"), st.get_tensor("answer_offsets").tolist()
    except Exception as e:  # safetensors reports truncation/corruption with varied types
        raise DataError(unreadable(path, e)) from None
    return [(prompts[pa:pb].long(), answers[a:b].long())
            for pa, pb, a, b in zip(p_off[:-1], p_off[1:], a_off[:-1], a_off[1:])]


@torch.no_grad()  # not inference_mode: Hydra++ trains on what this returns, under autograd
def teacher_forced_hidden(model, answers: list[tuple]) -> list[torch.Tensor]:
    """answers: (prompt ids (p,), answer ids (n,)) each. Per answer, its (n, C) states on the
    CPU: row i is the last hidden state at the token before answer token i (the prompt's last
    token, then answer tokens 0..n-2). One forward for them all: Medusa-2's batch of whole
    answers (joint_loss.make_batch: right-padded, which the causal mask keeps out of every real
    token's view) and its states at the answer rows (joint_loss.answer_states)."""
    device = model.embed.weight.device
    batch = make_batch([(p, a, None) for p, a in answers], 1, device)
    states = answer_states(model, batch).cpu()  # (N, C), answer after answer
    return list(states.split([len(a) for _, a in answers]))


def rehidden(src: Path, out: Path, model, progress) -> None:
    """Write every shard of `src` not yet in `out`: ids alone where `model` is None, else with
    the model's states."""
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("shard-*.safetensors"))
    todo = [s for s in shards if not (out / s.name).is_file()]
    for done, shard in enumerate(todo, start=1):
        answers = read_shard(shard)
        rows = [{"prompt_ids": p.tolist(), "answer_ids": a.tolist()} for p, a in answers]
        if model is not None:
            for r, h in zip(rows, teacher_forced_hidden(model, answers)):
                r["hidden"] = h
        save_shard(out / shard.name, rows)
        progress(done, len(todo), shard.name)


@entry_point
def main(argv=None):
    p = Parser(description="Copy a self-distillation folder as token ids alone (--ids-only), or "
               "recompute its hidden states from its token ids with the model that made it.")
    p.prog = "python -m minimedusa.training.rehidden"
    p.add_argument("src", type=Path, help="a self-distillation folder (self_distill.py's)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (made if "
                   "missing; shards already there are kept)")
    p.add_argument("--ids-only", action="store_true", help="copy the token ids without the "
                   "hidden states (to move the data; a few MB instead of GBs)")
    p.add_argument("--model", type=Path, default=None, help="the HF Llama folder the data was "
                   "made with (default: the default model)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    args = p.parse_args(argv)
    meta = read_meta(args.src)
    if not any(args.src.glob("shard-*.safetensors")):
        raise UserError(f"no shards in {args.src}: nothing to copy")
    args.out = followed(args.out)
    if args.out.resolve() == args.src.resolve():
        raise UserError("--out is the source folder: give another one")
    lock_folder(args.out, "rehidden")
    model = None
    if not args.ids_only:
        folder = args.model or ensure_default_model()
        if tokenizer_fingerprint(folder) != meta.get("tokenizer"):
            raise UserError(f"{args.src} was made with another tokenizer than {folder}'s")
        # eager, as read: a decoding model's compiled step (CUDA graphs) would cost minutes of
        # warm-up here, and only hidden_states runs
        model = load_model(folder, pick_device(args.device),
                           getattr(torch, meta.get("dtype", "float32"))).eval()
    write_atomically(args.out / "meta.json",
                     lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
    rehidden(args.src, args.out, model, progress_bar())


if __name__ == "__main__":
    main()

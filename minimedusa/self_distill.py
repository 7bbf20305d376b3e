"""Self-distillation data (paper section 5): the model answers seed prompts itself, batched.

The heads must predict the model's own output distribution, so the model's own answers are the
right training data, and they need no dataset. Prompts are batched with LEFT padding in one
static KV cache: every row's last prompt token sits in the same slot, so each decoding step is
one (B, 1) forward; a row's positions start at 0 at its first real token, and its mask hides
its padding slots. Each step's last hidden state is saved with the answer: it is exactly what
the frozen backbone would recompute for training (paper: "its hidden states can be computed
once and reused").

The prompts: the project's seed prompts (templates x topics, `minimedusa/seed_prompts.py`), or,
with `--prompts model`, user turns the model writes itself: it samples what follows
`<|im_start|>user` in its own chat template. Templated prompts are many but alike, and heads
trained on their answers learn the templates' answers: on unseen seed prompts the shipped heads'
first guess was accepted 56% of the time, on MT-Bench only 24%. Heads calibrated on answers to
model-written turns predict their MT-Bench acceptance within a few percent (weights/RESULTS.md,
"Speed").

Output: a folder of shards (shard-00000.safetensors, ...) plus meta.json; the run resumes by
skipping finished shards. Each shard holds, for its prompts, the token ids and for every answer
token the hidden state that predicts it (the state at the token before it).

    python -m minimedusa.self_distill --out data/distill --limit 512
    python -m minimedusa.self_distill --out data/distill-mw --prompts model --limit 512

Shapes: B batch, P padded prompt length, T steps, C model dim.
"""
import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from minimedusa.cli import add_device_arguments, device_and_dtype
from minimedusa.default_model import ensure_default_model
from minimedusa.errors import UserError, entry_point
from minimedusa.kv_cache import KVCache
from minimedusa.sampling import Sampling, make_generator, next_token
from minimedusa.seed_prompts import seed_prompts
from minimedusa.tokenizer import Tokenizer
from minimedusa.weights import load_model


def left_pad(prompts: list[list[int]], pad_id: int):
    """(tokens (B, P), positions (B, P), pad (B,)): each row right-aligned at slot P - 1."""
    P = max(map(len, prompts))
    pad = torch.tensor([P - len(p) for p in prompts])  # (B,)
    tokens = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])  # (B, P)
    positions = (torch.arange(P).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)  # (B, P)
    return tokens, positions, pad


def padded_mask(pad: torch.Tensor, n_query: int, n_slots: int) -> torch.Tensor:
    """(B, T, S) bool for the last n_query of n_slots tokens: causal, blind to each row's padding.

    note: a padding token still sees itself; a row that sees nothing would make attention's
    softmax NaN, and NaN keys would poison every row through 0 * NaN.
    """
    q = torch.arange(n_slots - n_query, n_slots).view(1, -1, 1)  # (1, T, 1) query slots
    s = torch.arange(n_slots).view(1, 1, -1)  # (1, 1, S)
    real = s >= pad.view(-1, 1, 1)  # (B, 1, S)
    return ((s <= q) & real) | (s == q)


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int], pad_id: int, generator):
    """Answer B prompts at once. Returns, per row, (answer ids, hidden (n, C)): hidden[i] is the
    last hidden state at the token before answer[i], the state from which the LM head predicted
    answer[i] and from which head k must predict answer[i + k]."""
    device = model.embed.weight.device
    tokens, positions, pad = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = tokens.shape
    cache = KVCache.for_model(model, capacity=P + max_new_tokens, batch_size=B)
    hidden = model.hidden_states(tokens, positions, padded_mask(pad, P, P), cache,
                                 cache.slots(0, P))[:, -1:]  # (B, 1, C)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,) next positions
    answers, states, done = [[] for _ in prompts], [hidden], [False] * B
    for t in range(max_new_tokens):
        token = next_token(model.lm_head(hidden[:, -1]), sampling, generator)  # (B,)
        ids = token.tolist()  # the host sync of the step: who has stopped
        for b in range(B):
            if not done[b]:
                answers[b].append(ids[b])
                done[b] = ids[b] in stop_ids
        if all(done) or t == max_new_tokens - 1:
            break
        slot = P + t
        hidden = model.hidden_states(token.unsqueeze(1), (lengths + t).unsqueeze(1),
                                     padded_mask(pad, 1, slot + 1), cache,
                                     cache.slots(slot, 1))  # (B, 1, C)
        states.append(hidden)
    states = torch.cat(states, dim=1)  # (B, T, C)
    return [(a, states[b, :len(a)]) for b, a in enumerate(answers)]


def write_user_turns(model, tokenizer: Tokenizer, batch_size: int, max_tokens: int,
                     generator) -> list[str]:
    """One batch of user turns written by the model: samples (temperature 1, top-p 0.95) of
    what follows `<|im_start|>user`. Only finished turns of 3 words or more are kept: a turn
    cut at max_tokens is half a question."""
    opening = tokenizer.encode(tokenizer.user_turn_opening())
    stop_ids = model.config.stop_ids
    rows = answer_batch(model, [opening] * batch_size, max_tokens, Sampling(1.0, 0.95),
                        stop_ids, pad_id=0, generator=generator)
    turns = [tokenizer.decode(ids[:-1]).strip() for ids, _ in rows if ids[-1] in stop_ids]
    return [t for t in turns if len(t.split()) >= 3]


def model_written_prompts(model, tokenizer: Tokenizer, n: int, folder: Path, batch_size: int,
                          seed: int, say) -> list[dict]:
    """n distinct user turns written by the model, made batch by batch into
    folder/user_turns.jsonl (one line per batch, the file replaced whole after each), so a
    killed run resumes where it stopped and makes the same turns."""
    path, device = folder / "user_turns.jsonl", model.embed.weight.device
    batches = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    distinct = lambda: list(dict.fromkeys(t for b in batches for t in b))  # noqa: E731
    max_batches = 10 * (n // batch_size + 1)
    while len(distinct()) < n:
        if len(batches) == max_batches:
            raise RuntimeError(f"the model finished only {len(distinct())} distinct user turns "
                               f"in {max_batches} batches (of {n} asked)")
        generator = make_generator(device, seed + len(batches))  # per batch: resuming is exact
        batches.append(write_user_turns(model, tokenizer, batch_size, 96, generator))
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(b) + "\n" for b in batches))
        tmp.rename(path)
        say(f"[user turns] {min(len(distinct()), n)}/{n} written")
    return [{"category": "model-written", "prompt": t} for t in distinct()[:n]]


def tokenizer_fingerprint(folder: Path) -> str:
    """Data made with one tokenizer is meaningless for another: training checks this."""
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()[:16]


def save_shard(path: Path, rows: list[dict]) -> None:
    """One file per batch: flat int32 token ids with offsets, and the hidden states (bf16).
    Written beside its final name and renamed, so a killed run leaves no half shard."""
    prompt_ids = [torch.tensor(r["prompt_ids"], dtype=torch.int32) for r in rows]
    answer_ids = [torch.tensor(r["answer_ids"], dtype=torch.int32) for r in rows]
    offsets = lambda xs: torch.tensor([0] + [len(x) for x in xs]).cumsum(0)  # noqa: E731
    tensors = {"prompt_ids": torch.cat(prompt_ids), "prompt_offsets": offsets(prompt_ids),
               "answer_ids": torch.cat(answer_ids), "answer_offsets": offsets(answer_ids),
               "hidden": torch.cat([r["hidden"] for r in rows]).to(torch.bfloat16).contiguous()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(path)


def same_settings(old: dict, new: dict) -> bool:
    """Shards made with these settings may be reused. The prompt count may grow: the prompt
    order is fixed by the seed, so a larger --limit only appends batches to a run whose last
    batch was full (a short last batch would be a different shard in the longer run)."""
    keep = lambda meta: {"prompts_from": "templates",  # noqa: E731 (older folders lack it)
                         **{k: v for k, v in meta.items() if k != "prompts"}}
    grows = new["prompts"] > old["prompts"] and old["prompts"] % old["batch_size"] == 0
    return keep(old) == keep(new) and (new["prompts"] == old["prompts"] or grows)


@entry_point
def main():
    p = argparse.ArgumentParser(description="Self-distillation data: the default model (or "
                                "--model) answers the seed prompts, batched; resumable.")
    p.add_argument("--out", type=Path, required=True, help="output folder (shards + meta.json)")
    p.add_argument("--model", type=Path, default=None, help="HF Llama folder (default: the "
                   "default model)")
    p.add_argument("--prompts", choices=["templates", "model"], default="templates",
                   help="templates: the project's seed prompts (default); model: the model "
                   "writes the user turns itself, --limit of them, kept in OUT/user_turns.jsonl")
    p.add_argument("--limit", type=int, default=None, help="answer only the first N prompts "
                   "(with --prompts model: how many the model writes; required)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per batch "
                   "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="answer length cap (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy answers (default), as the heads will be used with greedy "
                   "decoding; > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="prompt shuffle and sampling seed")
    add_device_arguments(p)
    args = p.parse_args()
    if args.prompts == "model" and not args.limit:
        p.error("--prompts model needs --limit N: how many user turns the model writes")

    device, dtype = device_and_dtype(args)
    folder = args.model or ensure_default_model()
    model, tokenizer = load_model(folder, device, dtype), Tokenizer.from_folder(folder)
    templated = seed_prompts(args.seed)[:args.limit] if args.prompts == "templates" else None
    n_prompts = args.limit if templated is None else len(templated)
    meta = {"model": str(folder), "tokenizer": tokenizer_fingerprint(folder),
            "prompts_from": args.prompts, "prompts": n_prompts, "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "seed": args.seed, "dtype": str(dtype).removeprefix("torch.")}
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / "meta.json"
    if meta_path.is_file() and not same_settings(json.loads(meta_path.read_text()), meta):
        raise UserError(f"{args.out} holds data made with other settings; use another --out")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    prompts = templated if templated is not None else model_written_prompts(
        model, tokenizer, args.limit, args.out, args.batch_size, args.seed, say)

    stop_ids = model.config.stop_ids
    sampling = Sampling(args.temperature, 1.0, args.seed)
    n_batches = (len(prompts) + args.batch_size - 1) // args.batch_size
    start, tokens_done = time.time(), 0
    for i in range(n_batches):
        path = args.out / f"shard-{i:05d}.safetensors"
        if path.is_file():
            continue  # resume: this batch is done
        batch = prompts[i * args.batch_size:(i + 1) * args.batch_size]
        ids = [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": x["prompt"]}]))
               for x in batch]
        generator = make_generator(device, args.seed + i)  # per batch: resuming is exact
        answers = answer_batch(model, ids, args.max_new_tokens, sampling, stop_ids,
                               pad_id=0, generator=generator)  # any id: padding is masked
        save_shard(path, [{"prompt_ids": p, "answer_ids": a, "hidden": h}
                          for p, (a, h) in zip(ids, answers)])
        tokens_done += sum(len(a) for a, _ in answers)
        rate = tokens_done / (time.time() - start)
        say(f"[{i + 1}/{n_batches}] {tokens_done} answer tokens this run, {rate:.0f} tokens/s")


if __name__ == "__main__":
    main()

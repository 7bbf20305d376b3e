"""Self-distillation data (paper section 5): the model answers seed prompts itself, batched.

The heads must predict the model's own output distribution, so the model's own answers are the
right training data, and they need no dataset. Prompts are answered in batches as
batch_decoding.py decodes them: each row its own sequence in one static KV cache, its prompt
prefilled alone, then one (B, 1) forward a step, each row at its own slots; a row's answer is
the one the model gives that prompt alone. Each step's last hidden state is saved with the
answer: it is exactly what the frozen backbone would recompute for training (paper: "its
hidden states can be computed once and reused").

The prompts: the project's seed prompts (templates x topics, `training/seed_prompts.py`), or,
with `--prompts model`, user turns the model writes itself: it samples what follows
`<|im_start|>user` in its own chat template. Templated prompts are many but alike, and heads
trained on their answers learn the templates' answers: on unseen seed prompts the shipped heads'
first guess was accepted 56% of the time, on MT-Bench only 24%. Heads calibrated on answers to
model-written turns predict their MT-Bench acceptance within a few percent (weights/HISTORY.md,
"Speed").

Output: a folder of shards (shard-00000.safetensors, ...) plus meta.json; the run resumes by
skipping finished shards. Each shard holds, for its prompts, the token ids and for every answer
token the hidden state that predicts it (the state at the token before it).

    python -m minimedusa.training.self_distill --out data/distill --limit 512
    python -m minimedusa.training.self_distill --out data/distill-mw --prompts model --limit 512

Shapes: B batch, T steps, C model dim.
"""
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from minimedusa.batch_decoding import batch_step
from minimedusa.decoding import prefill
from minimedusa.files.outputs import followed, lock_folder, write_atomically
from minimedusa.cli.flags import (Parser, add_device_arguments, non_negative, positive_int,
                                  seed_int)
from minimedusa.assembly.load import device_and_dtype
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.training.progress import progress_bar, say
from minimedusa.files.default_model import ensure_default_model
from minimedusa.errors import UserError, entry_point
from minimedusa.kv_cache import KVCache
from minimedusa.acceptance import Sampling, make_generator
from minimedusa.training.seed_prompts import seed_prompts
from minimedusa.files.tokenizer import Tokenizer, read_json_object


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int], generator):
    """Answer B prompts at once. Returns, per row, (answer ids, hidden (n, C)): hidden[i] is the
    last hidden state at the token before answer[i], the state from which the LM head predicted
    answer[i] and from which head k must predict answer[i + k]. The rows are batch_decoding's:
    each prompt prefilled alone in its row of one cache, then one step a token for the rows
    still answering, each at its own slots; so a row's greedy answer is the one generate.py
    gives it alone. A finished row leaves the cache (KVCache.keep_rows): the step's cost is its
    rows', and answers end at very different lengths (the default model's average answer is 3/4
    of the cap). Every row still draws a token each step, finished or not (from its last
    logits, unused), so that a row's draws from the one generator the rows share do not depend
    on when the others end (write_user_turns' rows share their prompt)."""
    device = model.embed.weight.device
    cache = KVCache.for_model(model, capacity=max(map(len, prompts)) + max_new_tokens,
                              batch_size=len(prompts))
    logits, hidden = zip(*(prefill(model, cache.row(b), torch.tensor([ids], device=device))
                           for b, ids in enumerate(prompts)))  # (1, V) and (P_b, C) each
    logits = torch.cat(logits)  # (B, V): each row's latest
    states = [[h[-1]] for h in hidden]  # per row, the (C,) states before its answer's tokens
    lengths = [len(p) for p in prompts]  # each row's cached tokens
    answers, live = [[] for _ in prompts], list(range(len(prompts)))  # live: the cache's rows
    for t in range(max_new_tokens):
        token = sampling.pick(logits, generator)  # (B,)
        ids = token.tolist()  # the host sync of the step: who has stopped
        for b in live:
            answers[b].append(ids[b])
        going = [b for b in live if ids[b] not in stop_ids]
        if not going or t == max_new_tokens - 1:
            break
        if len(going) < len(live):
            cache.keep_rows([live.index(b) for b in going])
            live = going
        step_logits, hidden = batch_step(model, cache, token[live].unsqueeze(1),
                                         [lengths[b] for b in live])  # (L, V), (L, C)
        logits[live] = step_logits
        for b, h in zip(live, hidden):
            states[b].append(h)
            lengths[b] += 1
    return [(a, torch.stack(states[b][:len(a)])) for b, a in enumerate(answers)]


def write_user_turns(model, tokenizer: Tokenizer, batch_size: int, max_tokens: int,
                     generator) -> list[str]:
    """One batch of user turns written by the model: samples (temperature 1, top-p 0.95) of
    what follows `<|im_start|>user`. Only finished turns of 3 words or more are kept: a turn
    cut at max_tokens is half a question."""
    opening = tokenizer.encode(tokenizer.user_turn_opening())
    stop_ids = model.config.stop_ids
    rows = answer_batch(model, [opening] * batch_size, max_tokens, Sampling(1.0, 0.95),
                        stop_ids, generator)
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
        write_atomically(path, lambda tmp: tmp.write_text("".join(json.dumps(b) + "\n"
                                                                  for b in batches)))
        say(f"[user turns] {min(len(distinct()), n)}/{n} written")
    return [{"category": "model-written", "prompt": t} for t in distinct()[:n]]


def answering_model(folder: Path, device, dtype):
    """The model that answers, loaded as generate.py loads it in that dtype, eager: its products
    prepacked where that pays on a CPU (speed/packed_linear.py; answering never trains it, so
    the packed copy stays right). 64 seed prompts x 48 tokens on the 2-core AVX2 EPYC: 34.9 /
    39.9 s -> 30.6 / 32.1 s, the same 64 answers."""
    from minimedusa.speed.weight_formats import dtype_format
    model, _ = decoding_model(Recipe(folder=folder, device=device,
                                     weight_format=dtype_format(dtype)))
    return model


def tokenizer_fingerprint(folder: Path) -> str:
    """Data made with one tokenizer is meaningless for another: training checks this."""
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()[:16]


def save_shard(path: Path, rows: list[dict]) -> None:
    """One file per batch: flat int32 token ids with offsets, and the hidden states (bf16)
    where the rows have them (rehidden.py moves shards without). Written beside its final name
    and renamed, so a killed run leaves no half shard."""
    prompt_ids = [torch.tensor(r["prompt_ids"], dtype=torch.int32) for r in rows]
    answer_ids = [torch.tensor(r["answer_ids"], dtype=torch.int32) for r in rows]
    offsets = lambda xs: torch.tensor([0] + [len(x) for x in xs]).cumsum(0)  # noqa: E731
    tensors = {"prompt_ids": torch.cat(prompt_ids), "prompt_offsets": offsets(prompt_ids),
               "answer_ids": torch.cat(answer_ids), "answer_offsets": offsets(answer_ids)}
    if "hidden" in rows[0]:
        tensors["hidden"] = torch.cat([r["hidden"] for r in rows]).to(torch.bfloat16).contiguous()
    write_atomically(path, lambda tmp: save_file(tensors, tmp))


def same_settings(old: dict, new: dict) -> bool:
    """Shards made with these settings may be reused. The prompt count may grow: the prompt
    order is fixed by the seed, so a larger --limit only appends batches to a run whose last
    batch was full (a short last batch would be a different shard in the longer run)."""
    keep = lambda meta: {"prompts_from": "templates", "samples": 1,  # noqa: E731 (older
                         **{k: v for k, v in meta.items() if k != "prompts"}}  # folders lack them)
    answers = old["prompts"] * old.get("samples", 1)
    grows = new["prompts"] > old["prompts"] and answers % old["batch_size"] == 0
    return keep(old) == keep(new) and (new["prompts"] == old["prompts"] or grows)


@dataclass
class Settings:
    """How the data is made; a folder made with other settings is never mixed with new shards."""
    prompts_from: str = "templates"  # or "model": the model writes the user turns
    limit: int | None = None  # answer only the first N prompts
    batch_size: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy answers, as the heads will be used
    seed: int = 0
    samples: int = 1  # answers a prompt (sampled: each draws its own tokens)


def open_folder(out: Path, folder: Path, settings: Settings, n_prompts: int, dtype) -> None:
    """Check that `out` holds no data made otherwise, and write its meta.json."""
    meta = {"model": str(folder), "tokenizer": tokenizer_fingerprint(folder),
            "prompts_from": settings.prompts_from, "prompts": n_prompts,
            **{k: getattr(settings, k) for k in ("batch_size", "max_new_tokens", "temperature",
                                                 "seed", "samples")},
            "dtype": str(dtype).removeprefix("torch.")}
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    if meta_path.is_file() and not same_settings(read_json_object(meta_path), meta):
        raise UserError(f"{out} holds data made with other settings; use another --out")
    write_atomically(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))


def prompt_ids(tokenizer: Tokenizer, batch: list[dict]) -> list[list[int]]:
    """Each prompt as the model sees it: a user turn in the model's chat template."""
    return [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": x["prompt"]}]))
            for x in batch]


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.safetensors"


def pending_batches(out: Path, prompts: list[dict],
                    batch_size: int) -> list[tuple[int, list[dict]]]:
    """[(batch index, its prompts)] of the batches whose shard is not written yet."""
    batches = [prompts[a:a + batch_size] for a in range(0, len(prompts), batch_size)]
    return [(i, b) for i, b in enumerate(batches) if not shard_path(out, i).is_file()]


@torch.inference_mode()
def batch_seconds(model, tokenizer: Tokenizer, batch: list[dict], settings: Settings,
                  repeats: int = 5) -> float:
    """The expected time of one batch, timed on it: the prompts' forward, then max_new_tokens - 1
    decoding steps of the cost of one at mid-answer (the median of `repeats`, after a warm-up).
    A batch of many answers runs to max_new_tokens: one of them at least goes on that long (the
    default model's 2,048 answers in batches of 64: every one of the 32 batches did)."""
    ids, device = prompt_ids(tokenizer, batch), model.embed.weight.device
    prompts_forward = lambda: answer_batch(model, ids, 1, Sampling(), set(), None)  # noqa: E731
    prompts_forward()
    start = time.perf_counter()
    prompts_forward()
    seconds = time.perf_counter() - start
    # one decoding step at mid-answer: B rows of one token, each seeing its whole answer so
    # far, in a cache of answer_batch's capacity
    cache = KVCache.for_model(model, capacity=max(map(len, ids)) + settings.max_new_tokens,
                              batch_size=len(ids))
    token = torch.zeros(len(ids), 1, dtype=torch.long, device=device)  # (B, 1)
    lengths = [len(p) + settings.max_new_tokens // 2 - 1 for p in ids]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        logits, _ = batch_step(model, cache, token, lengths)
        Sampling().pick(logits, None).tolist()
        times.append(time.perf_counter() - start)
    step = sorted(times[1:])[repeats // 2]
    return seconds + (settings.max_new_tokens - 1) * step


def distill(model, tokenizer: Tokenizer, out: Path, prompts: list[dict], settings: Settings,
            progress) -> None:
    """Answer every prompt whose batch has no shard in `out` yet, one shard per batch; each
    prompt `settings.samples` times, its answers side by side (the rows draw from their batch's
    generator, seeded by the batch: each answer its own draws)."""
    device = model.embed.weight.device
    sampling = Sampling(settings.temperature, 1.0, settings.seed)
    prompts = [p for p in prompts for _ in range(settings.samples)]
    todo = pending_batches(out, prompts, settings.batch_size)
    n_batches = -(-len(prompts) // settings.batch_size)
    start, tokens_done = time.time(), 0
    for done, (i, batch) in enumerate(todo, start=1):
        ids = prompt_ids(tokenizer, batch)
        generator = make_generator(device, settings.seed + i)  # per batch: resuming is exact
        answers = answer_batch(model, ids, settings.max_new_tokens, sampling,
                               model.config.stop_ids, generator)
        save_shard(shard_path(out, i), [{"prompt_ids": p, "answer_ids": a, "hidden": h}
                                        for p, (a, h) in zip(ids, answers)])
        tokens_done += sum(len(a) for a, _ in answers)
        rate = tokens_done / (time.time() - start)
        progress(done, len(todo), f"shard {i + 1}/{n_batches}, {tokens_done} answer tokens "
                 f"this run, {rate:.0f}/s")


@entry_point
def main():
    p = Parser(description="Self-distillation data: the default model (or --model) answers the "
               "seed prompts, batched; resumable.")
    p.prog = "python -m minimedusa.training.self_distill"  # as typed (else argparse names the file)
    p.add_argument("--out", type=Path, required=True, help="output folder (shards + meta.json)")
    p.add_argument("--model", type=Path, default=None, help="HF Llama folder (default: the "
                   "default model)")
    p.add_argument("--prompts", choices=["templates", "model"], default="templates",
                   help="templates: the project's seed prompts (default); model: the model "
                   "writes the user turns itself, --limit of them, kept in OUT/user_turns.jsonl")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="answer only the first N prompts "
                   "(with --prompts model: how many the model writes; required)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="prompts per batch "
                   "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="answer length cap (default: %(default)s)")
    p.add_argument("--temperature", type=non_negative, default=0.0,
                   help="0 = greedy answers (default), as the heads will be used with greedy "
                   "decoding; > 0 samples")
    p.add_argument("--seed", type=seed_int, default=0, help="prompt shuffle and sampling seed")
    p.add_argument("--samples", type=positive_int, default=1, help="answers a prompt, each "
                   "sampled anew (with --temperature > 0; default: %(default)s)")
    add_device_arguments(p)
    args = p.parse_args()
    if args.prompts == "model" and not args.limit:
        p.error("--prompts model needs --limit N: how many user turns the model writes")
    if args.samples > 1 and args.temperature == 0:
        p.error("--samples N > 1 needs --temperature > 0: greedy answers to one prompt are one")

    args.out = followed(args.out)  # a link: the shards land where it points
    lock_folder(args.out, "self-distillation")
    device, dtype = device_and_dtype(args)
    folder = args.model or ensure_default_model()
    model, tokenizer = answering_model(folder, device, dtype), Tokenizer.from_folder(folder)
    settings = Settings(args.prompts, args.limit, args.batch_size, args.max_new_tokens,
                        args.temperature, args.seed, args.samples)
    templated = seed_prompts(args.seed)[:args.limit] if args.prompts == "templates" else None
    open_folder(args.out, folder, settings, args.limit if templated is None else len(templated),
                dtype)
    prompts = templated if templated is not None else model_written_prompts(
        model, tokenizer, args.limit, args.out, args.batch_size, args.seed, say)
    distill(model, tokenizer, args.out, prompts, settings, progress_bar())


if __name__ == "__main__":
    main()

"""Step latency, measured on this machine and cached: what each tree size costs here.

The Budget (budget.py) weighs each tree size's expected tokens per step against its step
latency, a fact of the machine (its vector units, memory bandwidth, caches) and of how the
step runs (weight format, compiled or not, C kernels): the 4-node tree tuned on one 2-core
"AMD EPYC" ran at 0.97x plain decoding on another that reports the same name but has AVX2
only. So each size's latency, plain decoding (size 0) included, is measured at first use on
this machine (a few seconds) and cached per key (latency_key: the machine, how the step runs,
the model's and the heads' shapes) under the user's cache folder, never in the repository.
A damaged cache is measured again and replaced; one that cannot be written still decodes.
"""
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from minimedusa.acceptance import greedy_for
from minimedusa.decoding import decode_step, medusa_step, new_cache, prefill
from minimedusa.draft import TreeDraft
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads, PlusPlusDraft
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.sampling import greedy_tokens
from minimedusa.speed.c_kernels import sources_digest
from minimedusa.speed.cache_folder import cache_folder
from minimedusa.speed.machine import machine_key
from minimedusa.speed.plug_in import how_it_runs
from minimedusa.speed.weight_formats import format_of
from minimedusa.tree import MedusaTree


def cached_prefix(model, prompt_len: int) -> int:
    """The prefix step_latency times steps after: prompt_len tokens, at most half the model's
    context (a small model's steps still fit after it)."""
    return min(prompt_len, model.config.max_position_embeddings // 2)


def step_latency(model, heads, trees: dict[int, MedusaTree], prompt_len: int = 256,
                 repeats: int = 8) -> dict[int, float]:
    """Seconds per step for each tree of `trees` and for a plain step (size 0). Sizes are timed
    round-robin so that machine noise hits all of them alike; the median of `repeats` rounds is
    kept. Every step starts from the same cached prefix of prompt_len random tokens."""
    device = model.embed.weight.device
    prompt_len = cached_prefix(model, prompt_len)
    cache = new_cache(model, prompt_len, 1, margin=max(trees, default=0) + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    draft = timed_draft(heads, trees, model)
    draft.start(prompt.tolist()[0], cache)
    _, hidden = prefill(model, cache, prompt)
    features = draft.read(hidden)

    def timer(n):
        def seconds():
            cache.rewind(prompt_len)  # every size starts from the same prefix
            if isinstance(draft, PlusPlusDraft):  # and so does a draft layer's cache
                draft.cache.rewind(prompt_len)
            return time_one_step(model, draft, n, cache, features)
        return seconds
    return round_robin_medians({n: timer(n) for n in [0, *trees]}, repeats)


def timed_draft(heads, trees: dict[int, MedusaTree], model):
    """The draft decoding runs these heads' trees with (fused where it fuses: fast_draft), whose
    steps are timed: a draft layer's (Hydra++) feeds the layer every step too."""
    draft = fast_draft(TreeDraft(heads, trees), model)
    return PlusPlusDraft(draft) if isinstance(heads, HydraPlusPlusHeads) else draft


def round_robin_medians(timers: dict, rounds: int) -> dict:
    """{key: the median of `rounds` calls of timers[key]() (each returns its seconds)}, the
    timers taking turns round by round so that machine noise hits all of them alike; a first
    round warms up, uncounted (the first product of a shape is slow)."""
    times = {key: [] for key in timers}
    for r in range(rounds + 1):
        for key, seconds in timers.items():
            elapsed = seconds()
            if r > 0:
                times[key].append(elapsed)
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}


def time_one_step(model, draft, n: int, cache, features) -> float:
    """Seconds of one step of n nodes: the draft and the tree forward, or (n 0) a plain step;
    and what the draft reads of the kept positions."""
    if model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if n == 0:
        logits, kept = decode_step(model, cache, torch.zeros(1, 1, dtype=torch.long,
                                                             device=cache.device))
        greedy_tokens(logits).item()  # the token and host sync a plain step makes too
    else:
        tree, tokens, _ = draft.tree(model, n, 0, features, {})
        _, _, kept = medusa_step(model, tree, cache, tokens, greedy_for(cache.device), None)
    draft.read(kept)
    return time.perf_counter() - start


def cache_file() -> Path:
    """Where measured step latencies are kept: in the cache folder (cache_folder.py)."""
    return cache_folder() / "step_latency.json"


def latency_key(model, heads, device, dtype) -> str:
    """The machine, how the step runs (plug_in.how_it_runs: latencies cached by a version of
    this code that ran it otherwise are not reused; and the C kernels' sources: a faster kernel
    is timed anew), the model's shapes and the heads' (their kind, their format, and how many
    tokens they rank)."""
    m, h = model.config, heads.config
    vocab = "" if heads.vocabulary is None else f", draft vocabulary {heads.vocabulary.ids.numel()}"
    return (f"{machine_key(device, dtype)}{how_it_runs(model)} | kernels {sources_digest()}"
            f" | model {m.num_hidden_layers}x{m.hidden_size}"
            f"x{m.intermediate_size}, vocab {m.vocab_size} | {h.head_kind} heads "
            f"{h.medusa_num_heads}x{h.medusa_num_layers}{' shared' if h.shared_lm_head else ''}"
            f"{vocab}, {format_of(heads)}")


def read_cache_file() -> tuple[dict, str | None]:
    """(every cached entry, None); no file reads as ({}, None). A damaged file (not UTF-8, not
    JSON, not {key: {size: seconds}}) or one that cannot be read gives ({}, why): never
    trusted, its latencies are measured again and it is replaced."""
    path = cache_file()
    if not path.is_file():
        return {}, None
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 (UnicodeDecodeError), not JSON
        return {}, f"{type(e).__name__}: {e}"
    problem = shape_problem(cached)
    return ({}, problem) if problem else (cached, None)


def shape_problem(cached) -> str | None:
    """Why a cache file's JSON is not {key: {size: seconds}}, or None. note: a latency of 0,
    NaN or infinity counts as damage too: the budget divides by it."""
    if not isinstance(cached, dict):
        return f"a JSON {type(cached).__name__}, not an object"
    for key, entry in cached.items():
        if not isinstance(entry, dict) or not all(
                n.isdecimal() and is_seconds(s) for n, s in entry.items()):
            return f"the entry {key[:80]!r} is not {{size: seconds}}"
    return None


def is_seconds(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def read_cached(key: str) -> dict[int, float]:
    """The cached seconds per step of each size under `key`; none ({}) where the file is
    damaged, which a line on stderr says (its sizes are then measured again)."""
    cached, problem = read_cache_file()
    if problem is not None:
        print(f"minimedusa: the step-latency cache {cache_file()} was damaged ({problem}); "
              "measured again", file=sys.stderr)
    return {int(n): s for n, s in cached.get(key, {}).items()}


def write_cached(key: str, latency: dict[int, float]) -> None:
    """Merge into the cache file (a damaged one is replaced: read_cached has said so), written
    beside its final name and renamed. Where it cannot be written the decoding goes on: a line
    on stderr says the latencies were not kept, why, and what to do."""
    path = cache_file()
    cached, _ = read_cache_file()
    cached[key] = {**cached.get(key, {}), **{str(n): s for n, s in latency.items()}}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cached, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:  # a read-only folder, MINIMEDUSA_CACHE naming a file, a full disk
        with contextlib.suppress(OSError):
            tmp.unlink()  # a half-written one (where the folder itself is not the problem)
        print(f"minimedusa: the step latencies measured here were not kept: {path} cannot be "
              f"written ({type(e).__name__}: {e}); set MINIMEDUSA_CACHE to a writable folder",
              file=sys.stderr)


def machine_latency(model, heads, trees: dict[int, MedusaTree], repeats: int = 3):
    """(seconds per step of each size, "cached" or "measured here"): measured once per machine
    (a few seconds), then read from the cache."""
    weight = model.embed.weight
    key = latency_key(model, heads, weight.device, weight.dtype)
    cached = read_cached(key)
    if all(n in cached for n in [0, *trees]):
        return {n: cached[n] for n in [0, *trees]}, "cached"
    latency = step_latency(model, heads, trees, repeats=repeats)
    write_cached(key, latency)
    return latency, "measured here"

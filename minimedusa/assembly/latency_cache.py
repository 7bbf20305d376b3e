"""Step latencies kept per machine: measured once (step_latency.py, a few seconds), then read
back from the user's cache folder, never the repository, under a key of all they depend on
(latency_key: the machine, how the step runs, the model's and the heads' shapes, and what the
timing ran: the run's draft and acceptance). A damaged
cache is measured again and replaced; one that cannot be written still decodes.
"""
import contextlib
import json
import math
import os
import sys
from pathlib import Path

from minimedusa.speed.cache_folder import cache_folder
from minimedusa.speed.machine import machine_key
from minimedusa.speed.plug_in import how_it_runs, kernels_version
from minimedusa.speed.weight_formats import weight_format
from minimedusa.assembly.step_latency import step_latency


def cache_file() -> Path:
    """Where measured step latencies are kept: in the cache folder (cache_folder.py)."""
    return cache_folder() / "step_latency.json"


def latency_key(model, draft, acceptance) -> str:
    """The machine, how the step runs (plug_in.how_it_runs: latencies cached by a version of
    this code that ran it otherwise are not reused; and the C kernels' sources: a faster kernel
    is timed anew), the model's shapes, what drafts (drafter_words) and what the timing ran:
    the draft's kind (its heads' top-k, drawn candidates, fused, a draft model's chain) and the
    acceptance rule (a drawn draft's rule costs more a step)."""
    weight, m = model.embed.weight, model.config
    return (f"{machine_key(weight.device, weight.dtype)}{how_it_runs(model)} | kernels "
            f"{kernels_version()} | {type(draft).__name__}, {acceptance.name} acceptance"
            f" | model {shape(m)} | {drafter_words(draft)}")


def shape(config) -> str:
    return (f"{config.num_hidden_layers}x{config.hidden_size}x{config.intermediate_size}, "
            f"vocab {config.vocab_size}")


def drafter_words(draft) -> str:
    """What proposes the candidates: the heads (their kind, their format, how many tokens they
    rank), or a draft model (its shapes and how its step runs)."""
    if not hasattr(draft, "heads"):  # speculative_decoding's drafts: a model of their own
        return f"draft model {shape(draft.model.config)}{how_it_runs(draft.model)}"
    heads = draft.heads
    h = heads.config
    vocab = "" if heads.vocabulary is None else f", draft vocabulary {heads.vocabulary.ids.numel()}"
    return (f"{h.head_kind} heads {h.medusa_num_heads}x{h.medusa_num_layers}"
            f"{' shared' if h.shared_lm_head else ''}{vocab}, {weight_format(heads).name}")


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


def machine_latency(model, draft, acceptance, sizes, repeats: int = 3):
    """(seconds per step of each size, "cached" or "measured here") for the run's draft and
    acceptance (recipe.build's): measured once per machine (a few seconds), then read from the
    cache."""
    key = latency_key(model, draft, acceptance)
    cached = read_cached(key)
    if all(n in cached for n in [0, *sizes]):
        return {n: cached[n] for n in [0, *sizes]}, "cached"
    latency = step_latency(model, draft, acceptance, sizes, repeats=repeats)
    write_cached(key, latency)
    return latency, "measured here"

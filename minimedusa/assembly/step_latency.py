"""Step latency, measured on this machine: what each tree size costs here.

The Budget (budget.py) weighs each tree size's expected tokens per step against its step
latency, a fact of the machine (its vector units, memory bandwidth, caches) and of how the
step runs (weight format, compiled or not, C kernels): the 4-node tree tuned on one 2-core
"AMD EPYC" ran at 0.97x plain decoding on another that reports the same name but has AVX2
only. So each size's latency, plain decoding (size 0) included, is measured at first use on
this machine (a few seconds) and cached per machine (latency_cache.py).
"""
import time

import torch

from minimedusa.acceptance import Acceptance
from minimedusa.decoding import medusa_step, new_cache, prefill, root_step
from minimedusa.kv_cache import KVCache
from minimedusa.model import causal_mask


def cached_prefix(model, prompt_len: int) -> int:
    """The prefix step_latency times steps after: prompt_len tokens, at most half the model's
    context (a small model's steps still fit after it)."""
    return min(prompt_len, model.config.max_position_embeddings // 2)


def step_latency(model, draft, acceptance: Acceptance, sizes, prompt_len: int = 256,
                 repeats: int = 8) -> dict[int, float]:
    """Seconds per step for each tree size of `sizes` and for a plain step (size 0), of the
    run's own draft and acceptance (the recipe's: recipe.build). Sizes are timed round-robin so
    that machine noise hits all of them alike; the median of `repeats` rounds is kept. Every
    step starts from the same cached prefix of prompt_len random tokens."""
    device = model.embed.weight.device
    prompt_len = cached_prefix(model, prompt_len)
    cache = new_cache(model, prompt_len, 1, margin=max(sizes, default=0) + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    draft.start(prompt.tolist()[0], cache)
    _, hidden = prefill(model, cache, prompt)
    features = draft.read(hidden)

    def timer(n):
        def seconds():
            cache.rewind(prompt_len)  # every size starts from the same prefix
            return time_one_step(model, draft, acceptance, n, cache, features)
        return seconds
    return round_robin_medians({n: timer(n) for n in [0, *sizes]}, repeats)


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


def time_one_step(model, draft, acceptance: Acceptance, n: int, cache, features) -> float:
    """Seconds of one step of n nodes as the decoding loop runs it: the draft, the tree forward
    and the acceptance, or (n 0) a plain step and its first token; and what the draft reads of
    the kept positions."""
    if model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if n == 0:
        _, kept = root_step(model, cache, 0, acceptance, None)  # a plain step, picked
    else:
        candidates = draft.tree(model, n, 0, features)
        _, kept = medusa_step(model, candidates, cache, acceptance, None)
    draft.read(kept)
    return time.perf_counter() - start


def time_forward(model, cache: KVCache, cached: int, M: int) -> float:
    """Seconds of one forward of M rows written after `cached` tokens (the same slots each time)."""
    device = model.embed.weight.device
    tokens = torch.zeros(1, M, dtype=torch.long, device=device)  # (1, M)
    positions = torch.arange(cached, cached + M, device=device)[None]  # (1, M)
    start = time.perf_counter()
    model(tokens, positions, causal_mask(cached, M, device), cache, cache.slots(cached, M))
    if device.type == "cuda":
        torch.cuda.synchronize()  # the forward is queued, not done, until then
    return time.perf_counter() - start

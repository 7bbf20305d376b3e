"""Where a decoding step's time goes: `python -m minimedusa.bench --profile`.

torch.profiler over a few plain and Medusa steps from one prompt, operators by their own time and
split by input shape, so that a tree step's extra cost shows operator by operator.
"""
import time

import torch

from minimedusa.acceptance import greedy
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.sampling import Sampling


def profile_steps(model, heads, tree, prompt_ids: list[int], steps: int = 8) -> str:
    """Where one step's time goes: torch.profiler over a few plain and Medusa steps from the
    same prompt (its prefill left out), operators sorted by their own time and split by input
    shape, so the LM head's products show apart from the blocks'."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    tables = []
    for name, decode in (("plain", lambda: plain_decode(model, prompt_ids, steps + 1,
                                                        Sampling(), set())),
                         ("medusa greedy", lambda: medusa_decode(
                             model, heads, tree, prompt_ids, steps * (tree.num_heads + 1),
                             greedy(), set()))):
        for _ in decode():  # warm-up
            pass
        forwards = decode()
        next(forwards)  # the prefill, not a step
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            n = sum(1 for _ in forwards)  # each item: one step's accepted tokens
            seconds = time.perf_counter() - start
        tables.append(f"{name}: {n} steps in {1000 * seconds:.0f} ms, "
                      f"{1000 * seconds / n:.1f} ms a step (profiler on)\n"
                      + prof.key_averages(group_by_input_shape=True).table(
                          sort_by="self_cpu_time_total", row_limit=12))
    return "\n".join(tables)

"""How close a decoding step is to the machine's memory limit.

At batch size 1 a step multiplies one row (or a tree's few rows) by every weight matrix, so it
is bound by reading the weights, not by arithmetic: its floor is the weights' bytes over the
memory's bandwidth. Here the two sides of that ratio: the bytes of weights a step reads in a
given format, and the bandwidth the machine streams at, measured the way STREAM does (a large
copy, and a large read, timed with the threads the benchmark uses).
"""
import time

import torch
import torch.nn as nn

from minimedusa.speed.packed_linear import PackedLinear
from minimedusa.speed.quantized import Int4KernelLinear, Int4Linear, Int8GroupLinear, Int8Linear

STREAM_BYTES = 512 << 20  # far past any cache, as STREAM asks (>= 4x the last-level cache)


def module_bytes(*modules: nn.Module) -> int:
    """Bytes of the matrices one step reads: every linear layer's weight once (int8 and int4
    layers: their packed weight and scales). A weight shared between modules (the LM head that
    shared heads reuse) counts once; the embedding is left out, since a step reads one row of
    it."""
    seen, total = set(), 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, PackedLinear):  # oneDNN's packed copy has no data pointer
                if id(m) not in seen:
                    seen.add(id(m))
                    total += m.in_features * m.out_features * m.dtype.itemsize
                continue
            if isinstance(m, Int8Linear):
                tensors = [m.q, m.scales]
            elif isinstance(m, Int4Linear):
                tensors = [m.packed, m.scales_and_zeros]
            elif isinstance(m, Int4KernelLinear):
                tensors = [m.packed, m.scales, m.minimums]
            elif isinstance(m, Int8GroupLinear):
                tensors = [m.packed, m.scales]
            elif isinstance(m, nn.Linear):
                tensors = [m.weight]
            else:
                continue
            for t in tensors:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` runs of fn: the machine's limit, not its noise."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def streaming_bandwidth(device: torch.device, repeats: int = 5) -> dict:
    """GB/s of a STREAM-like copy (bytes read + bytes written, as STREAM counts them) and of a
    read alone (a sum over the array: what a matrix-vector product's weights need)."""
    a = torch.ones(STREAM_BYTES // 4, device=device)  # float32
    b = torch.empty_like(a)
    copy = best_seconds(lambda: b.copy_(a), device, repeats)
    read = best_seconds(lambda: a.sum(), device, repeats)
    return {"copy_gb_s": round(2 * STREAM_BYTES / copy / 1e9, 1),
            "read_gb_s": round(STREAM_BYTES / read / 1e9, 1)}


def implied_bandwidth(step_bytes: int, step_ms: float) -> float:
    """GB/s a step moves if it reads its weights once: step bytes over step time."""
    return round(step_bytes / (step_ms / 1000) / 1e9, 1)

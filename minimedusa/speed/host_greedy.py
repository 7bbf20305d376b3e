"""Greedy acceptance for a CPU's logits, walked on the host: the same nodes and tokens as the
core's greedy rule (acceptance.greedy, tested), fewer operators.

Why: on a CPU there is no device to keep busy. The core's rule verifies on the device and then
syncs once (acceptance.greedy_acceptance, accepted_on_host): ~15 small torch operators
(indexing, compare, cumprod, argmax, cat), each with its dispatch. Here the argmax is numpy's,
which is vectorised where torch's CPU argmax is not, and the walk over at most a few dozen
paths is Python. The flags choose this rule for logits on a CPU (greedy_for), and plain
decoding's greedy pick by the same argmax (sampling_for), so the two stay compared like for like.

Shapes: N tree nodes, V vocab.
"""
import numpy as np
import torch

from minimedusa import acceptance
from minimedusa.acceptance import Acceptance, Sampling, Verdict
from minimedusa.tree import MedusaTree


def host_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for float32/float64 logits on a CPU, by numpy, (..., V) -> (...,)
    int64: the first of tied maxima, a NaN as the maximum, as torch's (tested)."""
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))


def greedy_on_host(logits, tree: MedusaTree, tokens) -> Verdict:
    """logits (N, V), tokens (N,) -> the Verdict of acceptance.greedy's rule: the accepted
    nodes' indices, root first; the new tokens (the accepted candidates, then the next token);
    the argmax at each node."""
    argmax = host_argmax(logits)  # (N,)
    draws, candidate = argmax.tolist(), tokens.tolist()  # (N,) each
    best: list[int] = [0]
    for path in tree.paths_host:  # the first longest, as pick_by_draws' argmax takes it
        depth = 1
        while depth < len(path) and candidate[path[depth]] == draws[path[depth - 1]]:
            depth += 1
        if depth > len(best):
            best = path[:depth]
    return Verdict(best, [candidate[i] for i in best[1:]] + [draws[best[-1]]],
                   {"argmax": argmax})


def greedy_walked_on_host() -> Acceptance:
    return Acceptance("greedy", lambda logits, candidates, g: greedy_on_host(
                          logits, candidates.tree, candidates.tokens),
                      lambda logits, g: host_argmax(logits))


def greedy_for(device) -> Acceptance:
    """The greedy rule for float32 logits on `device` (decoding's logits are at least float32):
    walked on the host on a CPU, else the core's, verified on the device."""
    if torch.device(device).type == "cpu":
        return greedy_walked_on_host()
    return acceptance.greedy()


class HostSampling(Sampling):
    """Plain decoding's pick with the host's argmax for greedy; sampling as the core's."""

    def pick(self, logits: torch.Tensor, generator) -> torch.Tensor:
        return host_argmax(logits) if self.greedy else super().pick(logits, generator)


def sampling_for(device, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None) -> Sampling:
    """Plain decoding's Sampling for float32 logits on `device`: greedy by the host's argmax on
    a CPU, as greedy_for's rule."""
    kind = HostSampling if torch.device(device).type == "cpu" else Sampling
    return kind(temperature, top_p, seed)

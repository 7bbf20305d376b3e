"""Turning next-token logits into a token: greedy, or sampling with temperature and top-p.

`probabilities` is the target distribution p that every sampler here draws from; Medusa's
rejection sampling (paper section 3) will verify its drafts against the very same p.
Left out: top-k, repetition penalties, min-p.

Shapes: V vocab; "..." any leading dims.
"""
from dataclasses import dataclass

import torch

from minimedusa.errors import UserError


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        return make_generator(device, self.seed)

    def pick(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """One token id per row of logits (..., V) -> (...,), greedy or sampled."""
        if self.greedy:
            return greedy_tokens(logits)
        return draw(probabilities(logits, self.temperature, self.top_p), generator)


def make_generator(device, seed: int | None) -> torch.Generator:
    """A random generator on `device`: seeded (reproducible) or from OS entropy (seed None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-p nucleus and renormalised: (..., V) float32."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (..., V)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V) each
    # a token stays if the tokens ranked above it have not yet reached top_p (so >= 1 stays)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row drawn from probs (..., V) -> (...,) int64, by the inverse of its
    cumulative distribution: a uniform u in [0, total), the first token whose cumulative
    probability exceeds u. The same law as torch.multinomial (tested), with one cumsum and a
    binary search a row, where multinomial on a CPU takes far longer over a 49,152-token row.
    A token of probability 0 owns an empty interval: never drawn."""
    cdf = probs.cumsum(dim=-1)  # (..., V)
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, device=probs.device)
    token = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # (..., 1)
    return token.squeeze(-1).clamp(max=probs.shape[-1] - 1)  # u * total rounded up to total


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), (..., V) -> (...,) int64: the first maximum of each row, a NaN
    counting as one. Plain decoding and greedy acceptance both pick their tokens here, so the
    two stay compared like for like (on a CPU, speed/host_greedy.py's numpy argmax stands in
    for both)."""
    return logits.argmax(dim=-1)


"""LoRA adapters: the backbone's trainable part in Medusa-2 (paper section 4).

A frozen linear layer W gets a trainable low-rank update (Hu et al., 2021):

    y = W x + (alpha / r) * B A dropout(x),     A: (r, I), B: (O, r), B = 0 at init

so at initialisation the adapted model IS the original model, and the self-distillation loss
KL(p_original || p) starts at exactly zero. Two verbs make Medusa-2 cheap:
- adapters_off(model): a context in which every adapter is skipped, i.e. the ORIGINAL model,
  the teacher of the KL loss, with no second copy in memory (paper section 5);
- merge_adapters(model): fold (alpha / r) B A into W and put plain layers back,
  so the tuned model costs nothing extra at inference and saves in the ordinary HF layout
  (remove_adapters puts the original layers back instead).
Adapted: every linear layer of every block (qkv, o, gate_up, down), as the paper does; q, k
and v share one adapter, and gate and up another, as model.py runs them as one product.
Not adapted: the embedding and the LM head, which SmolLM2 ties together and which the shared
Medusa heads project with; tuning them would move the heads' output space under them.

Shapes: I in features, O out features, r rank.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimedusa.errors import UserError

TARGETS = ("attn.wqkv", "attn.wo", "mlp.gate_up", "mlp.down")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = alpha / rank
        w = base.weight
        self.A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's own initialisation
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x):  # (..., I) -> (..., O)
        y = self.base(x)
        if not self.enabled:
            return y  # exactly W x: the original layer, bit for bit
        return y + self.scale * F.linear(F.linear(self.dropout(x), self.A), self.B)

    def merged(self) -> nn.Linear:
        """A plain layer holding W + (alpha / r) B A (summed in float32 at least), and the
        base layer's bias, if it has one (Qwen2's q, k, v)."""
        w, bias = self.base.weight, self.base.bias
        delta = self.scale * (self.B.detach().to(torch.promote_types(w.dtype, torch.float32))
                              @ self.A.detach().to(torch.promote_types(w.dtype, torch.float32)))
        linear = nn.Linear(self.base.in_features, self.base.out_features, bias=bias is not None,
                           device=w.device, dtype=w.dtype)
        linear.weight = nn.Parameter((w.detach() + delta).to(w.dtype), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return linear


def adapted_layers(model) -> dict[str, LoRALinear]:
    """Every adapter in the model, by module name (layers.{i}.attn.wqkv, ...)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_adapters(model, rank: int = 32, alpha: float = 16.0, dropout: float = 0.05) -> list:
    """Wrap every TARGETS layer of every block in a LoRALinear, in place; returns the new
    trainable parameters (A and B of each adapter). The rest of the model stays frozen."""
    model.requires_grad_(False)
    for block in model.layers:
        for target in TARGETS:
            parent_name, name = target.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout))
    return [p for m in adapted_layers(model).values() for p in (m.A, m.B)]


@contextmanager
def adapters_off(model):
    """Within this context the model is the original one (the teacher)."""
    layers = adapted_layers(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


def replace_adapters(model, linear_of) -> None:
    """Replace every LoRALinear m by the plain layer linear_of(m), in place."""
    for name, m in adapted_layers(model).items():
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, linear_of(m))


def merge_adapters(model) -> None:
    """Keep what the adapters learned: W + (alpha / r) B A in plain layers (the tuned model)."""
    replace_adapters(model, LoRALinear.merged)


def remove_adapters(model) -> None:
    """Drop the adapters: the frozen W in plain layers (the original model, for good)."""
    replace_adapters(model, lambda m: m.base)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters alone ({layer}.A, {layer}.B): a few MB instead of the whole model."""
    return {f"{name}.{p}": getattr(m, p).detach().contiguous()
            for name, m in adapted_layers(model).items() for p in ("A", "B")}


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    layers = adapted_layers(model)
    expected = {f"{name}.{p}" for name in layers for p in ("A", "B")}
    if set(state) != expected:
        raise UserError(f"adapter state does not fit the model: {len(state)} tensors for "
                         f"{len(expected)} adapter weights")
    with torch.no_grad():
        for key, tensor in state.items():
            name, p = key.rsplit(".", 1)
            getattr(layers[name], p).copy_(tensor)

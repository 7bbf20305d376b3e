"""Medusa heads (paper section 1): K extra heads on the backbone's last hidden state.

Head k (k = 1..K) reads h_t, the hidden state at position t after the final norm, and predicts
token t+k+1 (the backbone's own LM head predicts t+1):

    p_t^(k) = softmax( W2^(k) · ( SiLU(W1^(k) · h_t + b1^(k)) + h_t ) )

with L residual blocks stacked before W2. Two parametrisations of W2: each head's own V×d
projection, initialised as a copy of the LM head (the paper's form, the reference's "V1"
checkpoints), or the backbone's LM head shared by every head (the reference's "V2").
Files: config.json + medusa_lm_head.safetensors with the reference's keys ({i}.{j}.linear.weight,
{i}.{j}.linear.bias, {i}.{L}.weight), so heads move between this project and others;
`python -m minimedusa.heads SRC OUT` exports heads in the reference's V1 layout for serving engines.

Shapes: B batch, T tokens, C model dim, V vocab, K heads.
"""
import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from minimedusa.default_model import ensure_default_model
from minimedusa.model import PackedLinear
from minimedusa.weights import WeightsError, load_model

HEADS_FILE = "medusa_lm_head.safetensors"


class HeadsError(ValueError):
    """Heads that cannot be loaded, or that do not fit the model."""


@dataclass
class MedusaConfig:
    medusa_num_heads: int  # K
    medusa_num_layers: int  # L residual blocks per head
    hidden_size: int  # C: must equal the backbone's
    vocab_size: int  # V: must equal the backbone's
    shared_lm_head: bool = False  # True: heads reuse the backbone's LM head (no own W2)

    def check_fits(self, model_config) -> None:
        for field in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(self, field), getattr(model_config, field)
            if ours != theirs:
                raise HeadsError(f"the heads' {field} is {ours} but the model's is {theirs}: "
                                 "these heads were trained for another model")


class ResBlock(nn.Module):
    """x + SiLU(W1 x + b1); W1 = 0 and b1 = 0 at init, so the block starts as the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = PackedLinear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):  # (..., C) -> (..., C)
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg

        def head():  # L blocks, then (own form only) W2: its index L gives the key {i}.{L}.weight
            blocks = [ResBlock(cfg.hidden_size) for _ in range(cfg.medusa_num_layers)]
            if not cfg.shared_lm_head:
                blocks.append(PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False))
            return nn.Sequential(*blocks)

        # note: a comprehension, not [head()] * K, which would repeat ONE head K times.
        self.heads = nn.ModuleList([head() for _ in range(cfg.medusa_num_heads)])

    @classmethod
    def for_model(cls, model, num_heads: int, num_layers: int = 1,
                  shared_lm_head: bool = False) -> "MedusaHeads":
        """Fresh heads in the paper's initialisation: every head predicts exactly what the LM
        head predicts at step 0 (identity blocks, W2 = a copy of the LM head)."""
        cfg = MedusaConfig(num_heads, num_layers, model.config.hidden_size,
                           model.config.vocab_size, shared_lm_head)
        heads = cls(cfg).to(device=model.lm_head.weight.device, dtype=model.lm_head.weight.dtype)
        if not shared_lm_head:
            with torch.no_grad():
                for head in heads.heads:
                    head[-1].weight.copy_(model.lm_head.weight)
        return heads

    def forward(self, hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """Logits of every head: hidden (..., C) -> (K, ..., V).

        lm_head is the backbone's, passed explicitly: the shared form projects with it, the own
        form ignores it (its W2 is the last module of each head).
        """
        if self.config.shared_lm_head:
            # one (K, ..., C) @ (C, V) product: the V x C weight is read from memory once, not K
            # times, which is what makes this form cheap on bandwidth-bound hardware
            return lm_head(torch.stack([head(hidden) for head in self.heads]))
        return torch.stack([head(hidden) for head in self.heads])


def save_heads(heads: MedusaHeads, folder, extra_config: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name.removeprefix("heads."): t.contiguous() for name, t in heads.state_dict().items()}
    save_file(state, folder / HEADS_FILE, metadata={"format": "pt"})
    config = {**asdict(heads.config), **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_heads_state(folder: Path) -> dict[str, torch.Tensor]:
    """The heads' tensors, reference keys: medusa_lm_head.safetensors, else the reference's
    medusa_lm_head.pt read with weights_only=True (plain tensors, never arbitrary pickles)."""
    path, pt = folder / HEADS_FILE, folder / "medusa_lm_head.pt"
    try:
        if path.is_file():
            with safe_open(path, framework="pt", device="cpu") as st:
                return {k: st.get_tensor(k) for k in st.keys()}
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # truncation/corruption surfaces with varied exception types
        raise HeadsError(f"cannot read the heads in {folder} (truncated or corrupt?): {e}") \
            from None
    raise HeadsError(f"missing heads file {path}")


def heads_config(raw: dict, state: dict, model_config) -> MedusaConfig:
    """The config of heads files. Published reference heads state only medusa_num_heads and
    medusa_num_layers; the sizes and the form are then read off the tensors: the shared form is
    the one without a projection {i}.{L}.weight."""
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in raw]
    if missing:
        raise HeadsError(f"the heads' config.json lacks {', '.join(missing)}")
    L = raw["medusa_num_layers"]
    projection = state.get(f"0.{L}.weight")
    block = state.get("0.0.linear.weight")
    shared = raw.get("shared_lm_head", projection is None)
    hidden = raw.get("hidden_size") or (block.shape[1] if block is not None else
                                        projection.shape[1] if projection is not None else
                                        model_config.hidden_size)
    vocab = raw.get("vocab_size") or (projection.shape[0] if projection is not None else
                                      model_config.vocab_size)
    return MedusaConfig(raw["medusa_num_heads"], L, hidden, vocab, bool(shared))


def load_heads(folder, model) -> MedusaHeads:
    """Heads from a folder (config.json + medusa_lm_head.safetensors or .pt), in this project's
    or the reference's layout, checked against the model."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HeadsError(f"no config.json in the heads folder {folder}")
    state = read_heads_state(folder)
    cfg = heads_config(json.loads(config_path.read_text()), state, model.config)
    cfg.check_fits(model.config)
    heads = MedusaHeads(cfg)
    expected = {k.removeprefix("heads."): v for k, v in heads.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise HeadsError(f"the heads in {folder} lack tensor {missing[0]}")
    for name, t in state.items():
        if name not in expected:
            raise HeadsError(f"unexpected tensor {name} in the heads in {folder}")
        if t.shape != expected[name].shape:
            raise HeadsError(f"tensor {name} has shape {tuple(t.shape)}, "
                             f"the config needs {tuple(expected[name].shape)}")
    heads.heads.load_state_dict(state)
    weight = model.lm_head.weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)


def export_v1(heads: MedusaHeads, lm_head: nn.Linear, folder, base_model: str) -> None:
    """Write heads in the reference's "V1" layout that serving engines load: own projections
    (the shared form gets a copy of the LM head per head), medusa_lm_head.safetensors, and a
    config.json with medusa_num_heads, medusa_num_layers and base_model_name_or_path."""
    cfg = heads.config
    own = MedusaHeads(MedusaConfig(cfg.medusa_num_heads, cfg.medusa_num_layers, cfg.hidden_size,
                                   cfg.vocab_size, shared_lm_head=False))
    state = {k.removeprefix("heads."): v for k, v in heads.state_dict().items()}
    if cfg.shared_lm_head:
        for i in range(cfg.medusa_num_heads):
            state[f"{i}.{cfg.medusa_num_layers}.weight"] = lm_head.weight.detach().clone()
    own.heads.load_state_dict(state)
    save_heads(own, folder, {"base_model_name_or_path": base_model})


def main():
    p = argparse.ArgumentParser(description="Export heads in the reference's V1 layout "
                                "(own projections), for serving engines that load Medusa heads.")
    p.add_argument("heads", type=Path, help="heads folder to export")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--model", type=Path, default=None,
                   help="the base model folder (default: the default model)")
    p.add_argument("--base-model-name", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="base_model_name_or_path written in config.json (default: %(default)s)")
    args = p.parse_args()
    try:
        model = load_model(args.model or ensure_default_model())
        export_v1(load_heads(args.heads, model), model.lm_head, args.out, args.base_model_name)
    except (HeadsError, WeightsError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {args.out / HEADS_FILE} and {args.out / 'config.json'}")


def heads_from_spec(spec: str, model) -> MedusaHeads:
    """A heads folder, or 'untrained:K' / 'untrained-shared:K': K fresh heads (own / shared
    projection) in the paper's initialisation, for trying the machinery without training."""
    for prefix, shared in (("untrained:", False), ("untrained-shared:", True)):
        if spec.startswith(prefix):
            count = spec.removeprefix(prefix)
            if not count.isdigit() or int(count) < 1:
                raise HeadsError(f"bad heads {spec!r}: use {prefix}K with K >= 1")
            return MedusaHeads.for_model(model, int(count), shared_lm_head=shared) \
                .eval().requires_grad_(False)
    if not Path(spec).is_dir():
        raise HeadsError(f"heads folder {spec} does not exist")
    return load_heads(spec, model)


if __name__ == "__main__":
    main()

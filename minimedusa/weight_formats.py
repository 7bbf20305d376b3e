"""Weight formats for a CPU: fewer bytes read per decoding step, swapped in after loading.

A decoding step on a CPU reads every weight once, so its time is the weights' bytes over the
memory's bandwidth: 540 MB for the default model in float32. model.py stays plain nn.Linear (the
reading path); a format is applied to a loaded model, as gpt-fast does:

    float32   PackedLinear (packed_linear.py): oneDNN's prepacked layout, 4 bytes a weight.
    bfloat16  the whole model in bfloat16, its layers prepacked for oneDNN: 2 bytes a weight.
              oneDNN multiplies bfloat16 natively only where the CPU has avx512_bf16 or AMX
              (torch.ops.mkldnn._is_mkldnn_bf16_supported); elsewhere it is slower than float32.
    int8      weight-only int8 with a float scale per output channel, ~1 byte a weight, through
              torch's _weight_int8pack_mm, vectorised for bfloat16 activations only (so the
              rest of the model runs in bfloat16); the LM head and the heads' projections too.

Left out: int4 weight-only (torch's _weight_int4pack_mm_for_cpu, groups of 32). On the 2-core
AVX-512 EPYC its products over the whole model took 5.5 ms at 1 row against int8's 13.5 (18.6
against 27.5 at 8 rows), but with about 9x int8's relative error (7.5e-2 against 8e-3), and int8
already falls short of the 98% top-1 agreement with float32 a default needs (96.8%,
format_quality.py); also left out: activation quantization.
Greedy Medusa verifies with the format's own model, so it is lossless with respect to that
format, to the bit, if a token's row comes out the same in a tree step (N rows) as in a plain
step (one row): bfloat16 logits tie often, so a rounding difference anywhere flips tokens. Two
things make it so: attention sums in float64 (model.exact_attention) and a plain step's products
computed as four rows (packed_linear.PackedLinear: oneDNN's one-row kernel rounds differently).
Measured: 8 of 8 MT-Bench answers identical to plain greedy over 256 tokens (1 of 8 before).
Shapes: N output features, K input features, M rows.
"""
import torch
import torch.nn as nn

from minimedusa.packed_linear import ONEDNN_LINEAR, can_pack, pack_linear_layers

DTYPE_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = (*DTYPE_FORMATS, "int8")


def bf16_is_native() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (avx512_bf16, AMX, or Arm's)."""
    return ONEDNN_LINEAR and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 and (N,) float32 scales, symmetric per output channel:
    w ~= q * scale, scale = max |w| of the channel / 127 (round to nearest)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The slow reference: (N, K) int8 and (N,) scales -> the (N, K) float32 weight they hold."""
    return q.float() * scales[:, None]


class Int8Linear(nn.Module):
    """y = x (q * scale)^T + b, weights held as int8, for bfloat16 activations on a CPU."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("q", q)  # (N, K) int8
        self.register_buffer("scales", scales.to(dtype))  # (N,): in the activations' dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (N, K) weight, for setup code that reads it (the draft vocabulary's
        cut, the heads' dtype and device); computed on each read, never on a decoding step."""
        return dequantize_int8(self.q, self.scales.float()).to(self.scales.dtype)

    def forward(self, x):  # (..., K) -> (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scales)  # (M, N)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_linear_layers(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear, in place; returns how many.
    note: a tied LM head becomes its own int8 copy; the embedding it was tied to stays whole."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, Int8Linear(child, dtype))
            count += 1
        else:
            count += quantize_linear_layers(child, dtype)
    return count


def apply_format(module: nn.Module, name: str) -> nn.Module:
    """The model (or the heads), loaded in float32, in format `name`: cast, then its layers
    swapped (prepacked where that pays, or quantized)."""
    if name == "int8":
        quantize_linear_layers(module)  # from the float32 weights: rounded once, not twice
        return module.to(torch.bfloat16)
    module = module.to(DTYPE_FORMATS[name])
    if can_pack(next(module.parameters()).device, DTYPE_FORMATS[name]):
        pack_linear_layers(module)
    return module


def format_of(model: nn.Module) -> str:
    """The format a loaded model (or heads) runs in: "int8", or its dtype's name."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def default_format(device: torch.device) -> str:
    """generate.py's format when none is asked for: bfloat16 on CUDA, and on a CPU where oneDNN
    multiplies it natively (there it reads half float32's bytes, with a step as flat in the
    tree's size); float32 on other CPUs, where bfloat16 products are slower than float32's."""
    if device.type == "cuda" or bf16_is_native():
        return "bfloat16"
    return "float32"


def activation_dtype(name: str) -> torch.dtype:
    """The dtype a format's activations, KV cache and heads run in."""
    return torch.bfloat16 if name == "int8" else DTYPE_FORMATS[name]

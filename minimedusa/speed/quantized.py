"""The quantized layers of the int8 and int4 weight formats (weight_formats.py), each with the
slow reference it must equal: quantize, then dequantize and multiply (grids.py).

    Int8Linear       int8, a scale per output channel; torch's _weight_int8pack_mm
    Int4Linear       4-bit groups of 32 with a scale and a minimum (the GGUF's Q4_1), torch's
                     _weight_int4pack_mm_for_cpu (fp32 FMA, the weights read once per 4 rows)
    Int4KernelLinear the same weights multiplied by group_kernel.c (read once for any rows)
    Int4A8KernelLinear  the same, times 8-bit activations (the w4a8 format, llama.cpp's Q8_1)
    Int4A16KernelLinear the same, times 16-bit activations (the w4a8 format's other products)
    Int8GroupLinear  8-bit groups of 32 with a scale (the GGUF's Q8_0), group_kernel.c: an LM
                     head whose weights already lie on that grid, and the heads' layers
    Int8A16GroupLinear  the same, times 16-bit activations (the w4a8 format's LM head)
    BF16KernelLinear bfloat16 weights, not rounded: the bfloat16 format's block products where
                     group_kernel.c multiplies bfloat16 (AVX-512 BF16), in its layout

Shapes: N output features, K input features, M rows.
"""
import sys

import torch
import torch.nn as nn

from minimedusa.errors import UserError
from minimedusa.model import Llama
from minimedusa.speed import group_kernel
from minimedusa.speed.grids import (GROUP, ROWS, dequantize_int8, dequantize_int8_groups,
                                    eight_bit_groups, quantize_int4, quantize_int8,
                                    quantize_int8_groups)


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


class Int4Linear(nn.Module):
    """y = x (q * scale + minimum)^T + b, weights held as 4-bit groups, bfloat16 activations."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        N, K = linear.weight.shape
        if K % GROUP or N % 16:
            raise UserError(f"int4 needs layers of a multiple of {GROUP} inputs and of 16 "
                            f"outputs (torch's kernel): this model has one of {K} and {N}")
        q, scales, minimums = quantize_int4(linear.weight)
        # torch's layout: two 4-bit values a byte, blocked for its kernel (N a multiple of 16)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # its kernel computes w = (q - 8) * scale + zero, so zero = minimum + 8 scale: (K / GROUP,
        # N, 2), in the activations' dtype
        zeros = minimums + 8 * scales
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(dtype)
                             .contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):  # (..., K) -> (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                                        self.scales_and_zeros)  # (M, N)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4KernelLinear(nn.Module):
    """Int4Linear's weights, multiplied by group_kernel.c (AVX-512 BF16 dot products, or AVX2
    FMAs; the weights read once for any number of rows) instead of torch's kernel: bfloat16
    activations, or float32 where the kernel takes them (group_kernel.takes_float32)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        N, K = linear.weight.shape
        if K % GROUP or N % 16:
            raise UserError(f"int4 needs layers of a multiple of {GROUP} inputs and of 16 "
                            f"outputs: this model has one of {K} and {N}")
        group_kernel.require_kernel()
        packed, scales, minimums = self.pack(*quantize_int4(linear.weight))
        # (N / 16, K / 4, 32) uint8; w4a8's layout (N / 16, K / 8, 64)
        self.register_buffer("packed", packed)
        # float16 whatever the activations' dtype (kept out of .to(bfloat16), which would round
        # them: plain attributes, not buffers)
        self.scales, self.minimums = scales, minimums  # (N / 16, K / GROUP, 16) each
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().to(torch.bfloat16))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    pack = staticmethod(group_kernel.pack_int4)  # the kernel's layout of the weights
    product = torch.ops.minimedusa.int4_product  # the kernel's function that multiplies

    def forward(self, x):  # (..., K) -> (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = self.product(rows, self.packed, self.scales, self.minimums)  # (M, N)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4A8KernelLinear(Int4KernelLinear):
    """Int4KernelLinear's weights times 8-bit activations (the w4a8 format): each row's groups
    of 32 quantized to -127..127 with a scale (max |x| / 127), as llama.cpp's Q8_1, inside
    group_kernel.c, whose integer products are cheaper than float ones on a CPU (VPMADDUBSW:
    32 byte pairs an instruction, 8 floats an FMA)."""

    pack = staticmethod(group_kernel.pack_int4_a8)
    product = torch.ops.minimedusa.int4_a8_product


class Int4A16KernelLinear(Int4KernelLinear):
    """Int4KernelLinear's weights times 16-bit activations: each row's groups of 32 quantized to
    -32767..32767 with a scale (max |x| / 32767, within 1.5e-5 of the group's largest value),
    inside group_kernel.c, whose VPMADDWD products (16 pairs of 16-bit integers an instruction)
    turn 4-bit weights into numbers with fewer operations than float32 FMAs do: a row or two
    cost less, more rows the same. In w4a8's layout."""

    pack = staticmethod(group_kernel.pack_int4_a8)
    product = torch.ops.minimedusa.int4_a16_product


class BF16KernelLinear(nn.Module):
    """y = x W^T (+ b), W as bfloat16 in the kernel's layout (group_kernel.pack_bfloat16),
    multiplied by group_kernel.c's VDPBF16PS loop: bfloat16 rows, float32 sums, each row's bits
    the same whatever rows beside it (what keeps greedy Medusa lossless), and a fused step of
    the blocks (fused_block.py) where oneDNN's products need a compiled one."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        N, K = linear.weight.shape
        if N % 16 or K % 32:
            raise UserError(f"group_kernel.c's bfloat16 products need layers of a multiple of 16 "
                            f"outputs and 32 inputs: this model has one of {N} and {K}")
        group_kernel.require_kernel()
        self.register_buffer("packed", group_kernel.pack_bfloat16(linear.weight))  # (B, 32 K)
        self.scales = self.minimums = torch.empty(0)  # none: what a fused step passes for them
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().to(torch.bfloat16), False)
        self.in_features, self.out_features = K, N

    product = torch.ops.minimedusa.bf16_product

    def forward(self, x):  # (..., K) -> (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = self.product(rows, self.packed).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8GroupLinear(nn.Module):
    """y = x (q * scale)^T (+ bias), weights held as 8-bit groups (Q8_0's), multiplied by
    group_kernel.c: for an LM head whose weights already lie on that grid (eight_bit_groups' q
    and scales), and for the heads' layers, rounded to it (eight_bit_head_layers)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 wide: bool = False):
        super().__init__()
        group_kernel.require_kernel()
        # float32 outputs whatever the rows' dtype: a model's LM head, whose logits greedy
        # acceptance compares (rounded to bfloat16, close logits tie: 25.249 and 25.189 both
        # became 25.25, and "What is the capital of France?" began with the wrong one)
        self.wide = wide
        packed, scales = group_kernel.pack_int8(q, scales)
        self.register_buffer("packed", packed)  # (N / 16, K / 2, 32) uint8
        self.scales = scales  # (N / 16, K / GROUP, 16) float16: a plain attribute, as int4's
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)  # (N,)
        self.out_features, self.in_features = q.shape

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) float32 weight, for setup code that reads it (the draft vocabulary's cut);
        computed on each read (ROWS rows at a time), never on a decoding step."""
        q, scales = group_kernel.unpack_int8(self.packed, self.scales)
        weight = torch.empty(q.shape, dtype=torch.float32)  # (N, K): its only full-size copy
        for rows, q_rows, s_rows in zip(weight.split(ROWS), q.split(ROWS), scales.split(ROWS)):
            rows.copy_(dequantize_int8_groups(q_rows, s_rows))
        return weight

    product = torch.ops.minimedusa.int8_product  # the kernel's function that multiplies

    def forward(self, x):  # (..., K) -> (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = self.product(rows, self.packed, self.scales, self.wide)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8A16GroupLinear(Int8GroupLinear):
    """Int8GroupLinear's weights times 16-bit activations (each row's groups of 32 quantized as
    Int4A16KernelLinear's): VPMADDWD multiplies the 8-bit weights sign-extended, where float32
    rows need each weight turned into a float; a tree's rows cost less, one row the same (the
    default model's LM head reads 28 MB a step, memory-bound)."""

    product = torch.ops.minimedusa.int8_a16_product


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


# w4a8's products with 8-bit activations (model.py's names): the attention's output (wo) and the
# MLP's input (gate_up, half the blocks' weights: the speed is there). Not wqkv, whose input, the
# attention norm's output, has outlier channels that coarsen its groups' steps, nor down, whose
# input (SwiGLU's product) costs most of what is left: those take 16-bit ones. format_quality on 48
# held-out chats (the 2-core AVX2 EPYC, float32 activations elsewhere then), top-1 agreement with
# float32 and mean KL: wo, gate_up and down 98.65%, 0.00123 (answering "What is the capital of
# France?" with "L'Etoile, la Marseillaise", as llama.cpp does); wo and gate_up 98.91%, 0.00077
# ("Paris"); gate_up alone 98.73%, 0.00070; llama.cpp's Q4_1 decoding 97.85%, 0.00253. With 16-bit
# activations in wqkv and down instead of float32 ones: 98.97%, 0.00073
# (records/epyc-zen3-avx2/format-quality-epyc-avx2-w4a8-a16.json)
EIGHT_BIT_INPUTS = ("wo", "gate_up")


def four_bit_layers(blocks, layer: type, activations8: bool = False) -> int:
    """Replace every nn.Linear of the blocks by an int4 `layer` (int4_layer()), in place; with
    8-bit activations (w4a8), those of EIGHT_BIT_INPUTS by an Int4A8KernelLinear and the others
    by an Int4A16KernelLinear (group_kernel.c must multiply them); how many."""
    if activations8:
        group_kernel.require_kernel()
    count = 0
    for block in blocks:
        for parent in (block.attn, block.mlp):
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    kind = w4a8_layer(name) if activations8 else layer
                    setattr(parent, name, kind(child))
                    count += 1
    return count


def bfloat16_layers(blocks) -> int:
    """Replace every nn.Linear of the blocks by a BF16KernelLinear, in place, where
    group_kernel.c multiplies bfloat16 rows and the layer's sizes fit its blocks; how many."""
    if not group_kernel.multiplies_bfloat16():
        return 0
    count = 0
    for block in blocks:
        for parent in (block.attn, block.mlp):
            for name, child in parent.named_children():
                if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                        and child.out_features % 16 == 0 and child.in_features % 32 == 0):
                    setattr(parent, name, BF16KernelLinear(child))
                    count += 1
    return count


def w4a8_layer(name: str) -> type:
    """w4a8's layer for the block's product `name`: 8-bit activations in EIGHT_BIT_INPUTS,
    16-bit ones elsewhere."""
    return Int4A8KernelLinear if name in EIGHT_BIT_INPUTS else Int4A16KernelLinear


def int4_layer() -> type:
    """Int4KernelLinear where group_kernel.c multiplies on this CPU, else Int4Linear; where the
    CPU has what the kernel needs and it still does not multiply, a line on stderr says so."""
    problem = group_kernel.kernel_problem()
    if problem is None:
        return Int4KernelLinear
    if group_kernel.expected_here():
        print(f"minimedusa: int4's C kernel (group_kernel.c) is not available here ({problem}); "
              "torch's int4 kernel multiplies instead (slower)", file=sys.stderr)
    return Int4Linear


def eight_bit_head_layers(heads: nn.Module) -> int:
    """Replace every nn.Linear inside Medusa, Hydra or Hydra++ heads that the kernel's blocks
    fit (outputs a multiple of 16, inputs of GROUP) by an Int8GroupLinear of its weights
    rounded to 8-bit groups, in place, where group_kernel.c multiplies on this CPU; how many.
    Why: the heads' draft reads their weights once a depth, in float32 4 bytes a weight (the
    default Hydra heads, 4 deep: 24 MB); 8-bit groups read a quarter of that (a 3-node draft
    2.3 -> 1.1 ms on the 2-core AVX2 EPYC,
    records/epyc-zen3-avx2/heads-int8-draft-epyc-avx2.txt). Rounding the heads changes only
    their guesses (within ~0.4% of each group's largest weight), never what the model accepts:
    greedy Medusa stays lossless."""
    if group_kernel.kernel_problem() is not None:
        return 0
    layers = [(parent, name, child) for parent in heads.modules()
              for name, child in parent.named_children()
              if type(child) is nn.Linear and child.out_features % 16 == 0
              and child.in_features % GROUP == 0]
    for parent, name, child in layers:
        q, scales = quantize_int8_groups(child.weight)
        setattr(parent, name, Int8GroupLinear(q, scales, child.bias))  # scales: float16 there
    return len(layers)


def eight_bit_lm_heads(module: nn.Module, activations16: bool = False) -> int:
    """Replace every LM head inside `module` (the model's, a draft vocabulary's cut) whose
    weights lie on an 8-bit grid by an Int8GroupLinear (with 16-bit activations: an
    Int8A16GroupLinear), in place, where group_kernel.c multiplies on this CPU; how many."""
    if group_kernel.kernel_problem() is not None:
        return 0
    heads = [(parent, eight_bit_groups(child.weight)) for parent in module.modules()
             for name, child in parent.named_children()
             if name == "lm_head" and type(child) is nn.Linear and child.bias is None]
    kept = [(parent, groups) for parent, groups in heads if groups is not None]
    for parent, (q, scales) in kept:  # the model's logits in float32 (a draft's: only guesses)
        kind = Int8A16GroupLinear if activations16 else Int8GroupLinear
        parent.lm_head = kind(q, scales, wide=isinstance(parent, Llama))
    return len(kept)

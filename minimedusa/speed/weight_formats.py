"""Weight formats for a CPU: fewer bytes read per decoding step, swapped in after loading.

A decoding step on a CPU reads every weight once, so its time is the weights' bytes over the
memory's bandwidth: 540 MB for the default model in float32. model.py stays plain nn.Linear (the
reading path); a format is applied to a loaded model, as gpt-fast does, and is an object, as
gpt-fast's quantization handlers are: a class a format, each knowing its name (flags, cache
keys, the summary line), the dtype the file is read in (`dtype`; None: as stored, then rounded
block by block: `rounds`), how it makes a block as the file is read (block_format, head_format;
format_layers.py does it), its activations' dtype, whether its step is the fused one, its
reference check's bound (`error`) and its bytes. FORMATS holds them by name: format_named turns
a flag's name into one, once, where a run decides its format (assembly/load.py); the recipe and
the model (apply_format's label, read by weight_format) carry it from there.

Greedy Medusa verifies with the format's own model, so it is lossless with respect to that
format, to the bit, if a token's row comes out the same in a tree step (N rows) as in a plain
step (one row): bfloat16 logits tie often, so a rounding difference anywhere flips tokens. Two
things make it so: attention that adds its terms in an order the keys' slots do not change
(model.exact_attention's float64 sums; attention_kernel.c's fixed float32 order in compiled
steps) and a plain step's products computed as four rows (packed_linear.PackedLinear: oneDNN's
one-row kernel rounds differently; int4's kernel gives a row the same bits at any row count).
tests/test_lossless_matrix.py checks it in every format.

`error`: the most a format moves any token's logit against the reference's top token
(reference_check.largest_shift against eager float32), for every step of the format: the largest
measured, times 1.5, rounded up to 0.05. Measured by python -m minimedusa.bench.format_quality
--steps (48 held-out chats, 128 tokens each, 4,968 positions; on a 2-core Xeon with AMX,
records/xeon-amx/format-quality-steps-xeon-amx.json).
"""
import torch
import torch.nn as nn

from minimedusa.errors import UserError
from minimedusa.model import Llama
from minimedusa.speed import group_kernel
from minimedusa.speed.format_layers import (converted, four_bit_head, four_bit_heads,
                                            model_bytes, rounds_lm_head)
from minimedusa.speed.packed_linear import can_pack, pack_linear_layers
from minimedusa.speed.quantized import (bfloat16_layers, four_bit_layers, int4_layer,
                                        quantize_linear_layers)


class Float32:
    """The file's weights in float32, as PackedLinear (packed_linear.py): oneDNN's prepacked
    layout, 4 bytes a weight. The other formats are this class with what differs overridden."""
    name = "float32"  # the flags', the cache keys' and the summary line's
    dtype = torch.float32  # what the file is read in (None: as stored, then rounded)
    rounds = False  # whether it rounds the file's weights as it reads them (kept_weights.py)
    four_bit = False  # whether its blocks lie on a 4-bit grid (a 4-bit file's lose nothing)
    kernel_only = False  # whether group_kernel.c alone multiplies it
    error = 0.01  # float32's steps sum in other orders only
    row_paths = ()  # group_kernel.c's two ways with its rows, the first where this CPU has it

    def activation_dtype(self) -> torch.dtype:
        """The dtype its activations, KV cache and heads run in."""
        return self.dtype

    def fused(self) -> bool:
        """Whether its step is by default the fused one (fused_block.py: no warm-up to pay),
        where group_kernel.c multiplies."""
        return False

    def block_format(self):
        """convert(block): one of a model's blocks in this format, as the loader reads it."""
        return converted(None, self.dtype)

    def head_format(self):
        """convert(lm_head, config): the LM head as the loader reads it; None: in `dtype`."""
        return None

    def format_heads(self, module: nn.Module) -> None:
        """Its layers outside the blocks (the LM head, the heads'), in place, before the cast."""

    def weight_bytes(self, config) -> int:
        """About the bytes a model takes in this format (format_layers.model_bytes)."""
        return model_bytes(config, self.dtype.itemsize, self.dtype.itemsize, False)


class Float16(Float32):
    """The whole model in float16 (a GPU's format): 2 bytes a weight."""
    name, dtype = "float16", torch.float16
    error = 1.35  # bfloat16's bound (unmeasured, CUDA only: 3 bits finer than bfloat16)


class BFloat16(Float32):
    """The whole model in bfloat16: 2 bytes a weight. Where the CPU has avx512_bf16 the blocks'
    products are group_kernel.c's (BF16KernelLinear: its VDPBF16PS loop, the weights read once
    for any rows), and the blocks one fused call (fused_block.py); elsewhere the layers are
    prepacked for oneDNN, which multiplies bfloat16 natively only where the CPU has avx512_bf16
    or AMX (torch.ops.mkldnn._is_mkldnn_bf16_supported), and is slower than float32 there
    otherwise."""
    name, dtype = "bfloat16", torch.bfloat16
    error = 1.35  # measured 0.90 (its fused step)

    def fused(self) -> bool:
        return group_kernel.multiplies_bfloat16()  # BF16KernelLinear's blocks fuse

    def block_format(self):
        # group_kernel.c's, where it multiplies bfloat16
        return converted(lambda block: bfloat16_layers([block]), self.dtype)


class Int8(Float32):
    """Weight-only int8 with a float scale per output channel, ~1 byte a weight, through torch's
    _weight_int8pack_mm, vectorised for bfloat16 activations only (so the rest of the model runs
    in bfloat16); the LM head and the heads' projections too."""
    name, dtype = "int8", None
    rounds = True
    error = 4.5  # measured 2.98 (compiled)

    def activation_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def block_format(self):
        return converted(quantize_linear_layers, self.activation_dtype())

    def format_heads(self, module: nn.Module) -> None:
        quantize_linear_layers(module)  # the LM head, the heads' layers (read in the file's dtype)

    def weight_bytes(self, config) -> int:
        return model_bytes(config, 1.0, self.activation_dtype().itemsize, True)  # a byte each


class Int4(Float32):
    """The blocks' weights in 4 bits, a scale and a minimum per 32 input features (the GGUF's
    Q4_1 layout), through torch's _weight_int4pack_mm_for_cpu, bfloat16 activations (float32
    where group_kernel.c's AVX2 path multiplies: it works in float32 anyway); the heads' layers
    rounded to 8-bit groups where group_kernel.c multiplies (their draft reads a quarter of
    float32's bytes; only their guesses change, measured: 1.615 -> 1.610 tokens a step), else in
    the activations' dtype. Half a byte a weight, and for a model whose weights came from a
    4-bit file (the default model: a Q4_1 GGUF) no loss at all in the weights: the 4-bit grid
    found again is theirs, to the bit (four_bit_checkpoint). Where the CPU has AVX-512 BF16, or
    AVX2 with FMA, the products are group_kernel.c's (Int4KernelLinear: the weights read once
    for any number of rows); elsewhere torch's kernel's, which reads them once per 4 rows (a
    tree of 5-8 rows costs it a second pass). There too, an LM head (and the heads' draft
    vocabulary's cut of it) whose weights lie on an 8-bit grid of 32 (the GGUF's Q8_0, which
    the default model's came from) is kept in it (Int8GroupLinear: a byte a weight, half of
    bfloat16's, and the file's own values, which bfloat16 rounds; the model's logits in
    float32, where bfloat16 would tie close ones); any other stays bfloat16."""
    name, dtype = "int4", None
    rounds, four_bit = True, True
    error = 1.7  # measured 1.11 (compiled)
    row_paths = ("AMX tiles", "dot products")  # AMX against AVX-512 BF16, its bfloat16 rows
    eight_bit_rows = False  # w4a8's: 8-bit rows in two products a block, 16-bit in the LM head

    def activation_dtype(self) -> torch.dtype:
        if group_kernel.takes_float32() and not group_kernel.multiplies_bfloat16():
            return torch.float32  # the AVX2 path multiplies in float32: bfloat16 would only round
        return torch.bfloat16

    def fused(self) -> bool:
        return True  # where group_kernel.c multiplies (fused_block.fusable)

    def block_format(self):
        layer = int4_layer()  # chosen once here (a line on stderr where its kernel is missing)
        return converted(lambda block: four_bit_layers([block], layer,
                                                       activations8=self.eight_bit_rows),
                         self.activation_dtype())

    def head_format(self):
        return four_bit_head(activations16=self.eight_bit_rows)

    def format_heads(self, module: nn.Module) -> None:
        four_bit_heads(module, activations16=self.eight_bit_rows)

    def weight_bytes(self, config) -> int:
        # 4 bits, and a float16 scale and minimum a group of 32; an 8-bit LM head
        return model_bytes(config, 0.625, self.activation_dtype().itemsize,
                           rounds_lm_head(config))


class W4a8(Int4):
    """int4's weights times 8-bit activations (each row's groups of 32 quantized with a scale,
    as llama.cpp does in its own Q4_1 decoding) in the attention's output and the MLP's input
    products (quantized.EIGHT_BIT_INPUTS), 16-bit ones in the other two (wqkv, down: within
    1.5e-5 of each group's largest value) and in the 8-bit LM head (Int8A16GroupLinear: a tree's
    rows cheaper there too): integer products, cheaper than float ones, so a step and its tree's
    rows cost less. group_kernel.c only (by AVX-512 VNNI where the CPU has it, else its AVX2
    code: the same bits); the rest as int4. Float32 activations on every CPU: its rows are
    quantized from float32, not from bfloat16's rounding of them. Its top-1 agreement with
    float32 (format_quality.py) stays above llama.cpp's own Q4_1 decoding's, whose every product
    takes 8-bit activations; the machine's default for a 4-bit checkpoint where only the AVX2
    path multiplies (speed/defaults.py; the figures: weights/RESULTS.md)."""
    name = "w4a8"
    kernel_only = True
    error = 2.05  # measured 1.36 (fused)
    row_paths = ("VNNI", "AVX2 code")  # AVX-512 VNNI against AVX2, its 8-bit rows
    eight_bit_rows = True

    def activation_dtype(self) -> torch.dtype:
        if group_kernel.takes_float32():
            return torch.float32  # its rows quantized from float32, not bfloat16's rounding
        return torch.bfloat16


# the formats, one object each: what the recipe and the model carry
FLOAT32, BFLOAT16, FLOAT16 = Float32(), BFloat16(), Float16()
INT8, INT4, W4A8 = Int8(), Int4(), W4a8()
FORMATS = {f.name: f for f in (FLOAT32, BFLOAT16, FLOAT16, INT8, INT4, W4A8)}


def format_named(name: str):
    """The format of this name (a flag's: --quantize, --decode-format, --formats); a UserError in
    one line for any other."""
    if name not in FORMATS:
        raise UserError(f"unknown weight format {name!r}: use {', '.join(FORMATS)}")
    return FORMATS[name]


def dtype_format(dtype: torch.dtype):
    """The format of a model read in `dtype` as it is stored (--dtype's; a model never
    formatted)."""
    return {f.dtype: f for f in FORMATS.values() if not f.rounds}[dtype]


def weight_format(module: nn.Module):
    """The format apply_format put the model (or heads) in, as it carries it; one it never
    formatted (a model loaded as it is stored, for training) runs in its dtype."""
    return getattr(module, "weight_format", None) or dtype_format(next(module.parameters()).dtype)


def apply_format(module: nn.Module, fmt) -> nn.Module:
    """The model (or the heads), as loaded, in format `fmt`: cast, then its layers swapped
    (prepacked where that pays, or quantized), from the weights as the file stores them (the
    file's grid found again, rounded once, not twice). A model's blocks one by one (as
    fmt.block_format; a block the loader formatted already is left as it is), then the rest
    (fmt.format_heads: int4 keeps LM heads that lie on an 8-bit grid in it)."""
    if isinstance(module, Llama):
        unformatted = [block for block in module.layers  # where the loader has not formatted
                       if any(type(layer) is nn.Linear for layer in block.modules())]
        if unformatted:
            convert = fmt.block_format()
            for block in unformatted:
                convert(block)
    fmt.format_heads(module)
    dtype = fmt.activation_dtype()
    module = module.to(dtype)
    if can_pack(next(module.parameters()).device, dtype):
        pack_linear_layers(module)  # int4: the heads, and an LM head off the 8-bit grid
    # the format, decided once (the recipe's) and carried: what reads it later (the heads'
    # format, the step's words, the reference check's bound) reads this, never the layers' types
    module.weight_format = fmt
    return module

"""Weight formats for a CPU: fewer bytes read per decoding step, swapped in after loading.

A decoding step on a CPU reads every weight once, so its time is the weights' bytes over the
memory's bandwidth: 540 MB for the default model in float32. model.py stays plain nn.Linear (the
reading path); a format is applied to a loaded model, as gpt-fast does:

    float32   PackedLinear (packed_linear.py): oneDNN's prepacked layout, 4 bytes a weight.
    bfloat16  the whole model in bfloat16: 2 bytes a weight. Where the CPU has avx512_bf16 the
              blocks' products are group_kernel.c's (BF16KernelLinear: its VDPBF16PS loop, the
              weights read once for any rows), and the blocks one fused call (fused_block.py);
              elsewhere the layers are prepacked for oneDNN, which multiplies bfloat16 natively
              only where the CPU has avx512_bf16 or AMX (torch.ops.mkldnn.
              _is_mkldnn_bf16_supported), and is slower than float32 there otherwise.
    int8      weight-only int8 with a float scale per output channel, ~1 byte a weight, through
              torch's _weight_int8pack_mm, vectorised for bfloat16 activations only (so the
              rest of the model runs in bfloat16); the LM head and the heads' projections too.
    int4      the blocks' weights in 4 bits, a scale and a minimum per 32 input features (the
              GGUF's Q4_1 layout), through torch's _weight_int4pack_mm_for_cpu, bfloat16
              activations (float32 where group_kernel.c's AVX2 path multiplies: it works in
              float32 anyway); the heads' layers rounded to 8-bit groups where group_kernel.c
              multiplies (their draft reads a quarter of float32's bytes; only their guesses
              change, measured: 1.615 -> 1.610 tokens a step), else in the activations' dtype.
              Half a byte a weight, and for a model whose weights came from a 4-bit file (the
              default model: a Q4_1 GGUF) no loss at all in the weights: the 4-bit grid found
              again is theirs, to the bit
              (four_bit_checkpoint). Where the CPU has AVX-512 BF16, or AVX2 with FMA, the
              products are group_kernel.c's (Int4KernelLinear: the weights read once for any
              number of rows); elsewhere torch's kernel's, which reads them once per 4 rows (a
              tree of 5-8 rows costs it a second pass). There too, an LM head (and the heads' draft
              vocabulary's cut of it) whose weights lie on an 8-bit grid of 32 (the GGUF's
              Q8_0, which the default model's came from) is kept in it (Int8GroupLinear: a
              byte a weight, half of bfloat16's, and the file's own values, which bfloat16
              rounds; the model's logits in float32, where bfloat16 would tie close ones);
              any other stays bfloat16.
    w4a8      int4's weights times 8-bit activations (each row's groups of 32 quantized
              with a scale, as llama.cpp does in its own Q4_1 decoding) in the attention's
              output and the MLP's input products (quantized.EIGHT_BIT_INPUTS), 16-bit ones in
              the other two (wqkv, down: within 1.5e-5 of each group's largest value) and in
              the 8-bit LM head (Int8A16GroupLinear: a tree's rows cheaper there too): integer
              products, cheaper than float ones, so a step and its tree's rows cost less.
              group_kernel.c only (by AVX-512 VNNI where the CPU has it, else its AVX2 code:
              the same bits); the rest as int4. Float32 activations on every CPU: its rows
              are quantized from float32, not from bfloat16's rounding of them.
              Its top-1 agreement with float32 (format_quality.py) stays above llama.cpp's
              own Q4_1 decoding's, whose every product takes 8-bit activations; the machine's
              default for a 4-bit checkpoint where only the AVX2 path multiplies
              (speed/defaults.py; the figures: weights/RESULTS.md).

Greedy Medusa verifies with the format's own model, so it is lossless with respect to that
format, to the bit, if a token's row comes out the same in a tree step (N rows) as in a plain
step (one row): bfloat16 logits tie often, so a rounding difference anywhere flips tokens. Two
things make it so: attention that adds its terms in an order the keys' slots do not change
(model.exact_attention's float64 sums; attention_kernel.c's fixed float32 order in compiled
steps) and a plain step's products computed as four rows (packed_linear.PackedLinear: oneDNN's
one-row kernel rounds differently; int4's kernel gives a row the same bits at any row count).
tests/test_lossless_matrix.py checks it in every format.

Shapes: N output features, K input features, M rows.
"""
import ctypes

import torch
import torch.nn as nn

from minimedusa.model import Llama
from minimedusa.speed import group_kernel
from minimedusa.speed.grids import GROUP, quantize_int8_groups
from minimedusa.speed.machine import forced_avx2
from minimedusa.speed.packed_linear import ONEDNN_LINEAR, can_pack, pack_linear_layers
from minimedusa.speed.quantized import (Int8A16GroupLinear, Int8GroupLinear,
                                        bfloat16_layers, eight_bit_head_layers,
                                        eight_bit_lm_heads, four_bit_layers, int4_layer,
                                        quantize_linear_layers)

DTYPE_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = (*DTYPE_FORMATS, "int8", "int4", "w4a8")
QUANTIZED = ("int8", "int4", "w4a8")  # the formats with quantized weights


def bf16_is_native() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (avx512_bf16, AMX, or Arm's),
    not run as an AVX2 CPU (machine.forced_avx2)."""
    return (ONEDNN_LINEAR and not forced_avx2()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def apply_format(module: nn.Module, name: str) -> nn.Module:
    """The model (or the heads), as loaded, in format `name`: cast, then its layers swapped
    (prepacked where that pays, or quantized), from the weights as the file stores them (the
    file's grid found again, rounded once, not twice). A model's blocks one by one (as
    block_format; a block the loader formatted already is left as it is), then the rest: int4
    keeps LM heads that lie on an 8-bit grid in it."""
    if isinstance(module, Llama):
        unformatted = [block for block in module.layers  # where the loader has not formatted
                       if any(type(layer) is nn.Linear for layer in block.modules())]
        if unformatted:
            convert = block_format(name)
            for block in unformatted:
                convert(block)
    if name == "int8":
        quantize_linear_layers(module)  # the LM head, the heads' layers
    if name in ("int4", "w4a8"):
        is_model = isinstance(module, Llama)
        # w4a8's model verifies with 16-bit activations in its LM head; the heads' draft
        # vocabulary, only guesses, keeps float rows (as the fused draft multiplies them)
        eight_bit_lm_heads(module, activations16=is_model and name == "w4a8")
        if is_model:  # a tied one (the loader rounds another: head_format)
            module.lm_head = head_format(name)(module.lm_head, module.config)
        else:
            eight_bit_head_layers(module)  # the heads' draft: a quarter of float32's bytes
    dtype = activation_dtype(name)
    module = module.to(dtype)
    if can_pack(next(module.parameters()).device, dtype):
        pack_linear_layers(module)  # int4: the heads, and an LM head off the 8-bit grid
    # the format, decided once (the recipe's) and carried: what reads it later (the heads'
    # format, the step's words, the reference check's bound) reads this, never the layers' types
    module.weight_format = name
    return module


def head_format(name: str):
    """convert(lm_head, config) -> the LM head in format `name`, as the loader reads it (in the
    file's dtype: files/weights.load_model's convert_head): int4's and w4a8's, for a model of
    real size (rounds_lm_head), rounded to 8-bit groups (rounded_lm_head) before any float32
    copy of it is made; else as read (apply_format casts it). None for the other formats (their
    LM head is read in their dtype)."""
    if name not in ("int4", "w4a8"):
        return None

    def convert(lm_head: nn.Module, config) -> nn.Module:
        if type(lm_head) is nn.Linear and rounds_lm_head(config):
            return rounded_lm_head(lm_head, activations16=name == "w4a8")
        return lm_head
    return convert


def rounded_lm_head(lm_head: nn.Linear, activations16: bool = False) -> nn.Module:
    """A model's LM head off the 8-bit grid rounded onto it (quantize_int8_groups: a GGUF's
    Q8_0), an Int8GroupLinear (Int8A16GroupLinear: 16-bit activations, w4a8's), its logits
    float32; as it is where group_kernel.c does not multiply here or its shape does not fit the
    kernel's blocks. Why: in int4 and w4a8 a model of real size's LM head, left in its float
    dtype, was the step's largest read (a 1.1B model's 49,152 x 2,048 head: 403 MB in float32
    against 0.6 GB of 4-bit blocks); llama.cpp's Q4_1 files keep theirs in 6 bits (Q6_K). The
    rounding moves a logit by at most ~0.4% of each group's largest weight times the hidden
    state's group sum."""
    N, K = lm_head.weight.shape
    if (group_kernel.kernel_problem() is not None or N % 16 or K % GROUP
            or lm_head.bias is not None):
        return lm_head
    q, scales = quantize_int8_groups(lm_head.weight)  # ROWS rows at a time
    kind = Int8A16GroupLinear if activations16 else Int8GroupLinear
    return kind(q, scales, wide=True)


def rounds_lm_head(config) -> bool:
    """Whether int4 and w4a8 round the LM head of a model of this config to 8-bit groups: a
    model of real size (LARGE), whose head otherwise reads more bytes a token than its blocks;
    smaller ones keep theirs as the file holds it (the default model's is on the grid)."""
    return block_weights(config) >= LARGE


def block_format(name: str):
    """convert(block): one of a model's blocks in format `name`, in place, as the loader reads
    it (files/weights.load_model's convert_block), so that a model is never held whole in its
    file's dtype beside its format's bytes. The int4 layer is chosen once here (int4_layer: a
    line on stderr where its kernel is missing)."""
    layer = int4_layer() if name in ("int4", "w4a8") else None
    dtype = activation_dtype(name)

    def convert(block: nn.Module) -> None:
        if name == "int8":
            quantize_linear_layers(block)
        elif name in ("int4", "w4a8"):
            four_bit_layers([block], layer, activations8=name == "w4a8")
        elif name == "bfloat16":
            bfloat16_layers([block])  # group_kernel.c's, where it multiplies bfloat16
        block.to(dtype)
        if can_pack(next(block.parameters()).device, dtype):
            pack_linear_layers(block)
        give_back_freed_memory()
    return convert


def give_back_freed_memory() -> None:
    """Hand the memory freed since (a block's weights as stored, its rounding's temporaries)
    back to the system, where the C library is glibc. note: glibc keeps freed memory for reuse,
    and the next block's tensors fit its holes only in part: without this, a 1B model's loading
    peaked 0.2 GB higher, in memory no tensor used."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy
        pass


def weight_format(module: nn.Module) -> str:
    """The format apply_format put the model (or heads) in, as it carries it; one it never
    formatted (a model loaded as it is stored, for training) runs in its dtype."""
    return getattr(module, "weight_format", None) or str(
        next(module.parameters()).dtype).removeprefix("torch.")


# a model of this many weights in its blocks is one of real size: its format's memory and speed
# are worth a word (describe_weights), its rounded blocks worth keeping (kept_weights.py)
LARGE = 300_000_000


def block_weights(config) -> int:
    """The weights of a model's blocks (wqkv, wo, gate_up and down), from its config."""
    C, I, H, G, D = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                     config.num_key_value_heads, config.head_dim)
    return config.num_hidden_layers * (C * (H + 2 * G) * D + H * D * C + 3 * C * I)


def weight_bytes(config, name: str) -> int:
    """About the bytes a model takes in format `name`: its blocks' weights (int4 and w4a8: 4
    bits, and a float16 scale and minimum a group of 32; int8: a byte), its embedding in the
    activations' dtype, its LM head too (int8's, and int4's and w4a8's of a model of real size:
    a byte; tied, none but that copy)."""
    per_weight = {"int4": 0.625, "w4a8": 0.625, "int8": 1.0}
    size = torch.empty(0, dtype=activation_dtype(name)).element_size()
    table = config.vocab_size * config.hidden_size
    eight_bits = name == "int8" or (name in ("int4", "w4a8") and rounds_lm_head(config))
    lm_head = 1 if eight_bits else 0 if config.tie_word_embeddings else size
    return int(block_weights(config) * per_weight.get(name, size) + table * (size + lm_head))


def describe_weights(config, name: str, rounded: bool, device: torch.device) -> str:
    """The summary line's words for the weights: the format and its size; where they were
    rounded from the file's (lossy), so; and for a model of real size in a float format on a
    CPU where group_kernel.c multiplies, int4's size (faster there: fewer bytes a token)."""
    said = f"{name} weights, {weight_bytes(config, name) / 1e9:.2f} GB"
    if rounded:
        said += (", rounded from the file's (lossy: python -m minimedusa.bench.format_quality "
                 "--model DIR measures how much)")
    elif (name in DTYPE_FORMATS and device.type == "cpu" and block_weights(config) >= LARGE
          and group_kernel.kernel_problem() is None):
        fast = faster_four_bit()
        said += (f"; --quantize {fast}: {weight_bytes(config, fast) / 1e9:.2f} GB, faster here, "
                 "lossy")
    elif name == faster_four_bit() and block_weights(config) >= LARGE:
        said += " (the faster 4-bit format on this CPU)"
    return said


def faster_four_bit() -> str:
    """The faster of the 4-bit formats where group_kernel.c multiplies: w4a8 on a CPU with AVX2
    and no AVX-512 BF16, whose integer products there beat AVX2's float ones (a 1.1B model of
    TinyLlama's shape: 1.2-1.3x int4's tokens a second, weights/RESULTS.md), else int4."""
    if group_kernel.takes_float32() and not group_kernel.multiplies_bfloat16():
        return "w4a8"
    return "int4"


def activation_dtype(name: str) -> torch.dtype:
    """The dtype a format's activations, KV cache and heads run in."""
    if name == "w4a8" and group_kernel.takes_float32():
        return torch.float32  # its rows are quantized from float32, not from bfloat16's rounding
    if name == "int4" and group_kernel.takes_float32() and not group_kernel.multiplies_bfloat16():
        return torch.float32  # the AVX2 path multiplies in float32: bfloat16 would only round
    return torch.bfloat16 if name in QUANTIZED else DTYPE_FORMATS[name]

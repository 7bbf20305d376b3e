"""What the weight formats (weight_formats.py) make of a model's layers: a block converted as the
loader reads it, the LM head of a model of real size rounded to 8-bit groups (int4, w4a8), the
heads' layers in 8 bits, and the bytes a model takes in a format. Each format's class says which
of these it does; here they are done.

Shapes: N output features, K input features.
"""
import ctypes

import torch
import torch.nn as nn

from minimedusa.model import Llama
from minimedusa.speed import group_kernel
from minimedusa.speed.grids import GROUP, quantize_int8_groups
from minimedusa.speed.packed_linear import can_pack, pack_linear_layers
from minimedusa.speed.quantized import (Int8A16GroupLinear, Int8GroupLinear,
                                        eight_bit_head_layers, eight_bit_lm_heads)

# a model of this many weights in its blocks is one of real size: its format's memory and speed
# are worth a word (describe_weights), its rounded blocks worth keeping (kept_weights.py)
LARGE = 300_000_000


def block_weights(config) -> int:
    """The weights of a model's blocks (wqkv, wo, gate_up and down), from its config."""
    C, I, H, G, D = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                     config.num_key_value_heads, config.head_dim)
    return config.num_hidden_layers * (C * (H + 2 * G) * D + H * D * C + 3 * C * I)


def of_real_size(config) -> bool:
    """Whether a model of this config is one of real size (LARGE)."""
    return block_weights(config) >= LARGE


def model_bytes(config, per_weight: float, size: int, eight_bit_lm_head: bool) -> int:
    """About the bytes a model takes: its blocks' weights at `per_weight` bytes each, its
    embedding in the activations' dtype (`size` bytes a number), its LM head too (an 8-bit one:
    a byte; tied, none but that copy)."""
    table = config.vocab_size * config.hidden_size
    lm_head = 1 if eight_bit_lm_head else 0 if config.tie_word_embeddings else size
    return int(block_weights(config) * per_weight + table * (size + lm_head))


def converted(layers, dtype: torch.dtype):
    """convert(block): one of a model's blocks, in place, its layers swapped by layers(block)
    (None: kept as they are), cast to `dtype` (the format's activations'), prepacked for oneDNN
    where that pays, as the loader reads it (files/weights.load_model's convert_block), so
    that a model is never held whole in its file's dtype beside its format's bytes."""
    def convert(block: nn.Module) -> None:
        if layers is not None:
            layers(block)
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


def four_bit_heads(module: nn.Module, activations16: bool) -> None:
    """int4's and w4a8's layers outside the blocks, in place: LM heads that lie on an 8-bit grid
    kept in it; a model's own LM head (a tied one: the loader rounds another, four_bit_head)
    rounded to it where the model is of real size; the heads' layers in 8-bit groups.
    activations16: w4a8's (Int8A16GroupLinear's 16-bit rows in the model's LM head)."""
    is_model = isinstance(module, Llama)
    # w4a8's model verifies with 16-bit activations in its LM head; the heads' draft
    # vocabulary, only guesses, keeps float rows (as the fused draft multiplies them)
    eight_bit_lm_heads(module, activations16=is_model and activations16)
    if is_model:  # a tied one (the loader rounds another: head_format)
        module.lm_head = four_bit_head(activations16)(module.lm_head, module.config)
    else:
        eight_bit_head_layers(module)  # the heads' draft: a quarter of float32's bytes


def four_bit_head(activations16: bool):
    """convert(lm_head, config) -> int4's (w4a8's: activations16) LM head as the loader reads
    it (in the file's dtype: files/weights.load_model's convert_head): for a model of real size
    (rounds_lm_head), rounded to 8-bit groups (rounded_lm_head) before any float32 copy of it is
    made; else as read (apply_format casts it)."""
    def convert(lm_head: nn.Module, config) -> nn.Module:
        if type(lm_head) is nn.Linear and rounds_lm_head(config):
            return rounded_lm_head(lm_head, activations16=activations16)
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
    return of_real_size(config)

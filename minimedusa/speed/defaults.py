"""The machine's defaults, where no flag asks otherwise: the weight format a model decodes in
(and the summary line's word for a faster one), the tree a fixed-tree run starts from, the most
nodes a grown tree may have, and how many tokens the heads rank. Each follows what runs fastest
where it was measured (weights/RESULTS.md, "Today's figures" and the log's entries it cites); a
flag overrides each.
"""
import torch

from minimedusa.speed import group_kernel
from minimedusa.speed.format_layers import of_real_size
from minimedusa.speed.machine import forced_avx2
from minimedusa.speed.packed_linear import ONEDNN_LINEAR
from minimedusa.speed.weight_formats import BFLOAT16, FLOAT32, INT4, W4A8


def bf16_is_native() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (avx512_bf16, AMX, or Arm's),
    not run as an AVX2 CPU (machine.forced_avx2)."""
    return (ONEDNN_LINEAR and not forced_avx2()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def default_format(device: torch.device, four_bit: bool = False):
    """generate.py's format for a model when none is asked for: bfloat16 on CUDA. On a CPU, for
    a model whose weights came from a 4-bit file (`four_bit`: assembly/load.four_bit_checkpoint; its
    4-bit weights then lose nothing), where group_kernel.c multiplies them:
    - on AVX2 without avx512_bf16, w4a8: 8-bit activations in the wo and gate_up products
      (quantized.EIGHT_BIT_INPUTS), faster than int4 there and within the quality llama.cpp's
      own 8-bit activations already give its users (format_quality.py);
    - on AVX-512 BF16, int4 with bfloat16 activations and float32 logits: there w4a8's float32
      cache and steps cost more than VNNI's products save, and bfloat16 rows lose more in it;
    - where oneDNN multiplies bfloat16 natively, int4 through torch's kernel.
    Otherwise bfloat16 where that is native (half float32's bytes, a step as flat in the
    tree's size), else float32."""
    if device.type == "cuda":
        return BFLOAT16
    if four_bit and group_kernel.kernel_problem() is None:
        return faster_four_bit()  # w4a8 on the kernel's AVX2 path, int4 on AVX-512 BF16's
    if four_bit and bf16_is_native():
        return INT4  # through torch's kernel
    return BFLOAT16 if bf16_is_native() else FLOAT32


def faster_four_bit():
    """The faster of the 4-bit formats where group_kernel.c multiplies: w4a8 on a CPU with AVX2
    and no AVX-512 BF16, whose integer products there beat AVX2's float ones (a 1.1B model of
    TinyLlama's shape: 1.2-1.3x int4's tokens a second, weights/RESULTS.md), else int4."""
    if group_kernel.takes_float32() and not group_kernel.multiplies_bfloat16():
        return W4A8
    return INT4


def describe_weights(config, fmt, rounded: bool, device: torch.device) -> str:
    """The summary line's words for the weights: the format and its size; where they were
    rounded from the file's (lossy), so; and for a model of real size in a float format on a
    CPU where group_kernel.c multiplies, the faster 4-bit format's size (faster there: fewer
    bytes a token)."""
    said = f"{fmt.name} weights, {fmt.weight_bytes(config) / 1e9:.2f} GB"
    if rounded:
        said += (", rounded from the file's (lossy: python -m minimedusa.bench.format_quality "
                 "--model DIR measures how much)")
    elif (not fmt.rounds and device.type == "cpu" and of_real_size(config)
          and group_kernel.kernel_problem() is None):
        fast = faster_four_bit()
        said += (f"; --quantize {fast.name}: {fast.weight_bytes(config) / 1e9:.2f} GB, faster "
                 "here, lossy")
    elif fmt is faster_four_bit() and of_real_size(config):
        said += " (the faster 4-bit format on this CPU)"
    return said


def default_tree(device: torch.device) -> str:
    """The paper's 64-token tree on a GPU (compute to spare); a small one on a CPU."""
    return "mc_sim_7b_63" if device.type == "cuda" else "cpu_8"


def largest_grown_tree(device: torch.device) -> int:
    """The most nodes the Budget's grown trees may have: on a CPU a 16-node step already costs
    well over a plain one; a GPU's step stays flat up to the paper's 64."""
    return 64 if device.type == "cuda" else 16


# On a CPU the heads rank at most this many tokens by default: the draft's LM head reads V' x C
# bytes a depth, mostly from memory (the model's weights have just streamed through the caches),
# and the most frequent 2,048 tokens of the heads' training answers cover nearly all of them.
# Not on a GPU, whose larger trees reach further down the heads' ranks.
CPU_DRAFT_VOCAB = 2048


def cpu_draft_vocab(size: int, device: torch.device) -> int:
    """The heads' own draft vocabulary size (0: none), cut to CPU_DRAFT_VOCAB on a CPU."""
    return min(size, CPU_DRAFT_VOCAB) if size and device.type == "cpu" else size


def default_batch(device: torch.device) -> int:
    """How many prompts generate.py --prompts answers at once by default: on a GPU the paper's
    batch of 16 costs little more a step than one row; on a CPU each row adds its share of the
    products and attention (BATCH_CPU, measured: weights/RESULTS.md)."""
    return 16 if device.type == "cuda" else BATCH_CPU


BATCH_CPU = 8

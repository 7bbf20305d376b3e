"""A fused decoding step: all the transformer blocks of an int4 (or w4a8, or bfloat16) model in
ONE call of a C++ operator (blocks_operator.cpp's blocks_step), instead of a compiled graph.

Why: on a 2-core CPU a compiled block spends about as long in Python as in its products. A
plain int4 step of ~21 ms on the 2-core AVX2 EPYC (Zen 3) was ~44% Python and dispatch on the
main thread (perf: Dynamo's guards, the graph's Python wrapper, ~12 operator calls a block, 30
blocks), while the other thread waited; the products were ~40% of all samples. Here a block
is one operator call: its norms, RoPE, cache write and SwiGLU are loops over one row at a time
in C++, its 4 products group_kernel.c's and its attention attention_kernel.c's, called
directly. And nothing is compiled: no warm-up in each process. Measured there, side by side in
one process: a forward of 1 / 8 rows 24.5 / 44.2 ms compiled, 16.2 / 35.4 fused; generate.py's
default 1.29x its own plain decoding and 1.26-1.33x llama.cpp's (weights/RESULTS.md). In
bfloat16 on a Xeon (AVX-512 BF16, 2 threads): 14.3 / 29.1 ms compiled, 10.7 / 27.5 fused.
All the blocks in one call rather than one a block: each block's call from Python cost ~15 us
beyond the operator's work (the module's call and checks, the dispatch), more in situ, where
each block's weights stream through the caches in between; in one process (weights/HISTORY.md,
session 17) a forward of 1 / 2 / 8 rows took 1.13-1.16x / 1.12-1.13x / 1.06x as long a call a
block.
A row's bits depend on nothing beside it (each step of the block is row by row, and so are the
kernels), so greedy Medusa stays lossless with respect to plain decoding in this step; model.Block
is the reference (tests/test_fused_block.py: the same outputs within float32's rounding, and
within bfloat16's for bfloat16 activations).

Where: the blocks of a model whose four products are group_kernel.c's int4 layers
(quantized.Int4KernelLinear; for w4a8 Int4A8KernelLinear and Int4A16KernelLinear; for bfloat16,
where the CPU multiplies it, BF16KernelLinear) without biases,
its activations in float32 (the AVX2 path's: group_kernel.takes_float32) or bfloat16 (the AVX-512
BF16 path's; the residual stream float32 as in model.py), its attention the C kernel's. Decoding's
forwards only (in inference mode, a cache, at most model.EXACT_ATTENTION_TOKENS rows in all: one
sequence's step, tree or short prompt, or a batch's step, batch_decoding.py, each sequence its
cache row and its slots); anything else runs the eager blocks one after another (model.Blocks).

Shapes: B sequences, T rows each, C model dim, H query heads, G key/value heads, D head dim, S
attended slots.
"""
import torch
import torch.nn as nn

from minimedusa.model import EXACT_ATTENTION_TOKENS, Block, Blocks, Llama
from minimedusa.speed import attention_kernel, group_kernel
from minimedusa.speed.packed_linear import OPERATORS
from minimedusa.speed.quantized import (BF16KernelLinear, Int4A8KernelLinear, Int4A16KernelLinear,
                                        Int4KernelLinear)

# x (B, T, C) float32, cos and sin (B, 1, T, D), mask (B, 1, T, S); per block: its layer's
# cache k and v (B, G, capacity, D), written at slots (T,) or (B, T) (each sequence its own),
# and its norms' weights (C,), in the
# activations' dtype, its 4 products' (packed, scales, minimums) in the order wqkv, wo, gate_up,
# down and the bits each rounds its rows to (ROW_BITS); H, eps
OPERATORS.define("blocks_step(Tensor x, Tensor cos, Tensor sin, Tensor mask, "
                 "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
                 "Tensor[] attn_norms, Tensor[] mlp_norms, Tensor[] products, int[] row_bits, "
                 "int heads, float eps) -> Tensor")

# the layers a fused block multiplies with, and the bits each rounds its rows to inside the
# kernel (0: float rows as they are)
ROW_BITS = {Int4KernelLinear: 0, Int4A8KernelLinear: 8, Int4A16KernelLinear: 16,
            BF16KernelLinear: 1}  # 1: blocks_operator.cpp's BF16_WEIGHTS, bfloat16 weights


def products(block: Block) -> list[nn.Module]:
    """The block's 4 products, in blocks_step's order."""
    return [block.attn.wqkv, block.attn.wo, block.mlp.gate_up, block.mlp.down]


def fusable(model: Llama) -> str | None:
    """None if the blocks can run as one blocks_step call, else why not, in words."""
    block = model.layers[0]
    if not all(type(layer) in ROW_BITS and layer.bias is None
               for b in model.layers for layer in products(b)):
        return "its products are not group_kernel.c's int4 or bfloat16 layers without biases"
    dtype = block.attn_norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"its activations are {str(dtype).removeprefix('torch.')}, not float32 or bfloat16"
    if dtype == torch.float32 and not group_kernel.takes_float32():
        return "its activations are float32, which this CPU's group_kernel.c does not multiply"
    if model.config.head_dim > attention_kernel.MAX_D:
        return (f"its head dim {model.config.head_dim} is over the C attention's "
                f"{attention_kernel.MAX_D}")
    if attention_kernel.kernel_problem() is not None or group_kernel.kernel_problem() is not None:
        return "the C kernels do not run here"
    return None


class FusedBlocks(Blocks):
    """The model's blocks, whose decoding forwards are one blocks_step call for all of them,
    and whose other forwards run the eager blocks one after another (as Blocks)."""

    def __init__(self, blocks: Blocks):
        super().__init__(blocks)  # the same Block modules: the state dict's names unchanged
        # what each call passes, read once here: reading them through the submodules took ~8 us
        # a block (nn.Module.__getattr__, measured)
        self.products = [t for block in blocks for layer in products(block)
                         for t in (layer.packed, layer.scales, layer.minimums)]
        self.row_bits = [ROW_BITS[type(layer)] for block in blocks for layer in products(block)]
        self.attn_norms = [block.attn_norm.weight for block in blocks]
        self.mlp_norms = [block.mlp_norm.weight for block in blocks]
        self.heads, self.eps = blocks[0].attn.n_head, blocks[0].attn_norm.eps
        # the operator's one overload, bound once: torch.ops.minimedusa.blocks_step would
        # resolve it on every call (~6 us)
        self.blocks_step = torch.ops.minimedusa.blocks_step.default

    def forward(self, x, cos, sin, mask, cache=None, slots=None):
        B, T, _ = x.shape
        if (B * T <= EXACT_ATTENTION_TOKENS and cache is not None
                and x.dtype == torch.float32 and torch.is_inference_mode_enabled()):
            return self.blocks_step(x, cos, sin, mask, [c.k for c in cache.layers],
                                    [c.v for c in cache.layers], slots, self.attn_norms,
                                    self.mlp_norms, self.products, self.row_bits, self.heads,
                                    self.eps)
        return super().forward(x, cos, sin, mask, cache, slots)


def fuse_blocks(model: Llama) -> None:
    """Run the model's blocks as FusedBlocks (fusable(model) must be None)."""
    model.layers = FusedBlocks(model.layers)


def is_fused(model: Llama) -> bool:
    return isinstance(model.layers, FusedBlocks)

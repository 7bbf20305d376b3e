"""A CPU speed device, kept apart from the model: linear layers whose weights are prepacked for
oneDNN, swapped into a loaded model (and its heads) for float32 (or, where the CPU multiplies it
natively, bfloat16) decoding on a CPU.

Decoding multiplies 1 row (plain) or N + 1 rows (a Medusa tree) by every weight, and on a CPU
that costs reading the weights from memory: 424 MB for the default model's 30 blocks in float32,
113 MB for its LM head. MKL's x @ W^T, what nn.Linear calls, handles such skinny products badly,
and worse the more rows. Measured on a 2-core AMD EPYC with AVX-512 (torch 2.13), the 30 blocks'
120 products (q, k, v fused, gate and up fused: model.py) at 1 / 2 / 9 / 17 / 65 / 256 rows, in
float32 (random weights of the default model's shapes, each product once per pass; `bench
--profile` times the prepacked ones alone at 1 to 17 rows):

    nn.Linear (x @ W^T)    44 / 80 / 56 / 70 / 132 / 395 ms
    prepacked (oneDNN)     25 / 29 / 30 / 34 /  82 / 315 ms

With the weights read once whatever the rows, a small tree's step costs little more than a plain
step: what Medusa relies on. The gain is a fact of that machine; the tree budget is measured on
the machine that decodes (budget.py), never assumed.

torch.ops.mkldnn is torch's internal interface to oneDNN (its compiler uses it): builds without
it keep nn.Linear. The packed copy is made once, when the layer is swapped in, so the weights must
not change afterwards: this is for decoding, never for training. nn.Linear is the reference, and
a test checks that they agree.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

# whether this torch build has oneDNN's linear with prepacked weights (x86 builds do)
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_linear_pointwise")


# this project's operators, which compiled steps call as they are (compiled_step.py). note:
# defined with torch.library's low-level Library, not its custom_op decorator, whose wrapping
# costs ~6 us a call more (10 against 4 measured here): 120 products a step
OPERATORS = torch.library.Library("minimedusa", "FRAGMENT")
OPERATORS.define("packed_product(Tensor rows, Tensor packed, Tensor? bias, int out_features) "
                 "-> Tensor")


def packed_product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """rows (M, I) times a prepacked weight (+ bias): (M, O).

    An operator of its own for compiled steps: the compiler's own lowering of oneDNN's linear
    insists on weights frozen into the graph as constants, and a frozen graph cannot be cached
    on disk (minutes of compiling per process)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


OPERATORS.impl("packed_product", packed_product, "CompositeExplicitAutograd")


@torch.library.register_fake("minimedusa::packed_product")
def _(rows, packed, bias, out_features):  # its output's shape, for the compiler's tracing
    return rows.new_empty(rows.shape[0], out_features)


# The fewest rows a product is run with (PackedLinear adds zero rows): at least 2, for the
# exactness below, and 4 because oneDNN's kernels for 1 or 2 rows are its slowest. The 30 blocks'
# products at 1 / 2 / 3 / 4 / 5 rows on the 2-core AVX-512 EPYC (`python -m minimedusa.bench
# --profile`, records weights/records/epyc-zen4/profile-step-*-epyc-zen4.txt):
# bfloat16 13.9 / 13.2 / 12.1 / 13.1 / 11.2 ms, float32 22.7 / 23.7 / 19.8 / 19.1 / 19.0 ms.
# The weights are read once whatever the rows, so the extra rows cost next to nothing.
MIN_ROWS = 4


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. Shares the Parameters it was made
    from (a tied LM head stays tied to the embedding); with keep_weight False it lets the
    unpacked weight go (a model's blocks: no one reads it, and it would double their bytes)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True):
        super().__init__()
        self.weight = linear.weight if keep_weight else None  # (O, I)
        self.bias = linear.bias  # (O,) or None
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  # the rows' dtype it was packed for
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x):  # (..., I) -> (..., O)
        if x.dtype != self.dtype or torch.is_grad_enabled():
            if self.weight is None:
                raise RuntimeError("a packed block layer multiplies decoding's rows only (its "
                                   "unpacked weight was let go): train on a model loaded "
                                   "without a weight format")
            return F.linear(x, self.weight, self.bias)  # not what it was packed for
        rows = x.reshape(-1, x.shape[-1])  # (M, I)
        M = rows.shape[0]
        # subtle: oneDNN multiplies a single row with another kernel than two or more, and it
        # rounds a few outputs differently (measured at I = 1536: 1 or 2 of 576). Fewer than
        # MIN_ROWS rows are multiplied as MIN_ROWS (zero rows added), so that a plain step's
        # row equals, to the bit, the same token's row in a Medusa tree step (lossless greedy;
        # model.exact_attention does the rest): every M >= 2 gives a row the same bits.
        padded = rows if M >= MIN_ROWS else F.pad(rows, (0, 0, 0, MIN_ROWS - M))
        y = self.product(padded)[:M]  # (M, O)
        return y.view(*x.shape[:-1], y.shape[-1])

    def product(self, rows):  # (M, I) -> (M, O)
        if torch.compiler.is_compiling():
            return torch.ops.minimedusa.packed_product(rows, self.packed, self.bias,
                                                       self.out_features)
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking pays on a CPU whose torch build has oneDNN's linear: for float32, and for
    bfloat16 where the CPU multiplies it natively (avx512_bf16, AMX: weight_formats.py)."""
    if not ONEDNN_LINEAR or device.type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and
                                      torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by a PackedLinear, in place; returns how many.
    An LM head keeps its unpacked weight (setup code reads it: the draft vocabulary's cut,
    fresh heads; a tied one is the embedding's anyway); every other layer lets it go, so that
    a model's bytes are not held twice (float32: 424 MB of the default model's blocks)."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child, keep_weight=name == "lm_head"))
            count += 1
        else:
            count += pack_linear_layers(child)
    return count

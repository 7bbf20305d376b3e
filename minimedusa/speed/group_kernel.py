"""Products of weights quantized in groups of 32 inputs, in C: group_kernel.c, built at first
use (c_kernels.py) and called through torch operators, as oneDNN's products are
(packed_linear.OPERATORS): their schemas and shapes here, what they run in operators.cpp. Two
paths in it: AVX-512 BF16 (Zen 4 and 5, Intel since Cooper Lake) for bfloat16 rows, and AVX2
with FMA and F16C (Zen 2 and later, Intel since Haswell), which multiplies in float32 and so
takes float32 rows (takes_float32: in every build for a CPU with AVX2), and bfloat16 rows
where there is no AVX-512 BF16 (multiplies_bfloat16).
And, in both builds, int4 weights times 8-bit activations (int4_a8_product) and times 16-bit
ones (int4_a16_product), and 8-bit groups times 16-bit ones (int8_a16_product): the w4a8
format's products, by AVX-512 VNNI where the CPU has it (uses_vnni), else by AVX2 (with
AVX-VNNI's 256-bit VPDPBUSD where the CPU has that); the same bits every way.
Where the CPU has AMX (Intel since Sapphire Rapids) and Linux grants the tiles' state, the
AVX-512 path's bfloat16 products run on AMX tiles instead of VDPBF16PS (uses_tiles): up to 16
rows a tile product, so a tree's rows cost little more than a plain step's one; where the
kernel refuses them, the dot products run, and nothing else changes.

The int4 format's blocks (quantized.Int4KernelLinear: the GGUF's Q4_1) multiply through it
where this CPU has either, else through torch's _weight_int4pack_mm_for_cpu
(quantized.Int4Linear); so does its LM head where it lies on an 8-bit grid
(quantized.Int8GroupLinear: the GGUF's Q8_0), else it stays bfloat16.
Measured side by side on the 2-core AVX-512 EPYC, the default model's 120 block products at
1 / 4 / 5 / 8 / 9 / 16 rows: torch's kernel 4.6 / 7.3 / 12.4 / 12.6 / 18.3 / 22.8 ms, this
file's first version 3.5 / 4.5 / 5.3 / 7.3 / 9.2 / 12.9; broadcasting the activations from
memory then took 8 rows a quarter lower (9.8 -> 7.2 ms in a later side-by-side run of the two
versions, on a slower day of the machine). A tree's rows cost a fraction of what they did. The
LM head in 8 bits: 1.0 ms a plain step where bfloat16's took 2.8 (bench --profile).
On the 2-core AVX2 EPYC (Zen 3), one run, the AVX2 path at 1 / 4 / 8 / 9 / 16 rows: 10.0 /
15.1 / 23.2 / 27.2 / 34.0 ms, torch's kernel 13.5 / 22.6 / 40.1 / 44.5 / 70.6, float32's
(oneDNN) 51.0 / 44.7 / 49.4 / 46.1 / 74.8; the LM head 1.8 ms at 1 row (float32's 10.2). There
a row costs ~2 ms of FMAs: each weight is converted to float32 and multiplied once per row, at
~80% of the FMA units' rate in one thread, so rows are far from free (an 8-row step ~2x a
plain one, bench --profile), yet a plain step is ~4x cheaper than float32's.
tests/test_weight_formats.py checks both formats against dequantize-then-multiply, and a row's
bits whatever rows are beside it; tests/test_group_kernel_avx2.py the same of the AVX2 path,
built for it on any CPU that has AVX2.

Shapes: M rows, N outputs, K inputs, G = K / 32 groups, B = N / 16 blocks of outputs.
"""
from pathlib import Path

import torch

from minimedusa.speed.c_kernels import load_library, load_operators, why_not
from minimedusa.speed.machine import cpu_features
from minimedusa.speed.packed_linear import OPERATORS

SOURCE = Path(__file__).with_suffix(".c")

# set at the first kernel_problem() of the process (require_kernel() asks it): "floats",
# whether it takes float32 rows, and "problem", None or why the kernel does not multiply here
_kernel: dict = {}


def kernel_problem() -> str | None:
    """None if the kernel is built, loaded and multiplies on this CPU, and its operators run
    (c_kernels.load_operators), else why not."""
    if not _kernel:
        try:
            library = load_library(SOURCE)
            if not library.group_kernel_available():
                raise RuntimeError("this CPU has neither AVX-512 BF16 nor AVX2 with FMA and F16C")
            _kernel["floats"] = bool(library.group_kernel_floats())
            _kernel["bfloat16"] = bool(library.group_kernel_bfloat16())
            _kernel["library"] = library
            _kernel["problem"] = load_operators()
        except (OSError, RuntimeError) as e:
            _kernel["problem"] = why_not(e)
    return _kernel["problem"]


def takes_float32() -> bool:
    """Whether the kernel multiplies float32 rows (its AVX2 path, in any build on a CPU with
    AVX2, FMA and F16C: it works in float32 whatever the rows' dtype). The w4a8 format then
    keeps float32 activations, as float32 decoding does, and loses nothing to bfloat16's
    rounding before its rows are quantized; so does int4 where bfloat16 rows would go to
    float32 anyway (no AVX-512 BF16: multiplies_bfloat16)."""
    return kernel_problem() is None and _kernel["floats"]


def multiplies_bfloat16() -> bool:
    """Whether the kernel multiplies bfloat16 rows as they are (AVX-512 BF16's dot products,
    or AMX tiles): there int4 keeps bfloat16 activations, half float32's bytes."""
    return kernel_problem() is None and _kernel["bfloat16"]


def uses_vnni() -> bool:
    """Whether this process multiplies w4a8's quantized rows by AVX-512 VNNI (VPDPBUSD and
    VPDPWSSD, 16 outputs an instruction) rather than the AVX2 code (group_kernel.c's VNNI
    path: the same bits, fewer instructions a row)."""
    return kernel_problem() is None and bool(_kernel["library"].group_kernel_vnni(-1))


def switch_vnni(on: bool) -> bool:
    """Switch the VNNI path off (or back on where the build has it) for this process, and say
    whether it is in use: for side-by-side timings (bench --profile) and the test that both
    paths give the same bits."""
    return kernel_problem() is None and bool(_kernel["library"].group_kernel_vnni(int(on)))


def uses_tiles() -> bool:
    """Whether this process multiplies bfloat16 rows with AMX tiles (group_kernel.c's tile path:
    a CPU with AMX, whose Linux kernel granted their state; the first call asks for it) rather
    than AVX-512 BF16's dot products: a tree's 16 rows then cost about what one row does."""
    return kernel_problem() is None and bool(_kernel["library"].group_kernel_tiles(-1))


def switch_tiles(on: bool) -> bool:
    """Switch the AMX tiles off (or back on where granted) for this process, and say whether
    they are in use: for side-by-side timings only (bench --profile), since a row's bits differ
    between the two paths, and greedy Medusa is lossless only within one."""
    return kernel_problem() is None and bool(_kernel["library"].group_kernel_tiles(int(on)))


def expected_here() -> bool:
    """Whether this CPU lists what the kernel multiplies with (AVX-512 BF16, or AVX2 and FMA):
    there, a kernel that does not multiply is a fault (no compiler, a failed build) worth a
    line; elsewhere torch's int4 kernel is the normal case."""
    features = cpu_features().split("+")
    return "avx512_bf16" in features or {"avx2", "fma"} <= set(features)


def require_kernel() -> None:
    """Raise, saying why in one line, where group_kernel.c does not multiply on this machine;
    builds and loads it at the first call. The layers that multiply through it call this when
    they are made, so that their products (a decoding step's hot path) need not ask again."""
    problem = kernel_problem()
    if problem is not None:
        raise RuntimeError(f"group_kernel.c does not multiply on this machine: {problem}")


def pack_int4(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor):
    """weight_formats.quantize_int4's (N, K) q, (N, G) scales and minimums -> the kernel's
    layout: (B, K / 4, 32) bytes, per block and quad of inputs k..k+3 the 16 outputs' two bytes
    side by side, output o's byte j: q[o][k + j] | q[o][k + 2 + j] << 4; (B, G, 16) float16
    scales and minimums. note: float16 as Q4_1 stores them, so a 4-bit file's are kept exactly;
    another model's are rounded (10 bits: far below int4's own step)."""
    N, K = q.shape
    quads = q.view(N // 16, 16, K // 4, 2, 2).to(torch.uint8)  # (B, o, quad, k // 2 % 2, k % 2)
    packed = quads[..., 0, :] | quads[..., 1, :] << 4  # (B, o, quad, j)
    return (packed.permute(0, 2, 1, 3).reshape(N // 16, K // 4, 32).contiguous(),
            by_block(scales), by_block(minimums))  # (B, G, 16) each


def pack_int4_a8(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor):
    """quantize_int4's (N, K) q, (N, G) scales and minimums -> the w4a8 kernel's layout, as
    VPMADDUBSW pairs 8-bit activations with them: (B, K / 8, 64) bytes, per block and chunk of
    8 inputs two halves of 8 outputs, in each output o's 4 bytes, byte j: q[o][k + j] | q[o][k +
    4 + j] << 4; scales and minimums as pack_int4's."""
    N, K = q.shape
    q = q.view(N // 16, 2, 8, K // 8, 2, 4).to(torch.uint8)  # (B, half, o, chunk, k // 4, k % 4)
    q = q.permute(0, 3, 1, 2, 5, 4)  # (B, chunk, half, o, k % 4, k // 4)
    packed = (q[..., 0] | q[..., 1] << 4).reshape(N // 16, K // 8, 64).contiguous()
    return packed, by_block(scales), by_block(minimums)  # (B, G, 16) each


def pack_int8(q: torch.Tensor, scales: torch.Tensor):
    """weight_formats.quantize_int8_groups's (N, K) q and (N, G) scales -> the kernel's layout:
    (B, K / 2, 32) bytes, per pair of inputs the 16 outputs' two q side by side; (B, G, 16)
    float16 scales (as Q8_0 stores them)."""
    N, K = q.shape
    pairs = q.view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3)  # (B, K / 2, 16, 2)
    return pairs.reshape(N // 16, K // 2, 32).view(torch.uint8).contiguous(), by_block(scales)


def pack_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    """An (N, K) weight -> the kernel's bfloat16 layout: (B, 32 K) bytes, per block and pair of
    inputs the 16 outputs' two weights side by side, as VDPBF16PS pairs them (pack_int8's
    order, in bfloat16)."""
    N, K = weight.shape
    pairs = weight.detach().bfloat16().view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3)
    return pairs.contiguous().view(torch.uint8).reshape(N // 16, 32 * K)  # (B, K/2, 16, 2)


def unpack_int8(packed: torch.Tensor, scales: torch.Tensor):
    """pack_int8's inverse: (N, K) int8 q and (N, G) float32 scales."""
    B, G = scales.shape[:2]
    q = packed.view(torch.int8).view(B, G * 16, 16, 2).permute(0, 2, 1, 3)  # (B, 16, K / 2, 2)
    return q.reshape(B * 16, G * 32), scales.permute(0, 2, 1).reshape(B * 16, G).float()


def by_block(t: torch.Tensor) -> torch.Tensor:
    """(N, G) per output and group -> (B, G, 16) float16: a block's 16 outputs side by side."""
    N = t.shape[0]
    return t.half().view(N // 16, 16, -1).permute(0, 2, 1).contiguous()


# rows (M, K) bfloat16 (or float32, takes_float32) times a packed weight: (M, N), the rows'
# dtype (the int8 layout's: float32 where `wide`, a model's logits). int4_a8_product and
# int4_a16_product quantize the rows to 8 or 16 bits a group of 32 inside the kernel (the w4a8
# format), both on pack_int4_a8's layout; int8_a16_product to 16 bits, on pack_int8's (w4a8's
# LM head).
# Each operator's fake (its output's shape, for the compiler's tracing) is here, what it runs
# on a CPU in operators.cpp.
OPERATORS.define("int4_product(Tensor rows, Tensor packed, Tensor scales, Tensor minimums) "
                 "-> Tensor")
OPERATORS.define("int4_a8_product(Tensor rows, Tensor packed, Tensor scales, Tensor minimums) "
                 "-> Tensor")
OPERATORS.define("int4_a16_product(Tensor rows, Tensor packed, Tensor scales, Tensor minimums) "
                 "-> Tensor")
OPERATORS.define("int8_product(Tensor rows, Tensor packed, Tensor scales, bool wide=False) "
                 "-> Tensor")
OPERATORS.define("int8_a16_product(Tensor rows, Tensor packed, Tensor scales, bool wide=False) "
                 "-> Tensor")
OPERATORS.define("bf16_product(Tensor rows, Tensor packed, bool wide=False) -> Tensor")


@torch.library.register_fake("minimedusa::int4_product")
def _(rows, packed, scales, minimums):
    return rows.new_empty(rows.shape[0], scales.shape[0] * 16)


@torch.library.register_fake("minimedusa::int4_a8_product")
def _(rows, packed, scales, minimums):
    return rows.new_empty(rows.shape[0], scales.shape[0] * 16)


@torch.library.register_fake("minimedusa::int4_a16_product")
def _(rows, packed, scales, minimums):
    return rows.new_empty(rows.shape[0], scales.shape[0] * 16)


@torch.library.register_fake("minimedusa::int8_product")
def _(rows, packed, scales, wide=False):
    return rows.new_empty(rows.shape[0], scales.shape[0] * 16,
                          dtype=torch.float32 if wide else rows.dtype)


@torch.library.register_fake("minimedusa::int8_a16_product")
def _(rows, packed, scales, wide=False):
    return rows.new_empty(rows.shape[0], scales.shape[0] * 16,
                          dtype=torch.float32 if wide else rows.dtype)


@torch.library.register_fake("minimedusa::bf16_product")
def _(rows, packed, wide=False):
    return rows.new_empty(rows.shape[0], packed.shape[0] * 16,
                          dtype=torch.float32 if wide else rows.dtype)

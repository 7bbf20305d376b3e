"""The w4a8 format: int4 weights times 8-bit activations in wo and gate_up (group_kernel.c's
int4_a8_product), 16-bit ones in wqkv and down (int4_a16_product) and its 8-bit LM head
(int8_a16_product). The slow reference quantizes each row's groups of 32 as the kernel does (d =
max |x| / 127 or / 32767, a = x / d to nearest), then multiplies the dequantized activations by
the dequantized weight. A row's bits do not depend on
the rows beside it, so greedy Medusa stays lossless with respect to w4a8's own plain decoding."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from helpers import (copycat_model, flat, four_bit_model, four_bit_weight, needs_group_kernel,
                    perturbed, quantized_rows, w4a8_reference)
from minimedusa.acceptance import Sampling, greedy
from minimedusa.bench.step_profile import product_times
from minimedusa.budget import fixed
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.heads import HydraHeads, MedusaHeads
from minimedusa.model import causal_mask
from minimedusa.speed import group_kernel
from minimedusa.speed.grids import dequantize_int8_groups, quantize_int8_groups
from minimedusa.speed.quantized import Int4A8KernelLinear, Int4A16KernelLinear, Int8A16GroupLinear
from minimedusa.speed.plug_in import how_it_runs
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree

pytestmark = [pytest.mark.kernels, needs_group_kernel]


# each product of w4a8, and the largest integer its activations are rounded to
PRODUCTS = [(Int4A8KernelLinear, 127), (Int4A16KernelLinear, 32767)]


@pytest.mark.parametrize("kind, largest", PRODUCTS, ids=["8-bit", "16-bit"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), bias=st.booleans(),
       floats=st.booleans())
def test_w4a8_product_equals_quantize_the_activations_then_matmul(kind, largest, seed, rows,
                                                                   bias, floats):
    """Within the float32 sums' rounding, for bfloat16 rows and (where the kernel takes them)
    float32 ones."""
    if floats and not group_kernel.takes_float32():
        floats = False  # this CPU's kernel takes bfloat16 rows only
    linear = nn.Linear(96, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(48, 96, seed))
    layer = kind(linear)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed))
    x = x if floats else x.bfloat16()
    reference = w4a8_reference(x, linear.weight, largest) + (layer.bias.double() if bias else 0)
    tolerance = 1e-4 if floats else 1e-2  # the output rounded to float32, or to bfloat16
    torch.testing.assert_close(layer(x).double(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", [kind for kind, _ in PRODUCTS], ids=["8-bit", "16-bit"])
def test_a_w4a8_rows_product_has_the_same_bits_whatever_rows_beside_it(kind):
    linear = nn.Linear(1536, 576, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(576, 1536))
    layer = kind(linear)
    rows = torch.randn(65, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = layer(rows[:1])  # (1, N)
    # every tree size up to the paper's 65 rows
    assert all(torch.equal(layer(rows[:m])[:1], alone) for m in range(2, 66))
    assert torch.equal(layer(rows.flip(0))[-1:], alone)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20))
def test_w4a8_lm_head_equals_quantize_the_activations_then_matmul(seed, rows):
    """8-bit groups times 16-bit activations (Int8A16GroupLinear), float32 rows where the kernel
    takes them, else bfloat16."""
    g = torch.Generator().manual_seed(seed)
    q, scales = quantize_int8_groups(torch.randn(48, 96, generator=g))
    layer = Int8A16GroupLinear(q, scales.half().float())
    dtype = torch.float32 if group_kernel.takes_float32() else torch.bfloat16
    x = torch.randn(rows, 96, generator=g).to(dtype)
    weight = dequantize_int8_groups(q, scales.half().float()).double()  # (N, K)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(layer(x).double(), quantized_rows(x, 32767) @ weight.T,
                               rtol=tolerance, atol=tolerance)


def test_a_w4a8_lm_head_rows_product_has_the_same_bits_whatever_rows_beside_it():
    weight = torch.randn(4096, 576, generator=torch.Generator().manual_seed(1))
    q, scales = quantize_int8_groups(weight)
    layer = Int8A16GroupLinear(q, scales)
    rows = torch.randn(65, 576, generator=torch.Generator().manual_seed(0))
    rows = rows if group_kernel.takes_float32() else rows.bfloat16()
    alone = layer(rows[:1])
    # every tree size up to the paper's 65 rows
    assert all(torch.equal(layer(rows[:m])[:1], alone) for m in range(2, 66))


@pytest.mark.skipif(not group_kernel.uses_vnni(), reason="group_kernel.c has no VNNI path here")
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), floats=st.booleans())
def test_w4a8s_vnni_path_gives_its_avx2_codes_bits(seed, rows, floats):
    """Each of w4a8's three products on AVX-512 VNNI and on the AVX2 code, in one process: the
    same bits, so what format_quality measured of w4a8 on an AVX2 CPU holds on this one."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(48, 96, seed))
    q, scales = quantize_int8_groups(torch.randn(48, 96, generator=g))
    layers = [Int4A8KernelLinear(linear), Int4A16KernelLinear(linear),
              Int8A16GroupLinear(q, scales.half().float())]
    x = torch.randn(rows, 96, generator=g)
    x = x if floats and group_kernel.takes_float32() else x.bfloat16()
    try:
        for layer in layers:
            on = (group_kernel.switch_vnni(True), layer(x))
            off = (group_kernel.switch_vnni(False), layer(x))
            assert on[0] and not off[0] and torch.equal(on[1], off[1])
    finally:
        group_kernel.switch_vnni(True)


@pytest.mark.skipif(not group_kernel.uses_vnni(), reason="group_kernel.c has no VNNI path here")
def test_the_step_profile_times_w4a8s_products_on_vnni_and_on_the_avx2_code_in_turns():
    model = apply_format(four_bit_model(0), format_named("w4a8"))
    text = product_times(model, rows=(1, 2), rounds=1)
    assert "head's, VNNI\n" in text and "head's, AVX2 code\n" in text
    assert group_kernel.uses_vnni()  # back on afterwards, as the process had it


def test_a_model_in_w4a8_stays_close_to_float32_and_says_so():
    model = four_bit_model(3)
    tokens, positions, mask = torch.randint(0, 64, (1, 9)), torch.arange(9)[None], causal_mask(0, 9)
    with torch.inference_mode():
        reference, _ = model(tokens, positions, mask)
        w4a8 = apply_format(model, format_named("w4a8"))
        logits, _ = w4a8(tokens, positions, mask)
    assert w4a8.weight_format.name == "w4a8" and type(w4a8.lm_head) is Int8A16GroupLinear
    assert all(isinstance(block.attn.wo, Int4A8KernelLinear) and
               isinstance(block.mlp.gate_up, Int4A8KernelLinear) for block in w4a8.layers)
    assert all(type(layer) is Int4A16KernelLinear for block in w4a8.layers
               for layer in (block.attn.wqkv, block.mlp.down))
    path = "(group_kernel.c, AVX-512 VNNI)" if group_kernel.uses_vnni() else "(group_kernel.c)"
    assert (f"w4a8 weights {path}, 8-bit activations in wo gate_up, 16-bit activations in wqkv "
            "down, 8-bit LM head (16-bit activations)" in how_it_runs(w4a8))  # and in its
    # latencies' key: the same model's steps cost otherwise on another path
    assert (logits.float() - reference).abs().max() / reference.abs().max() <= 3e-2


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_medusa_greedy_equals_w4a8s_plain_greedy(kind, seed):
    """On a model where candidates are accepted (copycat) and on a 4-bit model with an 8-bit LM
    head, heads in the same format."""
    for model in (copycat_model(seed, dtype=torch.float32), four_bit_model(seed)):
        model = apply_format(model, format_named("w4a8"))
        heads = (perturbed(MedusaHeads.for_model(model, 4, num_layers=1), seed, 0.05)
                 if kind == "medusa" else HydraHeads.for_model(model, 4))
        heads = apply_format(heads.float().eval(), format_named("w4a8"))
        tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
        prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
        assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 40, set())) == plain


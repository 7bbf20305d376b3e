"""group_kernel.c's AMX tile path (an Intel CPU with AMX whose Linux kernel grants the tiles'
state; skipped elsewhere). test_weight_formats.py's reference tests run through it there too
(int4 and 8-bit products == dequantize-then-multiply, a row's bits at 1-17 rows); here what is
the tiles' own: passes of 16 rows, the same bits for a row wherever it sits among 40, the same
products as the dot products they replace (within bfloat16's rounding), and the step's name."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from minimedusa.speed import group_kernel
from minimedusa.speed.plug_in import how_it_runs, plug_in
from minimedusa.speed.weight_formats import format_named
from minimedusa.speed.grids import eight_bit_groups
from minimedusa.speed.quantized import Int4KernelLinear, Int8GroupLinear
from helpers import eight_bit_weight, four_bit_model, four_bit_weight

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(
                  not group_kernel.uses_tiles(), reason="no AMX tiles here (an Intel CPU with "
                  "AMX, whose Linux kernel grants their state)")]


def int4_layer(N: int, K: int, seed: int) -> Int4KernelLinear:
    linear = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(N, K, seed))
    return Int4KernelLinear(linear)


def both_paths(layer, x):
    """The layer's product of x on the tiles and by the dot products (tiles switched off for
    the one call, then on again)."""
    tiles = layer(x)
    try:
        assert not group_kernel.switch_tiles(False)
        dots = layer(x)
    finally:
        assert group_kernel.switch_tiles(True)
    return tiles, dots


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 40), bits=st.sampled_from([4, 8]))
def test_tiles_give_the_dot_products_results_within_bfloat16s_rounding(seed, rows, bits):
    layer = (int4_layer(48, 96, seed) if bits == 4
             else Int8GroupLinear(*eight_bit_groups(eight_bit_weight(48, 96, seed))))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).bfloat16()
    tiles, dots = both_paths(layer, x)
    torch.testing.assert_close(tiles.float(), dots.float(), rtol=2e-2, atol=2e-2)


def test_a_rows_bits_on_tiles_are_the_same_wherever_it_sits_among_40_rows():
    """Rows pass through the tiles 16 at a time (then the rest): the first row alone, and at
    every place among 40 rows (in the first, second and third pass), gives the same bits."""
    layer = int4_layer(576, 1536, 0)
    rows = torch.randn(40, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = layer(rows[:1])
    for at in (0, 5, 15, 16, 31, 32, 39):
        others = torch.cat([rows[1:at + 1], rows[:1], rows[at + 1:]])  # row 0 moved to `at`
        assert torch.equal(layer(others)[at:at + 1], alone)


def test_a_model_on_tiles_says_so():
    model = four_bit_model(0)
    plug_in(model, format_named("int4"), None)
    assert "(group_kernel.c, AMX tiles)" in how_it_runs(model)

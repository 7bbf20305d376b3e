"""group_kernel.c's products at the shapes real models multiply, against the exact product (in
float64, of the same rows and the weights the layer holds), within a bound derived from the
arithmetic rather than a tolerance picked to pass. A float32 sum of K terms, each of its K + 2
roundings (the additions, a group's scale and minimum) within u = 2^-24, is within
lambda sqrt(K + 2) u sum_i |w_i x_i| of the exact sum but with probability 2 exp(-lambda^2 / 2)
(the roundings' errors are independent and centred: Higham and Mary, 2019); lambda = 10 makes
that 4e-22 an output. (The worst case, (K + 2) u sum |w x|, is too loose to see a wrong group at
K = 5,632.) An output rounded to bfloat16 adds 2^-8 of itself. The bound catches a result that
same-bits tests cannot see (one wrong the same way every time): one group of 32 inputs, among
K / 32, read twice."""
import pytest
import torch
import torch.nn as nn

from minimedusa.speed import group_kernel
from minimedusa.speed.grids import GROUP, dequantize_int8_groups, eight_bit_groups
from minimedusa.speed.quantized import BF16KernelLinear, Int4KernelLinear, Int8GroupLinear
from helpers import eight_bit_weight, four_bit_weight

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                                 reason="group_kernel.c does not multiply on this CPU")]

U = 2.0 ** -24  # float32's unit roundoff
LAMBDA = 10.0
# (N outputs, K inputs): the default model's wqkv, wo, gate_up, down, and a 1B model's gate_up
# and down (TinyLlama's shape)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (11264, 2048), (2048, 5632)]


def rows_for(K: int, M: int = 3) -> torch.Tensor:
    dtype = torch.bfloat16 if group_kernel.multiplies_bfloat16() else torch.float32
    return torch.randn(M, K, generator=torch.Generator().manual_seed(K)).to(dtype)


def within_bound(got: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Where |got - x w^T| is within the derived bound: (M, N) bool."""
    w, x = weight.double(), x.double()
    exact = x @ w.T  # (M, N)
    K = w.shape[1]
    bound = LAMBDA * (K + 2) ** 0.5 * U * (x.abs() @ w.abs().T)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    return (got.double() - exact).abs() <= bound


@pytest.mark.parametrize("N, K", SHAPES)
def test_an_int4_product_at_a_real_shape_is_within_the_derived_bound(N, K):
    linear = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(N, K))
    layer, x = Int4KernelLinear(linear), rows_for(K)
    with torch.inference_mode():
        got = layer(x)
    assert within_bound(got, linear.weight, x).all()
    wrong = linear.weight.clone()
    wrong[0, :GROUP] *= 2  # the control: one group of one output counted twice
    assert not within_bound(got, wrong, x).all()


@pytest.mark.parametrize("wide", [True, False], ids=["float32 out", "rows' dtype out"])
@pytest.mark.parametrize("N, K", [(49152, 576), (2048, 2048)])
def test_an_eight_bit_product_at_a_real_shape_is_within_the_derived_bound(N, K, wide):
    """The default model's LM head (49,152 x 576) and a square product."""
    q, scales = eight_bit_groups(eight_bit_weight(N, K))
    layer, x = Int8GroupLinear(q, scales, wide=wide), rows_for(K)
    weight = dequantize_int8_groups(q, scales)
    with torch.inference_mode():
        got = layer(x)
    assert within_bound(got, weight, x).all()
    wrong = weight.clone()
    wrong[5, GROUP:2 * GROUP] *= 2
    assert not within_bound(got, wrong, x).all()


@pytest.mark.skipif(not group_kernel.multiplies_bfloat16(),
                    reason="group_kernel.c multiplies bfloat16 weights on AVX-512 BF16 only")
@pytest.mark.parametrize("N, K", SHAPES)
def test_a_bfloat16_product_at_a_real_shape_is_within_the_derived_bound(N, K):
    """bfloat16 weights times bfloat16 rows: each product exact in float32 (8 + 8 bits), the
    sums float32's, the output rounded to bfloat16; and every row's bits the same whatever rows
    sit beside it, up to the paper's 65."""
    linear = nn.Linear(K, N, bias=False)
    layer, x = BF16KernelLinear(linear), rows_for(K, 65)
    weight = linear.weight.detach().bfloat16().float()
    with torch.inference_mode():
        got = layer(x)
        assert all(torch.equal(layer(x[:m])[:1], got[:1]) for m in (1, 2, 5, 17, 65))
    assert within_bound(got, weight, x).all()
    wrong = weight.clone()
    wrong[0, :GROUP] *= 2
    assert not within_bound(got, wrong, x).all()

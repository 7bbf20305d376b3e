"""The model's fast paths agree with their references."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minimedusa.model import FewRowLinear


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       bias=st.booleans())
def test_few_row_linear_equals_nn_linear(seed, shape, bias):
    """(W @ x^T)^T for a few float32 rows (one row doubled) gives nn.Linear's output in every
    shape, with or without a bias, and a contiguous one (attention's fused kernel needs it)."""
    torch.manual_seed(seed)
    linear = FewRowLinear(16, 300, bias=bias)
    x = torch.randn(*shape, 16)
    y = linear(x)
    torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert y.is_contiguous()

"""The model's fast paths agree with their references."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minimedusa.model import ONEDNN_LINEAR, PackedLinear

needs_onednn = pytest.mark.skipif(not ONEDNN_LINEAR,
                                  reason="this torch build has no oneDNN linear")


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       bias=st.booleans())
def test_packed_linear_equals_nn_linear(seed, shape, bias):
    """Decoding's product with the prepacked weight gives nn.Linear's output in every shape,
    with or without a bias."""
    torch.manual_seed(seed)
    linear = PackedLinear(16, 300, bias=bias)
    x = torch.randn(*shape, 16)
    with torch.inference_mode():
        y = linear(x)
    assert linear.packed is not None  # the packed path ran
    torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_weight_never_goes_stale():
    """Written in place, replaced, or cast away and back: the next product uses the new
    weight. A deep copy (joint training copies the model) packs its own."""
    torch.manual_seed(0)
    linear, x = PackedLinear(16, 30), torch.randn(3, 16)

    def agrees():
        with torch.no_grad():
            torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))

    agrees()
    with torch.no_grad():
        linear.weight.mul_(2)
    agrees()
    linear.weight = nn.Parameter(torch.randn(30, 16))
    agrees()
    linear.double().float()
    agrees()
    twin = copy.deepcopy(linear)
    assert twin.packed is None and twin.weight.data_ptr() != linear.weight.data_ptr()


def test_packed_linear_trains_like_nn_linear():
    """With gradients on, the layer is nn.Linear: the backward pass reaches the weight."""
    linear = PackedLinear(16, 30)
    linear(torch.randn(3, 16)).sum().backward()
    assert linear.weight.grad is not None and linear.packed is None

"""The model's fast paths agree with their references."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minimedusa.model import LMHead


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3))
def test_lm_head_few_row_path_equals_nn_linear(seed, shape):
    """(W @ x^T)^T for a few float32 rows (one row doubled) gives nn.Linear's logits, in every
    shape (the path is float32's only)."""
    torch.manual_seed(seed)
    head = LMHead(16, 300, bias=False)
    x = torch.randn(*shape, 16)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-5)

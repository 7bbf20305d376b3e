"""The model's fast paths agree with their references."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minimedusa.model import LMHead


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_lm_head_few_row_path_equals_nn_linear(seed, shape, dtype):
    """(W @ x^T)^T for a few rows (one row doubled) gives nn.Linear's logits, in every shape."""
    torch.manual_seed(seed)
    head = LMHead(16, 300, bias=False).to(dtype)
    x = torch.randn(*shape, 16, dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 1e-12}
    torch.testing.assert_close(head(x), F.linear(x, head.weight), **tol)

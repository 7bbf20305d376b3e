"""The CPU's prepacked linear layers agree with nn.Linear, their reference, and swapping them
into a model changes no output and keeps a tied LM head tied."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from minimedusa.heads import MedusaHeads
from minimedusa.model import causal_mask
from minimedusa.speed.packed_linear import ONEDNN_LINEAR, PackedLinear, pack_linear_layers

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
    linear = nn.Linear(16, 300, bias=bias)
    x = torch.randn(*shape, 16)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_has_the_same_bits_whatever_rows_beside_it(dtype):
    """A plain step's one row equals, to the bit, the same row multiplied in a tree step of any
    size (what keeps Medusa greedy lossless); at 1536 inputs oneDNN's one-row kernel alone would
    round some outputs differently."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN does not multiply bfloat16 natively on this CPU")
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(1536, 576, bias=False).to(dtype))
    rows = torch.randn(65, 1536, dtype=dtype)  # (M, I)
    with torch.inference_mode():
        alone = layer(rows[:1])  # (1, O)
        # every tree size up to the paper's 65 rows
        assert all(torch.equal(layer(rows[:m])[:1], alone) for m in range(2, 66))


@needs_onednn
@pytest.mark.parametrize("shared", [False, True])
def test_packed_model_and_heads_give_the_same_logits(shared):
    """Every projection of the model and the heads swapped (tied LM head included): the same
    logits as the plain nn.Linear model, and the LM head still IS the embedding."""
    model = tiny_model(3, dtype=torch.float32, tie_word_embeddings=True)
    heads = MedusaHeads.for_model(model, 3, shared_lm_head=shared).eval()
    for p in heads.parameters():
        p.data.normal_(0, 0.1)
    tokens = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        logits, hidden = model(tokens, torch.arange(9)[None], causal_mask(0, 9))
        head_logits = heads(hidden, model.lm_head)
        swapped = pack_linear_layers(model) + pack_linear_layers(heads)
        packed_logits, packed_hidden = model(tokens, torch.arange(9)[None], causal_mask(0, 9))
        packed_heads = heads(packed_hidden, model.lm_head)
    assert swapped == 2 * 4 + 1 + 3 * (1 if shared else 2)  # 2 blocks, LM head, the heads
    assert model.lm_head.weight is model.embed.weight
    torch.testing.assert_close(packed_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_heads, head_logits, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_with_gradients_is_nn_linear():
    """With gradients on (never in decoding), the layer falls back to nn.Linear's product, so a
    backward pass still reaches the weight."""
    linear = nn.Linear(16, 30)
    PackedLinear(linear)(torch.randn(3, 16)).sum().backward()
    assert linear.weight.grad is not None

"""Every C kernel's torch operator (speed/operators.cpp and its siblings) at the edges of its shapes, against its
reference (hypothesis): products of 0 to 20 rows, of 16 to 80 outputs and 32 to 224 inputs (a
tail of blocks and groups past any vector or task width), rows laid out as inductor may pass
them; the attention of 1 to 3 sequences, 1 to 9 rows, 1 slot to a full cache, head dims the
models use and tails (8, 80); the fused blocks of 1 to 3 sequences at slots to the cache's last.
And each operator refusing, in one line naming the problem, what it does not take (a wrong
shape, dtype or layout, an index outside the tree), instead of reading past it. Their memory is
checked by running these under AddressSanitizer: MINIMEDUSA_SANITIZE=address python -m pytest
-q -m kernels (speed/sanitizer.py)."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from minimedusa.kv_cache import KVCache
from minimedusa.speed.fused_draft import FusedHydraDraft
from minimedusa.tree import build_tree
from minimedusa.model import exact_attention
from minimedusa.speed import attention_kernel, group_kernel
from minimedusa.speed.grids import eight_bit_groups
from minimedusa.speed.quantized import (BF16KernelLinear, Int4A8KernelLinear, Int4A16KernelLinear,
                                        Int4KernelLinear, Int8A16GroupLinear, Int8GroupLinear)
from minimedusa.speed.weight_formats import apply_format, format_named
from helpers import (eight_bit_weight, four_bit_model, four_bit_weight, fused,
                    hydra_draft_setup as draft_setup, quantized_rows, within_rounding)

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(group_kernel.kernel_problem() is not None
                                 or attention_kernel.kernel_problem() is not None,
                                 reason="the C kernels are not built here")]

# each product: (its layer, the largest integer its rows are rounded to inside the kernel, or
# None: multiplied as they are)
PRODUCTS = {"int4": (Int4KernelLinear, None), "int4_a8": (Int4A8KernelLinear, 127),
            "int4_a16": (Int4A16KernelLinear, 32767), "int8": (Int8GroupLinear, None),
            "int8_a16": (Int8A16GroupLinear, 32767), "bf16": (BF16KernelLinear, None)}


def product_layer(kind: str, N: int, K: int, seed: int):
    """(the operator's layer, its weight (N, K) as float64) for a weight on its grid."""
    layer, _ = PRODUCTS[kind]
    if kind.startswith("int8"):
        weight = eight_bit_weight(N, K, seed)
        return layer(*eight_bit_groups(weight)), weight.double()
    linear = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(N, K, seed))
    if kind == "bf16":
        return layer(linear), linear.weight.bfloat16().double()
    return layer(linear), linear.weight.double()


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x (M, K) as a caller may hand it: contiguous, every other row of a larger tensor, or
    the transpose of a (K, M) one."""
    if layout == "strided":
        wider = torch.zeros(2 * x.shape[0], x.shape[1], dtype=x.dtype)
        wider[::2] = x
        return wider[::2]
    if layout == "transposed":
        return x.t().contiguous().t()
    return x


def row_dtypes(kind: str) -> list[torch.dtype]:
    """The rows' dtypes this CPU's kernel multiplies for the product."""
    if kind == "bf16":
        return [torch.bfloat16] if group_kernel.multiplies_bfloat16() else []
    return [torch.bfloat16] + ([torch.float32] if group_kernel.takes_float32() else [])


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(list(PRODUCTS)), M=st.integers(0, 20), blocks=st.integers(1, 5),
       groups=st.integers(1, 7), layout=st.sampled_from(["contiguous", "strided", "transposed"]),
       seed=st.integers(0, 1000), data=st.data())
def test_each_product_gives_its_reference_at_any_shape_and_layout(kind, M, blocks, groups,
                                                                  layout, seed, data):
    dtypes = row_dtypes(kind)
    if not dtypes:
        return  # no bfloat16 weights on this CPU
    dtype = data.draw(st.sampled_from(dtypes))
    N, K = 16 * blocks, 32 * groups
    layer, weight = product_layer(kind, N, K, seed)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = layer(laid_out(x, layout))
    assert got.shape == (M, N) and torch.equal(got, layer(x))  # the layout changes no bit
    largest = PRODUCTS[kind][1]
    rows = x.double() if largest is None else quantized_rows(x, largest)
    tolerance = 1e-4 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), rows @ weight.T, rtol=tolerance, atol=tolerance)


def one_line_error(call, *words: str) -> None:
    """call() raises one line naming `words` (torch's error, not a crash past the tensors)."""
    with pytest.raises((RuntimeError, TypeError, IndexError)) as caught:
        call()
    first = str(caught.value).strip().splitlines()[0]
    assert all(word in first for word in words), first


@pytest.mark.parametrize("kind", list(PRODUCTS))
def test_each_product_refuses_what_does_not_fit_its_weight_in_one_line(kind):
    if not row_dtypes(kind):
        pytest.skip("no bfloat16 weights on this CPU")
    layer, _ = product_layer(kind, 32, 64, 0)
    op = layer.product
    name = op._qualified_op_name.split("::")[1]
    x = torch.randn(3, 64).to(row_dtypes(kind)[0])
    scales = () if kind == "bf16" else (layer.scales,)
    minimums = (layer.minimums,) if kind.startswith("int4") else ()
    one_line_error(lambda: op(torch.randn(3, 96).to(x.dtype), layer.packed, *scales, *minimums),
                   name)  # rows of another width
    one_line_error(lambda: op(x[None], layer.packed, *scales, *minimums), name)  # 3-D rows
    one_line_error(lambda: op(x.double(), layer.packed, *scales, *minimums))  # float64 rows
    one_line_error(lambda: op(x, layer.packed[..., :-1], *scales, *minimums), name)  # cut
    one_line_error(lambda: op(x, layer.packed.view(torch.int8), *scales, *minimums), name)
    if scales:
        one_line_error(lambda: op(x, layer.packed, scales[0].float(), *minimums), name)
        one_line_error(lambda: op(x, layer.packed, scales[0][:, :1], *minimums), name)
    if minimums:
        one_line_error(lambda: op(x, layer.packed, *scales, minimums[0][:1]), name)


def attention_inputs(B, G, R, T, S, capacity, D, dtype, shared_mask, q_layout, seed):
    """q (B, H, T, D) laid out as a block or a caller makes it, k and v slots [0, S) of a cache
    of `capacity`, a random mask (B or 1, 1, T, S) in which every row sees a slot."""
    g = torch.Generator().manual_seed(seed)
    H = G * R
    if q_layout == "block":  # (B, T, H, D) memory, as the block's reshape leaves it
        q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    elif q_layout == "strided":  # every other value of its last dim: made contiguous
        q = torch.randn(B, H, T, 2 * D, generator=g).to(dtype)[..., ::2]
    else:
        q = torch.randn(B, H, T, D, generator=g).to(dtype)
    cache = torch.randn(2, B, G, capacity, D, generator=g).to(dtype)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    mask = torch.rand(1 if shared_mask else B, 1, T, S, generator=g) < 0.6
    mask[..., torch.randint(0, S, (T,), generator=g)] = True  # no row sees nothing
    return q, k, v, mask


@settings(max_examples=80, deadline=None)
@given(B=st.integers(1, 3), G=st.integers(1, 3), R=st.integers(1, 3), T=st.integers(1, 9),
       capacity=st.integers(1, 40), D=st.sampled_from([8, 32, 64, 80, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), shared_mask=st.booleans(),
       q_layout=st.sampled_from(["block", "contiguous", "strided"]), seed=st.integers(0, 1000),
       data=st.data())
def test_attention_gives_the_reference_at_any_shape(B, G, R, T, capacity, D, dtype, shared_mask,
                                                    q_layout, seed, data):
    """S from one slot to the cache's capacity (a step that fills it)."""
    S = data.draw(st.sampled_from(sorted({1, capacity, (capacity + 1) // 2})))
    q, k, v, mask = attention_inputs(B, G, R, T, S, capacity, D, dtype, shared_mask, q_layout,
                                     seed)
    got = torch.ops.minimedusa.step_attention(q, k, v, mask)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, exact_attention(q, k, v, mask), **tolerance)


def test_attention_refuses_what_does_not_fit_in_one_line():
    q, k, v, mask = attention_inputs(2, 2, 2, 3, 5, 8, 64, torch.float32, False, "block", 0)
    attend = torch.ops.minimedusa.step_attention
    one_line_error(lambda: attend(q, k[..., :0, :], v[..., :0, :], mask[..., :0]),
                   "at least one slot")  # S = 0
    one_line_error(lambda: attend(q, k, v, mask[..., :4]), "mask")  # the mask of 4 slots of 5
    one_line_error(lambda: attend(q, k, v, mask[:, :, :2]), "mask")  # of 2 rows of 3
    one_line_error(lambda: attend(q, k[:1], v[:1], mask), "do not fit")  # one sequence's keys
    one_line_error(lambda: attend(q, k, v.contiguous(), mask), "v laid out as k")
    one_line_error(lambda: attend(q, k.transpose(2, 3), v.transpose(2, 3), mask))
    one_line_error(lambda: attend(q.bfloat16(), k, v, mask), "float32 or all bfloat16")
    one_line_error(lambda: attend(q, k, v, mask.int()), "bool")
    one_line_error(lambda: attend(q[0], k, v, mask), "4-D")
    wide = torch.zeros(2, 4, 3, 272)
    one_line_error(lambda: attend(wide, torch.zeros(2, 2, 5, 272), torch.zeros(2, 2, 5, 272),
                                  mask), "head dim")  # over the kernel's 256


@pytest.fixture(scope="module")
def fused_models():
    """Tiny int4 models of two head layouts, their blocks fused (bfloat16 activations, which
    every CPU's kernel takes), and their eager twins (the reference, model.Block)."""
    models = {}
    for heads, kv_heads in ((4, 2), (8, 2)):
        config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads)
        models[heads] = (fused(four_bit_model(1, **config), "int4", torch.bfloat16),
                         apply_format(four_bit_model(1, **config),
                                      format_named("int4")).to(torch.bfloat16))
    return models


@settings(max_examples=30, deadline=None)
@given(heads=st.sampled_from([4, 8]), B=st.integers(1, 3), T=st.integers(1, 5),
       capacity=st.integers(5, 24), slot_a_row=st.booleans(), at_the_end=st.booleans(),
       seed=st.integers(0, 1000))
def test_the_fused_blocks_give_the_eager_blocks_at_any_shape(fused_models, heads, B, T, capacity,
                                                            slot_a_row, at_the_end, seed):
    """B sequences of T rows, each written at its own slots (or all at the same), up to the
    cache's last slot: the fused step's logits are the eager blocks'."""
    fast, eager = fused_models[heads]
    g = torch.Generator().manual_seed(seed)
    V = fast.config.vocab_size
    starts = [capacity - T if at_the_end else int(torch.randint(0, capacity - T + 1, (),
                                                               generator=g))
              for _ in range(B)]
    starts = starts if slot_a_row else [starts[0]] * B
    slots = torch.tensor([list(range(s, s + T)) for s in starts])  # (B, T)
    tokens = torch.randint(0, V, (B, T), generator=g)
    S = max(starts) + T
    mask = torch.arange(S)[None, None] <= slots[:, :, None]  # (B, T, S): a row's own slots on
    logits = []
    for model, inference in ((fast, True), (eager, False)):
        cache = KVCache.for_model(model, capacity, batch_size=B)
        torch.manual_seed(seed)
        for layer in cache.layers:  # keys and values already there, the same for both
            layer.k.normal_(), layer.v.normal_()
        with torch.inference_mode(inference):
            logits.append(model(tokens, slots, mask, cache,
                                slots if slot_a_row and B > 1 else slots[0])[0].float())
    torch.testing.assert_close(logits[0], logits[1], **within_rounding(torch.bfloat16))


def test_the_fused_blocks_refuse_products_that_do_not_fit_in_one_line(fused_models):
    fast, _ = fused_models[4]
    blocks = fast.layers
    cache = KVCache.for_model(fast, 8)
    x = torch.zeros(1, 2, fast.config.hidden_size)
    cos = sin = torch.zeros(1, 1, 2, fast.config.head_dim)
    mask, slots = torch.ones(1, 1, 2, 2, dtype=torch.bool), torch.arange(2)
    args = lambda products, slots=slots: (  # noqa: E731
        x, cos, sin, mask, [c.k for c in cache.layers], [c.v for c in cache.layers], slots,
        blocks.attn_norms, blocks.mlp_norms, products, blocks.row_bits, blocks.heads,
        blocks.eps)
    swapped = list(blocks.products)
    swapped[0:3], swapped[3:6] = blocks.products[3:6], blocks.products[0:3]  # wqkv <-> wo
    with torch.inference_mode():
        one_line_error(lambda: blocks.blocks_step(*args(swapped)), "blocks_step")
        one_line_error(lambda: blocks.blocks_step(*args(blocks.products, slots + 7)), "slot")
        one_line_error(lambda: blocks.blocks_step(*args(blocks.products, slots.int())),
                       "int64 slots")


def test_the_fused_draft_refuses_a_tree_or_heads_that_do_not_fit_in_one_line():
    """The draft follows the tree's indices into its buffers: one outside them is refused."""
    model, heads = draft_setup(0, torch.bfloat16)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0]], num_heads=4)
    draft = FusedHydraDraft(heads, {tree.size - 1: tree}, model)
    hidden = torch.randn(model.config.hidden_size).bfloat16()
    args = list(draft.arguments(tree, 3, hidden))
    draft_op = torch.ops.minimedusa.hydra_draft
    with torch.inference_mode():
        assert draft_op(*args).shape == (tree.size,)  # as given: fits
        for i, wrong in ((2, tree.ancestors + tree.size), (1, model.config.vocab_size),
                         (10, 0), (4, model.embed.weight[:, :16]),
                         (3, [t + 99 for t in args[3]])):
            changed = list(args)
            changed[i] = wrong
            one_line_error(lambda: draft_op(*changed), "hydra_draft")

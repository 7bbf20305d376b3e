"""The compiled step's C attention (attention_kernel.py) against its reference,
model.exact_attention: the same outputs to float32's precision, and the property that keeps greedy
Medusa lossless, to the bit: a row's output depends only on the keys it sees, in their order, not
on the slots they sit in nor on the rows (or a batch's other sequences) beside it. And its AVX2 build (8 keys a vector where
AVX-512 has 16), built here whatever this CPU has: the same bits. Skipped where the kernel cannot
be built."""
import ctypes
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.profiler import ProfilerActivity, profile

from helpers import tiny_model
from minimedusa.speed.attention_kernel import SOURCE, KernelAttention, kernel_problem, new_output
from minimedusa.speed.c_kernels import build
from minimedusa.speed.compiled_step import compile_blocks, compiler_problem
from minimedusa.speed.machine import cpu_features
from minimedusa.kv_cache import KVCache
from minimedusa.model import causal_mask, exact_attention

pytestmark = pytest.mark.kernels  # every test here runs a C kernel or operator

attend = torch.ops.minimedusa.step_attention  # the C kernel's operator (operators.cpp)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    problem = kernel_problem()
    if problem is not None:
        pytest.skip(f"the C attention kernel is not built here: {problem}")


def step_inputs(H, G, T, S, D, dtype, seed, capacity=None):
    """q as a block makes it ((1, T, H, D) memory, seen as (1, H, T, D)), k and v as slices of
    a cache of `capacity` slots, and a random mask where every row sees its own slot."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g).to(dtype).transpose(1, 2)
    cache = torch.randn(2, 1, G, capacity or S + 7, D, generator=g).to(dtype)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    mask = torch.rand(1, 1, T, S, generator=g) < 0.7
    mask[0, 0, torch.arange(T), S - T + torch.arange(T)] = True
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, G, D", [(9, 3, 64), (4, 2, 8), (4, 4, 80), (8, 2, 128)])
@pytest.mark.parametrize("T", [1, 5, 17, 65])
def test_kernel_gives_the_reference_attention(dtype, H, G, D, T):
    """Equal to float64 sums rounded once, within float32's precision (bfloat16: within one
    rounding of the output). Head dims that are not a multiple of 16 included (80, 8)."""
    q, k, v, mask = step_inputs(H, G, T, 40 + 3 * T, D, dtype, seed=H * T + D)
    expected = exact_attention(q, k, v, mask)
    got = attend(q, k, v, mask)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, expected, **tolerance)


@st.composite
def step_trees(draw):
    """A random tree of N nodes (each node's parent comes before it) after n cached tokens."""
    N = draw(st.integers(2, 17))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, N)]
    return draw(st.integers(1, 300)), parents


def path_of(parents, i):
    path = [i]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]  # root .. i: increasing node indices


@settings(max_examples=40, deadline=None)
@given(tree=step_trees(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 1000))
def test_a_rows_output_is_the_same_wherever_its_keys_sit(tree, dtype, seed):
    """A tree step's row for node i (its ancestors in slots n + node index, the other nodes
    masked, N rows computed together) equals, to the bit, a plain step's row for the same
    token (its ancestors in slots n, n + 1, ..., computed alone): what Medusa's losslessness
    needs of attention."""
    n, parents = tree
    N = len(parents)
    q, k, v, _ = step_inputs(9, 3, N, n + N, 64, dtype, seed)
    mask = torch.zeros(1, 1, N, n + N, dtype=torch.bool)
    mask[..., :n] = True
    for i in range(N):
        mask[0, 0, i, [n + a for a in path_of(parents, i)]] = True
    tree_rows = attend(q, k, v, mask)  # (1, H, N, D)
    for i in range(N):
        path = path_of(parents, i)
        order = list(range(n)) + [n + a for a in path]  # the keys a plain step holds, in order
        S = len(order)
        plain = attend(q[:, :, i:i + 1], k[:, :, order], v[:, :, order],
                       torch.ones(1, 1, 1, S, dtype=torch.bool))
        assert torch.equal(plain[:, :, 0], tree_rows[:, :, i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
def test_a_batchs_row_attends_as_it_does_alone(dtype, T):
    """B sequences in one call (a batch's step, each its own keys, mask and length) give each
    sequence's rows the bits of a call of that sequence alone: a compiled batch's row is its
    batch-1 row (batch_decoding's losslessness)."""
    B, H, G, D, S = 3, 9, 3, 64, 40
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)  # (B, H, T, D)
    cache = torch.randn(2, B, G, S + 7, D, generator=g).to(dtype)  # k and v, 7 slots spare
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]  # (B, G, S, D) each
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7  # each sequence its own
    mask[..., -1] = True
    batch = attend(q, k, v, mask)  # (B, H, T, D)
    for b in range(B):
        alone = attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1])
        assert torch.equal(batch[b:b + 1], alone)
    torch.testing.assert_close(batch, exact_attention(q, k, v, mask),
                               **(dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}))


def test_compiled_blocks_attend_with_the_kernel():
    """compile_blocks swaps the kernel in, and a compiled step runs it (eager steps do not)."""
    if compiler_problem() is not None:
        pytest.skip("torch.compile does not work here")
    model = tiny_model(dtype=torch.float32)
    compile_blocks(model)
    assert isinstance(model.layers[0].block.attn.exact, KernelAttention)
    cache = KVCache.for_model(model, 16)

    def kernel_calls(stance):
        with torch.inference_mode(), torch.compiler.set_stance(stance), \
                profile(activities=[ProfilerActivity.CPU]) as prof:
            model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[3]]),
                  causal_mask(3, 1), cache, cache.slots(3, 1))
        return sum(e.count for e in prof.key_averages() if e.key == "minimedusa::step_attention")
    assert kernel_calls("default") >= len(model.layers)  # the profiler may count a call twice
    assert kernel_calls("force_eager") == 0


class Step(ctypes.Structure):
    """attention_kernel.c's Step: the tensors' addresses, sizes and strides in elements"""
    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "k", "v", "mask", "out")]
                + [(name, ctypes.c_int64) for name in ("H", "G", "T", "S", "D", "q_head",
                                                       "q_row", "kv_head", "out_head", "out_row")]
                + [("bf16", ctypes.c_int), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_int64) for name in ("B", "q_seq", "kv_seq", "mask_seq",
                                                       "out_seq")])


@pytest.fixture(scope="module")
def avx2_attend(tmp_path_factory):
    """attend() of the kernel built for AVX2 (-march=haswell: the last -march wins), by ctypes"""
    compiler = os.environ.get("CC", "cc")
    if not {"avx2", "fma"} <= set(cpu_features().split("+")) or shutil.which(compiler) is None:
        pytest.skip("needs a CPU with AVX2 and FMA, and a C compiler")
    out = tmp_path_factory.mktemp("build") / "attention_kernel.so"
    build(SOURCE, compiler, out, ("-march=haswell",))
    attend_c = ctypes.CDLL(str(out)).attend
    attend_c.argtypes = [ctypes.POINTER(Step)]
    return attend_c


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 17), S_more=st.integers(0, 40), D=st.sampled_from([8, 64, 80]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_the_avx2_build_gives_this_builds_bits(avx2_attend, T, S_more, D, dtype, seed):
    """Keys 8 a vector (AVX2) or 16 (AVX-512), rows 1 to 17, key counts and head dims that are
    not whole vectors: every output the same to the bit (each one's operations are the same,
    in the same order, whatever the vector's width)."""
    q, k, v, mask = step_inputs(9, 3, T, T + S_more, D, dtype, seed)
    out = new_output(q)
    step = Step(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.contiguous().data_ptr(),
                out.data_ptr(), 9, 3, T, T + S_more, D, q.stride(1), q.stride(2), k.stride(1),
                out.stride(1), out.stride(2), int(dtype == torch.bfloat16), D ** -0.5,
                1, 0, 0, 0, 0)
    assert avx2_attend(ctypes.byref(step)) == 0
    assert torch.equal(out, attend(q, k, v, mask))

"""group_kernel.c's AVX2 path (for CPUs without AVX-512 BF16: AMD's Zen 2 and 3, Intel's before
Cooper Lake), built here with -march=haswell whatever this CPU has, so that a test run on an
AVX-512 machine checks it too: its products, of bfloat16 rows and of float32 ones, equal
dequantize-then-multiply, and a row's bits do not depend on the rows multiplied beside it (what
keeps greedy Medusa lossless in int4)."""
import ctypes
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minimedusa.speed import group_kernel
from minimedusa.errors import UserError
from minimedusa.speed.c_kernels import build, flags
from minimedusa.speed.machine import ISA_VARIABLE, cpu_features
from minimedusa.speed.defaults import bf16_is_native
from minimedusa.speed.grids import dequantize_int4, eight_bit_groups, quantize_int4
from helpers import eight_bit_weight, four_bit_weight, w4a8_reference

COMPILER = os.environ.get("CC", "cc")
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(
                  not {"avx2", "fma"} <= set(cpu_features().split("+"))
                  or shutil.which(COMPILER) is None,
                  reason="needs a CPU with AVX2 and FMA, and a C compiler")]


def products_of(tmp_path_factory, flags: tuple) -> dict:
    """A build's products, called with ctypes: int4_product(x, packed, scales, minimums, y, M,
    N, K, floats), int4_a8_product and int4_a16_product (the same arguments), int8_product(x,
    packed, scales, y, M, N, K, floats, wide) and int8_a16_product (the same); pointers to the
    tensors' data, floats 1 for float32 rows (else bfloat16), wide 1 for float32 outputs (else
    the rows' dtype); each returns 0 when done."""
    out = tmp_path_factory.mktemp("build") / "group_kernel.so"
    build(group_kernel.SOURCE, COMPILER, out, flags)
    library = ctypes.CDLL(str(out))
    assert library.group_kernel_available() == 1 and library.group_kernel_floats() == 1
    found = {}
    for name, pointers, ints in (("int4_product", 5, 1), ("int4_a8_product", 5, 1),
                                 ("int4_a16_product", 5, 1), ("int8_product", 4, 2),
                                 ("int8_a16_product", 4, 2)):
        product = getattr(library, name)
        product.argtypes = ([ctypes.c_void_p] * pointers + [ctypes.c_int64] * 3
                            + [ctypes.c_int] * ints)
        product.restype = ctypes.c_int
        found[name] = product
    return found


@pytest.fixture(scope="module")
def avx2(tmp_path_factory) -> dict:
    """The AVX2 build's products (products_of)."""
    return products_of(tmp_path_factory, ("-march=haswell",))


def floats(x: torch.Tensor) -> int:
    return int(x.dtype == torch.float32)


def int4_product(avx2: dict, x: torch.Tensor, weight: torch.Tensor, name="int4_product"):
    """x (M, K) bfloat16 or float32 times a 4-bit grid's weight (N, K), by the AVX2 build: (M,
    N), x's dtype; name="int4_a8_product": x quantized to 8 bits first (w4a8)."""
    pack = group_kernel.pack_int4_a8 if name == "int4_a8_product" else group_kernel.pack_int4
    packed, scales, minimums = pack(*quantize_int4(weight))
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    assert avx2[name](x.data_ptr(), packed.data_ptr(), scales.data_ptr(), minimums.data_ptr(),
                      y.data_ptr(), *x.shape[:1], *weight.shape, floats(x)) == 0
    return y


def int4_a8_product(avx2: dict, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return int4_product(avx2, x, weight, "int4_a8_product")


def int4_a16_product(avx2: dict, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x quantized to 16 bits first, on w4a8's layout."""
    packed, scales, minimums = group_kernel.pack_int4_a8(*quantize_int4(weight))
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    assert avx2["int4_a16_product"](x.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                                    minimums.data_ptr(), y.data_ptr(), *x.shape[:1],
                                    *weight.shape, floats(x)) == 0
    return y


def int8_product(avx2: dict, x: torch.Tensor, weight: torch.Tensor,
                 name="int8_product") -> torch.Tensor:
    """x (M, K) bfloat16 or float32 times an 8-bit grid's weight (N, K), by the AVX2 build;
    name="int8_a16_product": x quantized to 16 bits first (w4a8's LM head)."""
    packed, scales = group_kernel.pack_int8(*eight_bit_groups(weight))
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    assert avx2[name](x.data_ptr(), packed.data_ptr(), scales.data_ptr(), y.data_ptr(),
                      *x.shape[:1], *weight.shape, floats(x), 0) == 0
    return y


def int8_a16_product(avx2: dict, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return int8_product(avx2, x, weight, "int8_a16_product")


DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


def tolerance(dtype: torch.dtype) -> dict:
    """bfloat16's rounding of the rows and the output, or float32's of the sums."""
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), dtype=DTYPES)
def test_avx2_int4_product_equals_dequantize_then_matmul(avx2, seed, rows, dtype):
    weight = four_bit_weight(48, 96, seed)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    reference = x.float() @ dequantize_int4(*quantize_int4(weight)).T
    torch.testing.assert_close(int4_product(avx2, x, weight).float(), reference,
                               **tolerance(dtype))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), dtype=DTYPES)
def test_avx2_w4a8_product_equals_quantize_the_activations_then_matmul(avx2, seed, rows, dtype):
    weight = four_bit_weight(48, 96, seed)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    torch.testing.assert_close(int4_a8_product(avx2, x, weight).double(),
                               w4a8_reference(x, weight), **tolerance(dtype))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), dtype=DTYPES)
def test_avx2_int8_product_equals_dequantize_then_matmul(avx2, seed, rows, dtype):
    weight = eight_bit_weight(48, 96, seed)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    torch.testing.assert_close(int8_product(avx2, x, weight).float(), x.float() @ weight.T,
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("product, weight", [(int4_product, four_bit_weight(576, 1536)),
                                             (int4_a8_product, four_bit_weight(576, 1536)),
                                             (int8_product, eight_bit_weight(160, 576))])
def test_an_avx2_rows_product_has_the_same_bits_whatever_rows_beside_it(avx2, product, weight,
                                                                         dtype):
    rows = torch.randn(17, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    alone = product(avx2, rows[:1], weight)  # (1, N)
    assert all(torch.equal(product(avx2, rows[:m], weight)[:1], alone) for m in range(2, 18))
    assert torch.equal(product(avx2, rows.flip(0).contiguous(), weight)[-1:], alone)


@pytest.fixture(scope="module")
def avx_vnni(tmp_path_factory) -> dict:
    """The AVX2 build with AVX-VNNI (VPDPBUSD and VPDPWSSD at 256 bits: Intel's client CPUs
    since Alder Lake, Zen 5), on a CPU that has it."""
    if "avx_vnni" not in cpu_features().split("+"):
        pytest.skip("this CPU has no AVX-VNNI")
    return products_of(tmp_path_factory, ("-march=haswell", "-mavxvnni"))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), dtype=DTYPES)
def test_avx_vnni_gives_w4a8s_products_the_avx2_codes_bits(avx2, avx_vnni, seed, rows, dtype):
    """Its integer sums are the AVX2 code's, exact, so what format_quality measured holds."""
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for product, weight in ((int4_a8_product, four_bit_weight(48, 96, seed)),
                            (int4_a16_product, four_bit_weight(48, 96, seed)),
                            (int8_a16_product, eight_bit_weight(48, 96, seed))):
        assert torch.equal(product(avx_vnni, x, weight), product(avx2, x, weight))


def test_minimedusa_isa_avx2_runs_a_process_as_an_avx2_cpu(monkeypatch):
    """MINIMEDUSA_ISA=avx2: the features said are AVX2 and FMA alone, the kernels are built for
    Haswell (their AVX2 path: this file's build), bfloat16 is not native; a value it does not
    know is one line."""
    monkeypatch.setenv(ISA_VARIABLE, "avx2")
    assert cpu_features() == "avx2+fma" and "-march=haswell" in flags()
    assert not bf16_is_native()
    monkeypatch.setenv(ISA_VARIABLE, "avx-512")
    with pytest.raises(UserError, match="MINIMEDUSA_ISA='avx-512': use avx2"):
        cpu_features()
    monkeypatch.setenv(ISA_VARIABLE, "native")
    assert "-march=native" in flags()

"""Weight formats: each fast layer agrees with its slow reference (dequantize, then multiply), a
model in a format stays close to float32, and Medusa greedy in a format is that format's plain
greedy (the heads only propose: the format's own model verifies)."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from helpers import (copycat_model, eight_bit_weight, flat, four_bit_model, four_bit_weight,
                    needs_group_kernel, perturbed, perturbed_hydra_pp, tiny_model)
from minimedusa.budget import fixed
from minimedusa.speed import defaults, format_layers, group_kernel
from minimedusa.acceptance import Sampling, greedy
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads
from minimedusa.model import causal_mask
from minimedusa.speed.packed_linear import PackedLinear
from minimedusa.tree import build_tree
from minimedusa.assembly.load import formatted_model, four_bit_checkpoint
from minimedusa.speed.grids import (GROUP, dequantize_int4, dequantize_int8,
                                    dequantize_int8_groups, eight_bit_groups, on_four_bit_grid,
                                    quantize_int4, quantize_int8, quantize_int8_groups)
from minimedusa.speed.quantized import Int4KernelLinear, Int4Linear, Int8GroupLinear, Int8Linear
from minimedusa.speed.defaults import bf16_is_native
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.files.weights import save_model


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 16), bias=st.booleans())
def test_int8_product_equals_dequantize_then_matmul(seed, rows, bias):
    """The int8 kernel's product at 1-16 rows == the dequantized weight's, to bfloat16's
    rounding of the output (the activations are bfloat16 in both)."""
    torch.manual_seed(seed)
    layer = Int8Linear(nn.Linear(64, 96, bias=bias))
    x = torch.randn(rows, 64).bfloat16()
    reference = x.float() @ dequantize_int8(layer.q, layer.scales.float()).T
    if bias:
        reference += layer.bias.float()
    torch.testing.assert_close(layer(x).float(), reference, rtol=2e-2, atol=2e-2)


def test_int8_rounding_error_is_at_most_half_a_step_per_channel():
    w = torch.randn(48, 80) * torch.rand(48, 1)  # channels of very different ranges
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((dequantize_int8(q, scales) - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def int4_layers():
    """The int4 layers this CPU has: torch's kernel's, and group_kernel.c's where it multiplies."""
    return [Int4Linear] + ([Int4KernelLinear] if group_kernel.kernel_problem() is None else [])


def test_int4_finds_a_four_bit_files_grid_again_to_the_bit():
    """A weight from a 4-bit file comes back as it was (what makes int4 lossless for the
    default model's weights), and a weight off the grid is told apart."""
    w = four_bit_weight(48, 96)
    assert torch.equal(dequantize_int4(*quantize_int4(w)), w)
    assert on_four_bit_grid(w)
    assert not on_four_bit_grid(torch.randn(48, 96))


@pytest.mark.kernels
@pytest.mark.parametrize("layer", int4_layers())
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20), bias=st.booleans())
def test_int4_product_equals_dequantize_then_matmul(layer, seed, rows, bias):
    """Each int4 kernel's product at 1-20 rows == the dequantized weight's, to bfloat16's
    rounding (the activations, and torch's kernel's scales, are bfloat16)."""
    torch.manual_seed(seed)
    linear = nn.Linear(96, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(48, 96, seed))
    layer = layer(linear)
    x = torch.randn(rows, 96).bfloat16()
    reference = x.float() @ dequantize_int4(*quantize_int4(linear.weight)).T
    if bias:
        reference += layer.bias.float()
    torch.testing.assert_close(layer(x).float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.kernels
@pytest.mark.parametrize("layer", int4_layers())
def test_an_int4_rows_product_has_the_same_bits_whatever_rows_beside_it(layer):
    """As packed_linear's test: a plain step's row equals, to the bit, the same row multiplied in
    a tree step of any size and at any place in it (what keeps Medusa greedy lossless in int4)."""
    linear = nn.Linear(1536, 576, bias=False)
    with torch.no_grad():
        linear.weight.copy_(four_bit_weight(576, 1536))
    int4 = layer(linear)
    rows = torch.randn(65, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = int4(rows[:1])  # (1, O)
    # every tree size up to the paper's 65 rows
    assert all(torch.equal(int4(rows[:m])[:1], alone) for m in range(2, 66))
    assert torch.equal(int4(rows.flip(0))[-1:], alone)


def test_int8_groups_find_an_eight_bit_files_grid_again_to_the_bit():
    """What keeps the default model's LM head (from a Q8_0 GGUF) exact in the int4 format."""
    w = eight_bit_weight(48, 96)
    assert torch.equal(dequantize_int8_groups(*quantize_int8_groups(w)), w)
    assert eight_bit_groups(w) is not None
    assert eight_bit_groups(torch.randn(48, 96)) is None
    assert eight_bit_groups(eight_bit_weight(40, 96)) is None  # not the kernel's blocks of 16


@pytest.mark.kernels
@needs_group_kernel
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20))
def test_int8_group_product_equals_dequantize_then_matmul(seed, rows):
    """The 8-bit kernel's product at 1-20 rows == the weight's, to bfloat16's rounding; the
    layer holds the weight to the bit."""
    weight = eight_bit_weight(48, 96, seed)
    layer = Int8GroupLinear(*eight_bit_groups(weight))
    assert torch.equal(layer.weight, weight)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).bfloat16()
    torch.testing.assert_close(layer(x).float(), x.float() @ weight.T, rtol=2e-2, atol=2e-2)


@pytest.mark.kernels
@needs_group_kernel
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20))
def test_a_wide_eight_bit_product_gives_float32_sums_that_round_to_the_narrow_ones(seed, rows):
    """wide=True (a model's LM head): the same sums of bfloat16 rows, kept in float32, so
    within float32's rounding of the dequantized product; rounded to bfloat16 they are the
    narrow layer's, to the bit."""
    q, scales = eight_bit_groups(eight_bit_weight(48, 96, seed))
    narrow, wide = Int8GroupLinear(q, scales), Int8GroupLinear(q, scales, wide=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed)).bfloat16()
    logits = wide(x)
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), narrow(x))
    reference = x.double() @ dequantize_int8_groups(q, scales).double().T
    torch.testing.assert_close(logits.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
@needs_group_kernel
def test_an_eight_bit_lm_heads_row_has_the_same_bits_whatever_rows_beside_it():
    head = Int8GroupLinear(*eight_bit_groups(eight_bit_weight(160, 576)))
    rows = torch.randn(65, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    alone = head(rows[:1])  # (1, V)
    # every tree size up to the paper's 65 rows
    assert all(torch.equal(head(rows[:m])[:1], alone) for m in range(2, 66))
    assert torch.equal(head(rows.flip(0))[-1:], alone)


@needs_group_kernel
def test_int4_keeps_an_lm_head_on_an_eight_bit_grid_in_it_and_a_draft_vocabularys_cut():
    """The model's LM head and the heads' cut of it in 8 bits, exactly; an LM head off the
    grid stays bfloat16."""
    model = four_bit_model(3)
    float32 = model.lm_head.weight.clone()
    model = apply_format(model, format_named("int4"))
    assert isinstance(model.lm_head, Int8GroupLinear) and model.lm_head.wide  # float32 logits
    assert torch.equal(model.lm_head.weight, float32)  # where bfloat16 would round it
    heads = HydraHeads.for_model(model, 2)
    ids = torch.arange(1, 64, 4)  # 16 tokens: the kernel multiplies blocks of 16 outputs
    heads.vocabulary = DraftVocabulary(ids, model.lm_head)
    heads = apply_format(heads.float(), format_named("int4"))
    assert isinstance(heads.vocabulary.lm_head, Int8GroupLinear)
    assert not heads.vocabulary.lm_head.wide  # the draft's logits: only guesses
    assert torch.equal(heads.vocabulary.lm_head.weight, model.lm_head.weight[ids])
    off_grid = apply_format(tiny_model(3, dtype=torch.float32), format_named("int4"))
    assert not isinstance(off_grid.lm_head, Int8GroupLinear)


def test_a_checkpoint_is_four_bit_when_all_its_blocks_weights_are(tmp_path):
    model = tiny_model(1, dtype=torch.float32)
    save_model(model, tmp_path / "random")
    assert not four_bit_checkpoint(tmp_path / "random")
    with torch.no_grad():
        for i, m in enumerate(model.layers.modules()):
            if isinstance(m, nn.Linear):
                m.weight.copy_(four_bit_weight(*m.weight.shape, seed=i))
    save_model(model, tmp_path / "four-bit")
    assert four_bit_checkpoint(tmp_path / "four-bit")


@pytest.mark.parametrize("bf16, expected", [(False, "w4a8"), (True, "int4")])
def test_a_four_bit_checkpoint_decodes_with_8_bit_activations_only_without_avx512_bf16(
        monkeypatch, bf16, expected):
    """The CPU default for a 4-bit checkpoint where group_kernel.c multiplies: w4a8 where only
    its AVX2 path runs, int4 where its AVX-512 BF16 one multiplies bfloat16 rows; a model off
    the grid keeps its dtype."""
    monkeypatch.setattr(defaults.group_kernel, "kernel_problem", lambda: None)
    monkeypatch.setattr(defaults.group_kernel, "takes_float32", lambda: True)
    monkeypatch.setattr(defaults.group_kernel, "multiplies_bfloat16", lambda: bf16)
    monkeypatch.setattr(defaults, "bf16_is_native", lambda: bf16)
    cpu = torch.device("cpu")
    assert defaults.default_format(cpu, four_bit=True) is format_named(expected)
    assert defaults.default_format(cpu, four_bit=False) is format_named("bfloat16" if bf16
                                                                         else "float32")
    assert defaults.default_format(torch.device("cuda"), four_bit=True) is format_named("bfloat16")


@pytest.mark.skipif(not bf16_is_native(), reason="this CPU has no native bfloat16 (oneDNN)")
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_bfloat16_packed_linear_equals_bfloat16_linear(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 300).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x).float(), linear(x).float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8", "int4"])
def test_a_model_in_a_format_stays_close_to_float32(name):
    """The whole model swapped (tied LM head included): its logits near float32's (the largest
    difference, relative to the largest logit), and the format says what it is."""
    model = four_bit_model(3)
    tokens, positions, mask = torch.randint(0, 64, (1, 9)), torch.arange(9)[None], causal_mask(0, 9)
    with torch.inference_mode():
        reference, _ = model(tokens, positions, mask)
        formatted = apply_format(model, format_named(name))
        logits, _ = formatted(tokens, positions, mask)
    assert formatted.weight_format is format_named(name)
    error = (logits.float() - reference).abs().max() / reference.abs().max()
    assert error <= {"float32": 1e-6, "bfloat16": 2e-2, "int8": 2e-2, "int4": 2e-2}[name]


@pytest.mark.kernels
@needs_group_kernel
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 20))
def test_int8_group_product_with_a_bias_equals_dequantize_then_matmul_plus_bias(seed, rows):
    """A heads' layer rounded to 8-bit groups: the product with its bias == the rounded
    weight's, to float32's precision (float32 rows, where the kernel takes them) or
    bfloat16's."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(48, 96, generator=g), torch.randn(48, generator=g)
    q, scales = quantize_int8_groups(weight)
    layer = Int8GroupLinear(q, scales.half().float(), bias)
    dtype = torch.float32 if group_kernel.takes_float32() else torch.bfloat16
    x = torch.randn(rows, 96, generator=g).to(dtype)
    expected = x.float() @ layer.weight.T + bias
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(layer.to(dtype)(x).float(), expected, **tolerance)


@pytest.mark.kernels
@needs_group_kernel
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_int4_rounds_the_heads_layers_to_eight_bit_groups_and_keeps_their_guesses(kind):
    """In int4 every layer of the heads the kernel fits is an Int8GroupLinear, its weight
    within half a step of each group's grid (and float16's rounding of the step), and the
    heads' logits stay those of float32 heads to within the rounding (what they guess; what is
    accepted is the model's)."""
    model = apply_format(four_bit_model(0), format_named("int4"))
    heads = (perturbed(MedusaHeads.for_model(model, 3, num_layers=1), 0, 0.05) if kind == "medusa"
             else perturbed(HydraHeads.for_model(model, 3), 0, 0.05)).float().eval()
    float32 = {name: m.weight.clone() for name, m in heads.named_modules()
               if type(m) is nn.Linear}
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, model.config.hidden_size, generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (5, 3), generator=g)
    # float32 heads read float32 embeddings and a float32 LM head: int4's are bfloat16 and
    # 8-bit groups that take bfloat16 rows only, where its activations are bfloat16
    embed = nn.Embedding.from_pretrained(model.embed.weight.float())
    lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    lm_head.weight = nn.Parameter(model.lm_head.weight.float(), requires_grad=False)
    with torch.inference_mode():
        before = (heads(hidden, lm_head) if kind == "medusa"
                  else heads(hidden, tokens, embed, lm_head))
        heads = apply_format(heads, format_named("int4"))
        rows = hidden.to(format_named("int4").activation_dtype())
        after = (heads(rows, model.lm_head) if kind == "medusa"
                 else heads(rows, tokens, model.embed, model.lm_head))
    rounded = {name: m for name, m in heads.named_modules() if isinstance(m, Int8GroupLinear)}
    assert float32 and set(float32) <= set(rounded)
    for name, w in float32.items():
        step = w.abs().view(w.shape[0], -1, GROUP).amax(-1, keepdim=True) / 127
        error = (rounded[name].weight - w).abs().view(w.shape[0], -1, GROUP)
        assert (error <= step * (0.5 + 127 * 2 ** -11) + 1e-6).all(), name  # float16 scales
    assert (after.float() - before.float()).abs().max() <= 0.02 * before.abs().max()  # ~0.5%
    assert torch.equal(after.argmax(-1), before.argmax(-1))  # the same first guesses here


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_medusa_greedy_equals_the_formats_plain_greedy(name, kind, seed):
    """Lossless with respect to the format it runs in, heads in the same format: on a model
    where candidates are accepted (copycat), and with perturbed heads that are often wrong.
    A tiny model's top-2 logits rarely tie; the default model's in bfloat16 do, and there the
    two decodes may part (weight_formats.py), which this test does not claim otherwise."""
    model = apply_format(copycat_model(seed, dtype=torch.float32), format_named(name))
    heads = (perturbed(MedusaHeads.for_model(model, 4, num_layers=1), seed, 0.05)
             if kind == "medusa" else HydraHeads.for_model(model, 4))
    heads = apply_format(heads.float().eval(), format_named(name))
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
    medusa = flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 40, set()))
    assert medusa == plain


@pytest.mark.kernels
@needs_group_kernel
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["hydra", "hydra++"])
def test_medusa_greedy_equals_int4s_plain_greedy_with_an_eight_bit_lm_head(seed, kind):
    """As above, the LM head (verifying every row) and the heads' drafts in 8-bit groups (their
    layers, a Hydra++ draft layer's too, rounded to them)."""
    model = apply_format(four_bit_model(seed), format_named("int4"))
    assert isinstance(model.lm_head, Int8GroupLinear)
    heads = (HydraHeads.for_model(model, 4) if kind == "hydra"
             else perturbed_hydra_pp(model, 4, seed, 0.05))
    heads = apply_format(heads.float().eval(), format_named("int4"))
    assert any(isinstance(m, Int8GroupLinear) for m in heads.modules())
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
    assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 40, set())) == plain


@pytest.mark.kernels
@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="group_kernel.c does not multiply here")
@pytest.mark.parametrize("tied", [False, True], ids=["own LM head", "tied to the embedding"])
@pytest.mark.parametrize("name", ["int4", "w4a8"])
def test_a_real_size_models_lm_head_is_rounded_to_8_bit_groups(name, tied, tmp_path,
                                                                monkeypatch):
    """int4 and w4a8 round the LM head of a model of real size (here any: LARGE lowered) onto
    Q8_0's grid: an own head as the loader reads it (no float32 copy of it made), a tied one
    once loaded; the layer's weight is the rounding's, its logits float32 and its products
    those of that weight. A smaller model's head stays as its file holds it."""
    model = tiny_model(0, dtype=torch.float32, tie_word_embeddings=tied)
    save_model(model, tmp_path)
    fmt = format_named(name)
    monkeypatch.setattr(format_layers, "LARGE", 0)
    loaded = apply_format(formatted_model(tmp_path, torch.device("cpu"), fmt), fmt)
    assert isinstance(loaded.lm_head, Int8GroupLinear) and loaded.lm_head.wide
    q, scales = quantize_int8_groups(model.lm_head.weight)
    rounded = dequantize_int8_groups(q, scales.half().float())
    assert torch.equal(loaded.lm_head.weight, rounded)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = x.to(fmt.activation_dtype())
    y = loaded.lm_head(rows)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, rows.float() @ rounded.T, rtol=1e-3, atol=1e-3)
    monkeypatch.setattr(format_layers, "LARGE", 10 ** 12)
    small = apply_format(formatted_model(tmp_path, torch.device("cpu"), fmt), fmt)
    assert not isinstance(small.lm_head, Int8GroupLinear)

"""The fused step (speed/fused_block.py): each block of an int4 (or w4a8) model in one C++ call,
its activations in float32 or bfloat16. model.Block is its reference: the same logits within
the activations' rounding; a row's bits do not depend on the rows beside it nor on the slot it
is written at (what keeps greedy Medusa lossless); and greedy Medusa on it equals its own plain
greedy."""
import pytest
import torch

from helpers import copycat_model, flat, four_bit_model, fused, perturbed, within_rounding
from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import fixed
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.heads import HydraHeads, MedusaHeads
from minimedusa.kv_cache import KVCache
from minimedusa.model import causal_mask
from minimedusa.speed import group_kernel
from minimedusa.speed.fused_block import fusable, is_fused
from minimedusa.speed.plug_in import how_it_runs, plug_in
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                                 reason="the fused step runs group_kernel.c's products")]
DTYPES = [torch.float32, torch.bfloat16]


def test_plug_in_fuses_the_blocks_of_an_int4_model_its_state_dict_names_unchanged():
    model = four_bit_model(0)
    names = list(apply_format(four_bit_model(0), format_named("int4")).state_dict())
    assert plug_in(model, format_named("int4"), None) == "fused (the blocks one C++ call)"
    assert is_fused(model) and "fused step" in how_it_runs(model)
    assert list(model.state_dict()) == names  # the same Block modules, only run otherwise


def forward(model, tokens, start, mask, cache, eager: bool):
    """Logits (T, V) of tokens (T,) written from slot `start`: the fused step in inference
    mode, the eager blocks (the reference) outside it."""
    T = tokens.numel()
    positions = torch.arange(start, start + T)[None]
    with torch.inference_mode(not eager):
        logits, _ = model(tokens[None], positions, mask, cache, cache.slots(start, T))
    return logits[0]


@pytest.mark.parametrize("weight_format, dtype", [
    ("int4", torch.float32), ("int4", torch.bfloat16), ("w4a8", torch.float32),
    ("w4a8", torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_a_fused_step_gives_the_eager_blocks_logits(weight_format, dtype):
    model = fused(four_bit_model(0), weight_format, dtype)
    g = torch.Generator().manual_seed(0)
    caches = {eager: KVCache.for_model(model, 32) for eager in (True, False)}
    start = 0
    for T in (7, 1, 4, 1):  # a prompt, then steps of 1 and 4 rows
        tokens = torch.randint(0, 64, (T,), generator=g)
        mask = causal_mask(start, T)
        eager, step = (forward(model, tokens, start, mask, caches[e], e) for e in (True, False))
        torch.testing.assert_close(step, eager, **within_rounding(dtype, weight_format))
        start += T


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_in_a_fused_step_depend_on_nothing_beside_it(dtype):
    """A token after a cached prefix, alone at slot n, and as the 4th row of a 6-row step at
    slot n + 3 that sees the prefix and itself only (a tree node's mask): the same bits."""
    model = fused(four_bit_model(1), "int4", dtype)
    cache = KVCache.for_model(model, 32)
    n, token = 9, 5
    forward(model, torch.arange(n) + 3, 0, causal_mask(0, n), cache, eager=False)
    alone = forward(model, torch.tensor([token]), n, causal_mask(n, 1), cache, eager=False)
    rows = torch.tensor([7, 8, 9, token, 11, 12])
    mask = torch.zeros(1, 6, n + 6, dtype=torch.bool)
    mask[0, :, :n] = True
    mask[0, torch.arange(6), n + torch.arange(6)] = True  # each row sees itself
    with torch.inference_mode():
        logits, _ = model(rows[None], torch.full((1, 6), n), mask, cache, cache.slots(n, 6))
    assert torch.equal(logits[0, 3], alone[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("seed", [0, 1])
def test_medusa_greedy_on_a_fused_step_equals_its_plain_greedy(kind, seed, dtype):
    """On a model where candidates are accepted (copycat) and on a 4-bit one."""
    for model in (copycat_model(seed, dtype=torch.float32, hidden_size=64, intermediate_size=128),
                  four_bit_model(seed)):
        model = fused(model, "int4", dtype)
        heads = (perturbed(MedusaHeads.for_model(model, 4, num_layers=1), seed, 0.05)
                 if kind == "medusa" else HydraHeads.for_model(model, 4))
        heads = apply_format(heads.float().eval(), format_named("int4")).to(dtype)
        tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
        prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
        assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 40, set())) == plain


def test_a_model_the_fused_step_does_not_serve_says_why():
    model = apply_format(four_bit_model(0), format_named("float32"))
    assert fusable(model) == ("its products are not group_kernel.c's int4 or bfloat16 layers "
                              "without biases")
    half = apply_format(four_bit_model(0), format_named("int4")).half()
    assert fusable(half) == "its activations are float16, not float32 or bfloat16"
    wide_heads = apply_format(four_bit_model(0, head_dim=288), format_named("int4"))
    assert fusable(wide_heads) == "its head dim 288 is over the C attention's 256"

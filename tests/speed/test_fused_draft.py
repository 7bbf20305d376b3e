"""The Hydra draft in one C++ call (speed/fused_draft.py): heads.hydra_candidates is its
reference. The same tokens over random trees, with and without a draft vocabulary (float32
rows; in bfloat16, where logits tie more often, the same ranked logits); greedy Medusa with it
equals plain greedy; plug_in_heads plugs it in where it runs and heads it does not serve say
why."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import fixed
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.heads import HydraHeads, MedusaHeads, hydra_candidates
from minimedusa.speed import group_kernel
from minimedusa.draft import TreeDraft
from minimedusa.speed.fused_draft import (FusedDrawnDraft, FusedHydraDraft, fast_draft,
                                          fusable_draft)
from minimedusa.speculative_sampling import DrawnDraft
from minimedusa.speed.plug_in import plug_in_heads
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree
from helpers import flat, four_bit_model, hydra_draft_setup as setup, trees

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                                 reason="the fused draft runs group_kernel.c's products")]


def drafts(heads, model, hidden, root, tree) -> tuple[torch.Tensor, torch.Tensor]:
    """(hydra_candidates' tokens, the fused draft's) for the same step."""
    reference = hydra_candidates(heads, model, hidden, root, tree)
    fused = FusedHydraDraft(heads, {tree.size - 1: tree}, model)
    return reference, fused.tree(model, tree.size - 1, int(root), hidden).tokens


@settings(max_examples=30, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       vocabulary=st.sampled_from([0, 32]))
def test_the_fused_draft_drafts_the_reference_tokens(choices, seed, vocabulary):
    model, heads = setup(seed % 4, torch.float32, vocabulary)
    tree = build_tree(choices, num_heads=4)
    g = torch.Generator().manual_seed(seed)
    hidden = 4 * torch.randn(model.config.hidden_size, generator=g)
    root = torch.randint(0, model.config.vocab_size, (), generator=g)
    reference, fused = drafts(heads, model, hidden, root, tree)
    assert torch.equal(fused, reference)


@pytest.mark.parametrize("seed", range(6))
def test_in_bfloat16_the_fused_draft_ranks_the_reference_logits(seed):
    """bfloat16 logits tie often, and the two may order a tie differently: the guesses at the
    root must hold the same logits, rank by rank."""
    model, heads = setup(seed, torch.bfloat16)
    tree = build_tree([[0], [1], [2], [3]], num_heads=4)
    hidden = 4 * torch.randn(model.config.hidden_size,
                             generator=torch.Generator().manual_seed(seed)).bfloat16()
    root = torch.tensor(seed + 3)
    reference, fused = drafts(heads, model, hidden, root, tree)
    with torch.inference_mode():
        logits = heads.head(1, hidden, root.reshape(1, 1), model.embed, model.lm_head)[0]
    assert torch.equal(logits[fused[1:]], logits[reference[1:]])


@pytest.mark.parametrize("seed", range(3))
def test_medusa_greedy_with_the_fused_draft_equals_plain_greedy(seed):
    dtype = torch.float32 if group_kernel.takes_float32() else torch.bfloat16
    model, heads = setup(seed, dtype, scale=0.05)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=4)
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    plain = flat(plain_decode(model, prompt, 40, Sampling(), set()))
    draft, budget = fixed(heads, tree)
    draft = fast_draft(draft, model)
    assert isinstance(draft, FusedHydraDraft)
    assert flat(medusa_decode(model, draft, budget, greedy(), prompt, 40, set())) == plain


def test_the_fused_draft_is_swapped_in_for_hydra_heads_it_serves():
    # its activations as this CPU's int4 has them
    model = apply_format(four_bit_model(0), format_named("int4"))
    heads = plug_in_heads(HydraHeads.for_model(model, 3, num_layers=2).float(), model)
    tree = build_tree([[0], [1]], num_heads=3)
    assert isinstance(fast_draft(TreeDraft(heads, {2: tree}), model), FusedHydraDraft)


def test_heads_the_fused_draft_does_not_serve_say_why():
    model = apply_format(four_bit_model(0), format_named("int4"))
    medusa = plug_in_heads(MedusaHeads.for_model(model, 2, shared_lm_head=True).float(), model)
    assert fusable_draft(medusa, model).startswith("they are not Hydra heads")
    float_model = apply_format(four_bit_model(0), format_named("float32"))
    hydra = plug_in_heads(HydraHeads.for_model(float_model, 2).float(), float_model)
    tree = build_tree([[0], [1]], num_heads=2)
    assert type(fast_draft(TreeDraft(hydra, {2: tree}), float_model)) is TreeDraft
    assert fusable_draft(hydra, float_model) == ("their layers or LM head are not "
                                                 "group_kernel.c's 8-bit groups")


@settings(max_examples=30, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       vocabulary=st.sampled_from([0, 32]), temperature=st.sampled_from([300.0, 1000.0, 3000.0]))
def test_the_fused_draw_draws_drawn_drafts_candidates_from_the_same_seed(choices, seed,
                                                                        vocabulary, temperature):
    """hydra_draw against DrawnDraft (the reference: hydra_candidates drawing by logits / T +
    Gumbel noise) with the same seed, over two steps: the same tokens, the same draws, the
    same q (one noise layout, speculative_sampling.step_noise). The test model's head logits
    spread ~1,500 (std): temperatures of that order let the noise decide, so a key without T,
    or noise in another layout, draws other tokens."""
    model, heads = setup(seed % 4, torch.float32, vocabulary)
    tree = build_tree(choices, num_heads=4)
    g = torch.Generator().manual_seed(seed)
    reference = DrawnDraft(heads, {tree.size - 1: tree}, temperature, seed)
    fused = FusedDrawnDraft(DrawnDraft(heads, {tree.size - 1: tree}, temperature, seed), model)
    for _ in range(2):  # the second step draws from where the first left the generator
        hidden = 4 * torch.randn(model.config.hidden_size, generator=g)
        root = int(torch.randint(0, model.config.vocab_size, (), generator=g))
        fused_step = fused.tree(model, tree.size - 1, root, hidden)
        reference_step = reference.tree(model, tree.size - 1, root, hidden)
        assert torch.equal(fused_step.tokens, reference_step.tokens)
        got, expected = fused_step.proposal, reference_step.proposal
        assert set(got.q) == set(expected.q)
        for path, q in expected.q.items():
            torch.testing.assert_close(got.q[path], q, rtol=1e-4, atol=1e-6)
            assert got.columns[path] == expected.columns[path]  # the columns the verifier reads
            assert got.draws[path] == expected.draws[path]


def test_speculative_sampling_swaps_in_the_fused_draw_where_it_fuses():
    model, heads = setup(0, torch.bfloat16)
    tree = build_tree([[0], [1], [0, 0]], num_heads=4)
    assert type(fast_draft(DrawnDraft(heads, {3: tree}, 0.7), model)) is FusedDrawnDraft

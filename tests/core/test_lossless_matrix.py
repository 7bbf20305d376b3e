"""Greedy Medusa is lossless in every weight format and every step the README names, for every
kind of draft: its tokens equal the same format's plain greedy tokens, one for one, and the
tree accepted candidates (more than one token a step, fewer than the deepest path every time:
both accepting and rejecting were exercised). On cycling_model, whose greedy text walks a cycle
of distinct tokens, with heads that know the cycle but are perturbed (conftest.py).

formats: float32, bfloat16, int8, int4, w4a8 (w4a8 where group_kernel.c multiplies);
steps: eager, fused (int4, w4a8 and bfloat16 where the blocks fuse), compiled (float32,
bfloat16, int8);
drafts: Medusa and Hydra heads on a fixed tree, a ranked tree (each step's most probable
nodes), context candidates, and the Budget choosing among nested trees and plain steps."""
import itertools

import pytest
import torch

from helpers import cycling_heads, cycling_model, greedy_pair, slow_except
from minimedusa.speed.host_greedy import greedy_for
from minimedusa.context_candidates import ContextDraft
from minimedusa.budget import Budget, FixedSize, fixed, nested_trees
from minimedusa.decoding import medusa_decode
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.speed import group_kernel
from minimedusa.speed.compiled_step import compiler_problem
from minimedusa.speed.fused_block import is_fused
from minimedusa.speed.plug_in import plug_in
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree

pytestmark = pytest.mark.kernels  # every test here runs a C kernel or operator

TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
NEW = 40
NODES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (2,)]


def format_model(weight_format: str, step: str, seed: int):
    """cycling_model in `weight_format`, its step eager, fused or compiled (plug_in)."""
    if weight_format == "w4a8" and group_kernel.kernel_problem() is not None:
        pytest.skip(f"w4a8 multiplies in group_kernel.c only: {group_kernel.kernel_problem()}")
    model = cycling_model(seed, hidden_size=64, intermediate_size=128)
    if step == "eager":
        return apply_format(model, format_named(weight_format))
    if step == "compiled" and compiler_problem() is not None:
        pytest.skip(f"no compiled step here: {compiler_problem()}")
    how = plug_in(model, format_named(weight_format), None if step == "fused" else True)
    if step == "fused" and not is_fused(model):
        pytest.skip(f"the blocks do not fuse here ({how})")
    return model


def steps_of(model, draft, budget, prompt) -> tuple[list, float]:
    """(tokens, tokens a step); every step timed as one second whatever its tree (the budget's
    clock counts its calls), so that the Budget's choices do not hang on this machine's
    timings."""
    budget.clock = itertools.count().__next__
    steps = list(medusa_decode(model, draft, budget, greedy_for(model.embed.weight.device),
                               prompt, NEW, set()))
    tokens = [t for step in steps for t in step.tokens]
    return tokens, len(tokens) / len(steps)


CASES = ([(f, "eager") for f in ("float32", "bfloat16", "int8", "int4", "w4a8")]
         + [(f, "fused") for f in ("int4", "w4a8", "bfloat16")]
         + [(f, "compiled") for f in ("float32", "bfloat16", "int8")])
IDS = [f"{f}-{s}" for f, s in CASES]
# a compiled case costs its own compile (10-20 s each): the default run proves the compiled
# step lossless once, in test_compiled_step.py, and runs these under -m slow
MATRIX = slow_except(CASES, *[case for case in CASES if case[1] != "compiled"])


@pytest.mark.parametrize("weight_format, step", MATRIX, ids=IDS)
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_medusa_greedy_equals_the_formats_plain_greedy_and_accepts(weight_format, step, kind):
    for seed in (1, 2):
        model = format_model(weight_format, step, seed)
        heads = apply_format(cycling_heads(model, kind, seed).float().eval(),
                             format_named(weight_format))
        prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        tree = build_tree(TREE, num_heads=4)
        medusa, plain, per_step = greedy_pair(model, heads, tree, prompt, NEW)
        assert medusa == plain
        assert 1.2 < per_step < tree.num_heads + 1  # accepted, and rejected


@pytest.mark.parametrize("draft", ["ranked", "context", "budget"])
@pytest.mark.parametrize("weight_format, step", MATRIX, ids=IDS)
def test_every_kind_of_draft_stays_lossless_and_accepts(draft, weight_format, step):
    """Trees the heads rank each step, a chain copied from the sequence merged in, and the
    Budget moving between nested trees and plain steps: each the same tokens as plain greedy."""
    model = format_model(weight_format, step, 3)
    heads = apply_format(cycling_heads(model, "medusa", 3).float().eval(),
                         format_named(weight_format))
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt += prompt  # a repeat, for the context candidates to find
    _, plain, _ = greedy_pair(model, heads, build_tree(TREE, num_heads=4), prompt, NEW)
    vocab, device = model.config.vocab_size, model.embed.weight.device
    if draft == "ranked":
        tokens, per_step = steps_of(model, RankedDraft(heads), FixedSize(6), prompt)
    elif draft == "context":
        tree_draft, budget = fixed(heads, build_tree(TREE, 4, vocab, device))
        tokens, per_step = steps_of(model, ContextDraft(tree_draft), budget, prompt)
    else:
        trees, rank = nested_trees(NODES, [3, 8], 4, vocab, device)
        budget = Budget([0, 3, 8], {3: 1.8, 8: 2.2}, {0: 1.0, 3: 1.1, 8: 1.2})
        tokens, per_step = steps_of(model, TreeDraft(heads, trees, rank), budget, prompt)
    assert tokens == plain and per_step > 1.2

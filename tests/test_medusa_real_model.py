"""Lossless greedy on the real default model, in float32 as generate.py runs it (its products
prepacked on a CPU): Medusa's output equals plain greedy decoding for the fixture's chat
prompts, 64 new tokens each (32 with the paper's big tree), with untrained heads (the paper's
initialisation: they guess repeats, so some candidates are accepted and some rejected) and with
the heads shipped in weights/."""
import functools

import pytest
import torch

from minimedusa.acceptance import greedy
from minimedusa.heads import MedusaHeads
from minimedusa.budget import fixed, grow_tree
from minimedusa.files.heads_files import read_calibration
from minimedusa.flags.load import decoding_heads, ranked_vocab_size
from minimedusa.flags.trees import tree_choices
from minimedusa.decoding import StepStats, decode_step, medusa_decode, new_cache, prefill
from minimedusa.files.default_model import DEFAULT_HEADS_DIR, PAPER_HEADS_DIR
from minimedusa.tree import build_tree

NEW = 64


@functools.cache
def plain_greedy_with_gaps(model, prompt: tuple[int, ...], n: int):
    """Plain greedy tokens, and at each step the gap between the top-2 logits (a near-tie is
    where float rounding in a differently shaped forward may legitimately flip the argmax).
    Cached: every test here compares against the same few prompts on the same model."""
    device = model.embed.weight.device
    cache = new_cache(model, len(prompt), n)
    logits, _ = prefill(model, cache, torch.tensor([list(prompt)], device=device))
    tokens, gaps = [], []
    for _ in range(n):
        top2 = logits[0].topk(2).values
        gaps.append((top2[0] - top2[1]).item())
        tokens.append(logits[0].argmax().item())
        logits, _ = decode_step(model, cache, torch.tensor([[tokens[-1]]], device=device))
    return tokens, gaps


# the paper's 64-node tree: 65 rows a step, so fewer tokens (each of its steps costs ~3 of cpu_8's)
@pytest.mark.parametrize("tree_name, cases, new", [("cpu_8", [0, 2], NEW),
                                                   ("mc_sim_7b_63", [1], NEW // 2)])
def test_medusa_greedy_equals_plain_greedy_on_the_default_model(smollm2_packed, reference,
                                                                  tree_name, cases, new):
    model = smollm2_packed
    device = model.embed.weight.device
    heads = MedusaHeads.for_model(model, 4, shared_lm_head=True).requires_grad_(False)
    tree = build_tree(tree_choices(tree_name), 4, model.config.vocab_size, device)
    near_ties, stats = 0, StepStats()
    for i in cases:
        prompt = reference["greedy"]["cases"][i]["prompt_ids"]
        plain, gaps = plain_greedy_with_gaps(model, tuple(prompt), new)
        medusa = []
        for step in medusa_decode(model, heads, *fixed(tree), prompt, new, greedy(), set()):
            medusa += step
            stats.record(len(step))
        if medusa != plain:  # allowed only at a numerical near-tie, and then counted
            first = next(j for j, (a, b) in enumerate(zip(medusa, plain)) if a != b)
            assert gaps[first] < 1e-3, f"case {i}: differs at token {first}, gap {gaps[first]}"
            near_ties += 1
    print(f"{tree_name}: {near_ties}/{len(cases)} runs differed at a near-tie; "
          f"{stats.acceleration_rate:.2f} tokens/step with untrained heads")
    assert stats.acceleration_rate > 1.0  # candidates were accepted, not only rejected


@pytest.mark.parametrize("folder", [DEFAULT_HEADS_DIR, PAPER_HEADS_DIR])
def test_shipped_heads_decode_as_plain_greedy_and_accept(smollm2_packed, reference, folder):
    """The heads in weights/ (Hydra's, the default, and the paper's), loaded as generate.py
    loads them (their own draft vocabulary), on their own grown 8-node tree."""
    model = smollm2_packed
    device = model.embed.weight.device
    heads = decoding_heads(str(folder), model)
    choices, _ = grow_tree(read_calibration(folder), 8)
    tree = build_tree(choices, heads.config.medusa_num_heads, ranked_vocab_size(heads, model),
                      device)
    stats = StepStats()
    for case in reference["greedy"]["cases"][:2]:
        prompt = case["prompt_ids"]
        plain, gaps = plain_greedy_with_gaps(model, tuple(prompt), NEW)
        medusa = []
        for step in medusa_decode(model, heads, *fixed(tree), prompt, NEW, greedy(), set()):
            medusa += step
            stats.record(len(step))
        if medusa != plain:  # allowed only at a numerical near-tie
            first = next(j for j, (a, b) in enumerate(zip(medusa, plain)) if a != b)
            assert gaps[first] < 1e-3, f"differs at token {first}, gap {gaps[first]}"
    assert stats.acceleration_rate > 1.3  # trained heads: many candidates accepted

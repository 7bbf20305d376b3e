"""Tree search (paper section 6): calibration counts each guess rank, the greedy growth is the
best tree of every size, the budget is the size with the most expected tokens/s, and decoding
starts from the grown trees with latencies measured here."""
import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_model
from minimedusa.training import tree_search
from minimedusa.budget import (SIZES, expected_length, expected_length_of, grow_tree, nested_trees,
                               pick_budget)
from minimedusa.files.heads_files import CALIBRATION, read_calibration, save_heads
from minimedusa.assembly.latency_cache import latency_key, read_cached
from minimedusa.assembly.step_latency import step_latency
from minimedusa.assembly.trees import budget_trees, decoding_tree
from minimedusa.heads import MedusaHeads
from minimedusa.training.medusa1 import IGNORE, Rows, head_metrics
from minimedusa.tree import build_tree, dense_tree
from minimedusa.training.tree_search import head_accuracies
from minimedusa.acceptance import greedy
from minimedusa.assembly.load import machine_format
from minimedusa.assembly.recipe import Recipe, build, decoding_heads, decoding_model, timed_parts
from minimedusa.draft import TreeDraft
from minimedusa.speed.weight_formats import apply_format, format_named

# these tests time steps and read their cache: each its own folder (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_latency_cache")


def test_heads_read_features_in_their_own_dtype_in_training_and_calibration():
    """Heads in a weight format's dtype (bfloat16 here) are given features of another dtype
    (float32 rows, a float32 backbone): calibration and validation cast them to the heads'
    dtype (heads.as_features), as decoding does, and measure what the heads guess."""
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2).eval().requires_grad_(False)  # own projections
    rows = Rows(torch.randn(24, model.config.hidden_size), torch.randint(0, 64, (24, 2)))
    expected = head_accuracies(heads, model, rows, ranks=3)
    in_bf16 = apply_format(MedusaHeads.for_model(model, 2).eval(), format_named("bfloat16"))
    assert torch.allclose(head_accuracies(in_bf16, model, rows, ranks=3), expected, atol=0.1)
    metrics = head_metrics(in_bf16, model, rows, "cpu")
    assert len(metrics["top1"]) == 2


def test_calibration_counts_each_rank_of_each_head():
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()  # W1 = 0: lm_head(h)
    hidden = torch.randn(40, model.config.hidden_size)
    order = model.lm_head(hidden).argsort(dim=-1, descending=True)  # (40, V) the guesses
    # head 1's target is its guess of rank (row % 4); head 2's is always its top-1, except
    # the last 8 rows, which have no target (past the end of their answer)
    targets = torch.stack([order[torch.arange(40), torch.arange(40) % 4], order[:, 0]], dim=1)
    targets[32:, 1] = IGNORE
    a = head_accuracies(heads, model, Rows(hidden, targets), ranks=5, batch_size=16)
    assert torch.allclose(a, torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0],
                                           [1.0, 0.0, 0.0, 0.0, 0.0]]))


def connected_trees(K: int, R: int, n: int):
    """Every tree of n nodes inside the dense K x R tree (each node's parent included)."""
    dense = dense_tree([R] * K)
    for subset in itertools.combinations(dense, n):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in subset):
            yield subset


accuracies = st.integers(1, 3).flatmap(lambda K: st.integers(1, 3).flatmap(
    lambda R: st.lists(st.lists(st.floats(0.0, 1.0), min_size=R, max_size=R),
                       min_size=K, max_size=K)))


@settings(max_examples=30, deadline=None)
@given(accuracies, st.integers(1, 5))
def test_grown_tree_is_the_best_tree_of_its_size(a, n):
    accuracy = torch.tensor(a, dtype=torch.float64)
    K, R = accuracy.shape
    n = min(n, len(dense_tree([R] * K)))
    nodes, probs = grow_tree(accuracy, n)
    build_tree(nodes)  # every node's parent came before it: a valid tree
    assert abs(expected_length(probs) - expected_length_of(nodes, accuracy)) < 1e-9
    best = max(expected_length_of(t, accuracy) for t in connected_trees(K, R, n))
    assert expected_length(probs) >= best - 1e-9


def test_grown_trees_are_nested_across_budgets():
    accuracy = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.0]])
    small, _ = grow_tree(accuracy, 5)
    large, probs = grow_tree(accuracy, 20)
    assert large[:5] == small
    assert probs == sorted(probs, reverse=True)  # most probable first


def test_budget_is_the_size_with_most_expected_tokens_per_second():
    probs = [0.5, 0.3, 0.1, 0.05]
    latency = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.020, 4: 0.040}
    best, table = pick_budget(probs, latency)
    rates = {n: expected_length(probs[:n]) / s for n, s in latency.items() if n}
    assert best == max(rates, key=rates.get) == 2
    assert table[0]["tokens_per_s"] == pytest.approx(100.0)


def test_step_latency_times_every_size_and_plain_decoding():
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()
    nodes, _ = grow_tree(torch.tensor([[0.5, 0.2], [0.3, 0.1]]), 6)
    trees, _ = nested_trees(nodes, [1, 3, 6], 2, model.config.vocab_size, "cpu")
    latency = step_latency(model, TreeDraft(heads, trees), greedy(), list(trees), prompt_len=10,
                           repeats=2)
    assert set(latency) == {0, 1, 3, 6} and all(s > 0 for s in latency.values())


def test_calibrated_heads_get_nested_grown_trees_and_latencies_measured_once(tmp_path):
    """The default decoding plan: the tree grown from calibration.json at every size, plain
    included; the step latencies are measured on first use, then read from the cache."""
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 3, shared_lm_head=True).eval()
    save_heads(heads, tmp_path)
    (tmp_path / CALIBRATION).write_text(json.dumps({"accuracy": [[0.6, 0.2], [0.4, 0.1],
                                                                  [0.3, 0.1]]}))
    recipe = Recipe(folder=tmp_path, device=torch.device("cpu"),
                    weight_format=format_named("float32"), heads=str(tmp_path))
    decoding = build(recipe, model, heads)
    trees, budget = decoding.draft.trees, decoding.budget
    nodes, _ = grow_tree(read_calibration(tmp_path), 16)
    assert sorted(trees) == [n for n in SIZES if n <= len(nodes)]
    assert all(set(trees[n].nodes[1:]) == set(nodes[:n]) for n in trees)
    assert budget.sizes == [0, *sorted(trees)]
    assert decoding.describe().endswith("latencies measured here, greedy")
    assert build(recipe, model, heads).describe().endswith("latencies cached, greedy")


def test_uncalibrated_heads_get_the_default_tree_cut_to_their_depth_or_plain(tmp_path):
    """Heads with no calibration fall back to the device's named tree, made for any heads: its
    paths deeper than these heads are dropped (what is left is still a tree: every path's
    prefixes are shorter), rather than refusing heads that are fine; plain steps remain the
    other choice."""
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()
    save_heads(heads, tmp_path)
    uncalibrated = budget_trees(heads, model, str(tmp_path))
    assert uncalibrated.why.startswith("cpu_8 (cut to its paths of at most 2 nodes")
    (tree,) = uncalibrated.trees.values()
    budget = uncalibrated.budget({0: 1.0, 5: 1.0})
    assert set(tree.nodes[1:]) == {(0,), (1,), (0, 0), (0, 1), (1, 0)}
    assert budget.sizes == [0, 5]
    name, tree = decoding_tree("dense:2,1", heads, model)  # --tree: that tree, every step
    assert name == "dense:2,1" and tree.size == 5


@pytest.mark.kernels
def test_tree_search_cli_calibrates_and_caches_the_latencies_generate_uses(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    model = tiny_model(7, dtype=torch.float32)
    save_heads(MedusaHeads.for_model(model, 3, shared_lm_head=True), tmp_path)
    tree_search.main(["--heads", str(tmp_path), "--data", str(data), "--model", str(model_dir),
                      "--max-nodes", "6", "--device", "cpu", "--out", str(tmp_path / "t.json")])
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert len(calibration["accuracy"]) == 3 and len(calibration["accuracy"][0]) == 10
    nodes, _ = grow_tree(read_calibration(tmp_path), 6)
    chosen = [tuple(p) for p in json.loads((tmp_path / "t.json").read_text())]
    assert chosen == nodes[:len(chosen)]
    build_tree(chosen, num_heads=3)
    weight_format = machine_format(torch.device("cpu"), model_dir)  # the format decoding picks
    recipe = Recipe(folder=model_dir, device=torch.device("cpu"), weight_format=weight_format,
                    compile=None, heads=str(tmp_path))
    model, _ = decoding_model(recipe)  # its step
    heads = decoding_heads(recipe.heads, model)
    cached = read_cached(latency_key(model, *timed_parts(recipe, heads, {}, model)))
    assert set(cached) == {0, 1, 2, 3, 4}  # sizes up to --max-nodes 6, and plain


def test_bad_input_is_one_line_not_a_traceback_before_the_warm_up(tmp_path, capsys):
    """A missing heads folder is named on the model as read, before the compiled step's
    warm-up (which prints "decoding step: ..." when done)."""
    with pytest.raises(SystemExit, match="^error: heads folder .* does not exist$"):
        tree_search.main(["--heads", str(tmp_path / "missing"), "--budget", "4"])
    assert "decoding step" not in capsys.readouterr().err

"""Tree search (paper section 6): calibration counts each guess rank, the greedy growth is the
best tree of every size, the budget is the size with the most expected tokens/s, and the tuned
tree is what decoding uses by default."""
import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from minimedusa.cli import TREES, decoding_tree, device_key
from minimedusa.heads import MedusaHeads
from minimedusa.training import IGNORE, Rows
from minimedusa.tree import build_tree, dense_tree
from minimedusa.weights import save_heads
from minimedusa import tree_search
from minimedusa.tree_search import (expected_length, expected_length_of, grow_tree,
                                    head_accuracies, pick_budget, step_latency)


def test_calibration_counts_each_rank_of_each_head():
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()  # W1 = 0: lm_head(h)
    hidden = torch.randn(40, model.config.hidden_size)
    order = model.lm_head(hidden).argsort(dim=-1, descending=True)  # (40, V) the guesses
    # head 1's target is its guess of rank (row % 4); head 2's is always its top-1, except
    # the last 8 rows, which have no target (past the end of their answer)
    targets = torch.stack([order[torch.arange(40), torch.arange(40) % 4], order[:, 0]], dim=1)
    targets[32:, 1] = IGNORE
    a = head_accuracies(heads, model.lm_head, Rows(hidden, targets), ranks=5, batch_size=16)
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


def test_step_latency_times_every_size_and_leaves_the_prompt_cached():
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()
    nodes, _ = grow_tree(torch.tensor([[0.5, 0.2], [0.3, 0.1]]), 6)
    latency = step_latency(model, heads, [0, 1, 3, 6], nodes, prompt_len=10, repeats=2)
    assert set(latency) == {0, 1, 3, 6} and all(s > 0 for s in latency.values())


def test_tuned_tree_beside_the_heads_is_the_default_and_tree_flag_overrides(tmp_path):
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 4, shared_lm_head=True).eval()
    save_heads(heads, tmp_path)
    cpu = torch.device("cpu")
    name, tree = decoding_tree(None, heads, model, str(tmp_path))
    assert name == "cpu_8"  # nothing tuned yet
    tuned = [[0], [0, 0], [1]]
    (tmp_path / TREES).write_text(json.dumps({device_key(cpu, torch.float32): {"nodes": tuned}}))
    name, tree = decoding_tree(None, heads, model, str(tmp_path))
    assert name == f"tuned for {device_key(cpu, torch.float32)}"
    assert set(tree.nodes[1:]) == {(0,), (0, 0), (1,)}
    name, _ = decoding_tree(None, heads, model.to(torch.bfloat16), str(tmp_path))
    assert name == "cpu_8"  # tuned for another dtype: not used
    name, _ = decoding_tree("chain3", heads, model.float(), str(tmp_path))
    assert name == "chain3"
    other = "cpu/float32/Another CPU, 2 cores, 2 threads"
    (tmp_path / TREES).write_text(json.dumps({other: {"nodes": tuned}}))
    name, tree = decoding_tree(None, heads, model, str(tmp_path))
    assert name.startswith(f"tuned for {other}, not this machine") and tree.size == 4


def test_default_tree_is_cut_to_the_paths_fewer_heads_can_read(tmp_path):
    """Heads with no tuned tree fall back to the device's named tree, made for any heads: its
    paths deeper than these heads are dropped (what is left is still a tree: every path's
    prefixes are shorter), rather than refusing heads that are fine."""
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()
    save_heads(heads, tmp_path)
    name, tree = decoding_tree(None, heads, model, str(tmp_path))
    assert name.startswith("cpu_8 (cut to its paths of at most 2 nodes")
    assert set(tree.nodes[1:]) == {(0,), (1,), (0, 0), (0, 1), (1, 0)}


def test_tree_search_cli_calibrates_and_writes_a_tree_decoding_accepts(tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    model = tiny_model(7, dtype=torch.float32)
    save_heads(MedusaHeads.for_model(model, 3, shared_lm_head=True), tmp_path)
    tree_search.main(["--heads", str(tmp_path), "--data", str(data), "--model", str(model_dir),
                      "--max-nodes", "6", "--device", "cpu", "--out", str(tmp_path / "t.json")])
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert len(calibration["accuracy"]) == 3 and len(calibration["accuracy"][0]) == 10
    entry = json.loads((tmp_path / TREES).read_text())[device_key(torch.device("cpu"),
                                                                   torch.float32)]
    assert entry["nodes"] == json.loads((tmp_path / "t.json").read_text())
    assert set(entry["estimates"]) == {"0", "1", "2", "3", "4", "6"}
    build_tree(entry["nodes"], num_heads=3)


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="^error: heads folder .* does not exist$"):
        tree_search.main(["--heads", str(tmp_path / "missing"), "--budget", "4"])

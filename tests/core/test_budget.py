"""The tree budget adapts to the machine it runs on: from a wrong prior (latencies measured
elsewhere) the steps end on the size the true latencies favour, plain decoding when no tree
pays; a step tells what every smaller nested tree would have accepted; groups of steps that
accept differently settle on their own sizes, a context chain's group as far as the chain pays;
switching sizes mid-run never changes the greedy output; and a damaged, unwritable or outdated
(other kernels) latency cache costs a measurement and one line at most, never the run."""
import os
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import copycat_model, tiny_model
from minimedusa.acceptance import Sampling, greedy, typical
from minimedusa.budget import Budget, batch_latency, grow_tree, nested_trees
from minimedusa.assembly import latency_cache
from minimedusa.assembly.latency_cache import latency_key, machine_latency
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.speed.machine import machine_key
from minimedusa.heads import MedusaHeads
from minimedusa.speculative_sampling import DrawnDraft, speculative

# these tests time steps and read their cache: each its own folder (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_latency_cache")

SIZES = [0, 1, 2, 4, 8, 16]
# a simulated machine and heads: the accepted chain of a step is the first d nodes of a spine
# whose nodes were grown 1st, 3rd, 6th and 12th; P(d >= k) = 0.7, 0.5, 0.3, 0.15
SPINE = [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
RANK = {(0,): 1, (1,): 2, (0, 0): 3, (2,): 4, (1, 0): 5, (0, 0, 0): 6,
        **{(9, i): 6 + i for i in range(1, 6)}, (0, 0, 0, 0): 12,
        **{(8, i): 12 + i for i in range(1, 5)}}
DEPTH_AT_LEAST = [1.0, 0.7, 0.5, 0.3, 0.15]
EXPECTED = {n: 1 + sum(p for rank, p in zip((1, 3, 6, 12), DEPTH_AT_LEAST[1:]) if rank <= n)
            for n in SIZES if n}  # the calibration's expectation, here exactly right
TRUE_LATENCY = {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.5}  # best rate: 4 nodes


def simulate(budget: Budget, steps: int, seed: int = 0) -> list[int]:
    """Run the budget on the simulated machine (5% timing noise); the sizes it chose."""
    rng, chosen = random.Random(seed), []
    for _ in range(steps):
        n = budget.choose()
        u = rng.random()
        depth = sum(u < p for p in DEPTH_AT_LEAST[1:])
        accepted = [p for p in SPINE[:depth] if RANK[p] <= n]
        budget.record(n, TRUE_LATENCY[n] * rng.uniform(0.95, 1.05), accepted, RANK)
        chosen.append(n)
    return chosen


def true_best() -> int:
    rate = {n: (EXPECTED.get(n, 1.0)) / TRUE_LATENCY[n] for n in SIZES}
    return max(rate, key=rate.get)


@pytest.mark.parametrize("prior", [
    {0: 3.0, 1: 3.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 1.0},  # "16 nodes cost no more than plain"
    {0: 1.0, 1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0},  # "every tree costs 10 steps"
    {0: 0.1, 1: 0.3, 2: 0.3, 4: 0.9, 8: 0.12, 16: 0.9},  # off everywhere, and 8 looks best
])
def test_a_wrong_latency_prior_recovers_to_the_size_true_latencies_favour(prior):
    budget = Budget(SIZES, EXPECTED, prior)
    chosen = simulate(budget, 300)
    assert true_best() == 4
    assert budget.best() == 4
    assert chosen[-100:].count(4) == 100  # settled: the probes are over


def test_a_size_timed_high_once_is_timed_again_and_the_run_returns_to_it():
    """Plain steps timed slow among a run's first (3x: cold caches, another load) send the
    budget to a tree that truly pays less; their timings expire (stale) and are taken again,
    and the steps go back to plain."""
    budget = Budget(SIZES, EXPECTED, dict(TRUE_LATENCY), stale=200)
    slow = {n: 1.0 + 0.8 * n for n in SIZES if n}  # every tree step costs > 1.8x: plain pays
    rng, chosen = random.Random(1), []
    for _ in range(1200):
        n = budget.choose()
        depth = sum(rng.random() < p for p in DEPTH_AT_LEAST[1:2])
        accepted = [p for p in SPINE[:depth] if RANK[p] <= n]
        seconds = (3.0 if chosen.count(0) < 3 else 1.0) if n == 0 else slow[n]
        budget.record(n, seconds, accepted, RANK)
        chosen.append(n)
    assert chosen[:100].count(0) < 50  # fooled at first
    assert chosen[-100:].count(0) > 90


def test_when_no_tree_pays_the_steps_are_plain():
    slow = {0: 1.0, **{n: 1.0 + 0.8 * n for n in SIZES if n}}  # every tree step costs > 1.8x
    budget = Budget(SIZES, EXPECTED, dict(TRUE_LATENCY))
    rng = random.Random(1)
    for _ in range(200):
        n = budget.choose()
        depth = sum(rng.random() < p for p in DEPTH_AT_LEAST[1:2])
        budget.record(n, slow[n], [p for p in SPINE[:depth] if RANK[p] <= n], RANK)
    assert budget.best() == 0
    # the prior said trees were cheap: a few sizes get 3 timed steps each, then plain only
    assert sum(c for n, c in budget.used.items() if n) <= 15
    assert budget.used[0] >= 185


@given(st.integers(1, 16), st.dictionaries(st.integers(0, 64), st.floats(0.1, 10.0),
                                           min_size=2, max_size=8))
def test_a_batch_steps_prior_is_a_batch_1_forward_of_as_many_rows(batch, latency):
    """A step of n nodes in a batch of B rows is priced as a batch-1 forward of B (n + 1) rows:
    a size whose rows the batch-1 table holds takes that size's latency, batch 1 the table
    itself, and between or past the table's sizes the latency is linear in the rows."""
    prior = batch_latency(latency, batch)
    assert set(prior) == set(latency)
    rows = {n + 1: seconds for n, seconds in latency.items()}
    for n, seconds in prior.items():
        if batch * (n + 1) in rows:
            assert seconds == pytest.approx(rows[batch * (n + 1)])
    assert batch_latency(latency, 1) == pytest.approx(latency)
    line = {n: 1.0 + 0.25 * (n + 1) for n in latency}  # latencies linear in the rows stay so
    assert batch_latency(line, batch) == pytest.approx(
        {n: 1.0 + 0.25 * batch * (n + 1) for n in latency})


def test_a_step_counts_what_every_smaller_nested_tree_would_have_accepted():
    budget = Budget(SIZES, {}, dict(TRUE_LATENCY))
    budget.record(16, 2.5, SPINE, RANK)  # the whole spine: ranks 1, 3, 6, 12
    assert {n: budget.tokens[0][n] for n in SIZES[1:]} == {1: 2, 2: 2, 4: 3, 8: 4, 16: 5}
    budget.record(4, 1.2, SPINE[:1], RANK)
    tokens, steps = budget.tokens[0], budget.steps[0]  # group 0: the steps named no group
    assert tokens[8] == 4 and steps[8] == 1  # a 4-node step says nothing of 8
    assert tokens[4] == 5 and steps[4] == 2


def test_groups_that_accept_differently_settle_on_their_own_sizes():
    """Steps of group 1 (say, a long context match) accept the whole spine of any tree, group
    0's accept nothing: on the same machine, group 1 settles on the tree whose rate is best,
    group 0 on plain steps or 1 node (here within the margin of each other), and neither's
    counts leak into the other's."""
    budget = Budget(SIZES, EXPECTED, dict(TRUE_LATENCY))
    rng = random.Random(0)
    for _ in range(400):
        group = rng.randrange(2)
        n = budget.choose(group)
        accepted = [p for p in SPINE if RANK[p] <= n] if group == 1 else []
        budget.record(n, TRUE_LATENCY[n] * rng.uniform(0.95, 1.05), accepted, RANK,
                      group=group)
    rate = {n: (1 + sum(r <= n for r in (1, 3, 6, 12))) / TRUE_LATENCY[n] for n in SIZES}
    assert budget.best(1) == max(rate, key=rate.get) == 8
    assert budget.best(0) in (0, 1)
    assert budget.tokens[0][1] == budget.steps[0][1]  # group 0: one token a step, at any size


def test_a_group_anchors_the_calibration_at_what_it_measured():
    """Once a group has measured a size, a bigger size's prior is that measurement plus the
    calibration's growth between the two, not the calibration's level."""
    budget = Budget(SIZES, {1: 1.5, 2: 1.7, 4: 1.9}, dict(TRUE_LATENCY))
    for _ in range(3):
        chain = {(0,): 1, (0, 0): 2}  # a 2-node chain tree (a merged step's ranks)
        budget.record(2, 1.1, [(0,), (0, 0)], chain, group=3)  # 3 tokens a step at 2 nodes
    assert budget.prior(4, 3) == pytest.approx(3.0 + 1.9 - 1.7)
    assert budget.prior(4, 0) == 1.9  # another group's measurement says nothing of group 0


def chain_group_sizes(chain: int, seed: int, steps: int = 300) -> Budget:
    """A budget run on chain steps (group 2: a context chain alone fills a step of up to 5
    nodes), every size already timed by other steps; each chain token right with probability
    0.9 while the ones before it are (P(first k right) = 0.9^k, a copy), the heads'
    calibration predicting much less growth."""
    sizes, latency = [0, 1, 2, 3, 4, 8], {0: 1.0, 1: 1.1, 2: 1.24, 3: 1.33, 4: 1.48, 8: 1.84}
    rank = {(0,) * d: d for d in range(1, 6)}  # the chain's nodes by depth
    budget = Budget(sizes, {1: 1.5, 2: 1.6, 3: 1.7, 4: 1.75, 8: 1.9}, latency, chain=chain)
    for n in sizes:  # timed elsewhere: no probing step in this group
        for _ in range(3):
            budget.record(n, latency[n], [], rank)
    rng = random.Random(seed)
    for _ in range(steps):
        n = budget.choose(2)
        right = next((k for k in range(5) if rng.random() >= 0.9), 5)  # the chain's right run
        budget.record(n, latency[n], [(0,) * d for d in range(1, min(n, 5, right) + 1)], rank,
                      group=2)
    return budget


def test_a_chain_group_grows_its_steps_as_far_as_the_chain_pays():
    """Judged by the heads' calibration, a chain that is right 90% of the time rarely looks worth
    a second node (1.9 + 0.1 tokens for 1.24 plain steps: 1.61 tokens a plain step's time,
    against 1.73 at 1 node; only a lucky start climbs); by the chain's own acceptance every run
    ends on the best size, 4 (2.77, against 2.59 at 3 and 2.55 at 8)."""
    seeds = range(20)
    assert all(chain_group_sizes(chain=5, seed=seed).best(2) == 4 for seed in seeds)
    assert sum(chain_group_sizes(chain=0, seed=seed).best(2) == 4 for seed in seeds) < 10


def test_unknown_acceptance_is_tried_before_it_is_judged():
    budget = Budget([0, 7], {}, {0: 1.0, 7: 5.0})
    for _ in range(10):
        n = budget.choose()
        budget.record(n, {0: 1.0, 7: 5.0}[n], [], {})  # the tree accepts nothing, at 5x the cost
    assert budget.used == {0: 7, 7: 3}  # no calibration: tried (3 timed steps) however slow
    # it looked, then dropped


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_switching_tree_sizes_mid_run_keeps_greedy_output_identical_to_plain(seed, ranked):
    model = copycat_model(seed)
    heads = MedusaHeads.for_model(model, 4, shared_lm_head=True).eval()
    for p in heads.parameters():
        p.data += 0.02 * torch.randn_like(p)
    nodes = [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0), (1, 0), (0, 0, 0, 0)]
    sizes = [1, 2, 4, 8]
    trees, rank = nested_trees(nodes, sizes, 4, model.config.vocab_size, "cpu")
    rng = random.Random(seed)  # a prior that makes the budget wander over every size
    budget = Budget([0, *sizes], {n: rng.uniform(1, 3) for n in sizes},
                    {n: rng.uniform(0.5, 2) for n in [0, *sizes]},
                    clock=lambda: rng.random())  # a lying clock
    prompt = [3, 5, 7, 3, 5]
    flat = lambda steps: [t for step in steps for t in step.tokens]  # noqa: E731
    draft = RankedDraft(heads) if ranked else TreeDraft(heads, trees, rank)
    medusa = flat(medusa_decode(model, draft, budget, greedy(), prompt, 60, set()))
    assert medusa == flat(plain_decode(model, prompt, 60, Sampling(), set()))
    assert len([n for n, c in budget.used.items() if c]) >= 2  # it did switch


def test_the_machine_key_names_the_vector_features_not_only_the_cpu():
    key = machine_key(torch.device("cpu"), torch.float32)
    assert key.startswith("cpu/float32/") and f"{torch.get_num_threads()} threads, " in key
    features = key.rsplit(", ", 1)[1]
    assert features  # e.g. "avx2+fma" or "avx2+fma+avx512f+amx_tile"


def latency_setup():
    """A tiny model, a draft of 2 heads on their nested trees of 1 and 3 nodes, and the greedy
    rule: what machine_latency times (plain steps included)."""
    model = tiny_model(dtype=torch.float32)
    heads = MedusaHeads.for_model(model, 2, shared_lm_head=True).eval()
    nodes, _ = grow_tree(torch.tensor([[0.5, 0.2], [0.3, 0.1]]), 3)
    trees, _ = nested_trees(nodes, [1, 3], 2, model.config.vocab_size, "cpu")
    return model, TreeDraft(heads, trees), greedy(), [1, 3]


def test_latencies_cached_before_a_kernel_changed_are_measured_again(tmp_path, monkeypatch):
    """A faster (or slower) C kernel changes every size's step time: the cache is keyed by the
    kernels' sources, so a user's cache from an older version is not taken for this one."""
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path))
    model, draft, rule, sizes = latency_setup()
    latency, _ = machine_latency(model, draft, rule, sizes, repeats=1)
    assert machine_latency(model, draft, rule, sizes) == (latency, "cached")
    monkeypatch.setattr(latency_cache, "kernels_version", lambda: "another version")
    assert machine_latency(model, draft, rule, sizes, repeats=1)[1] == "measured here"


def test_the_latency_key_names_the_draft_and_the_rule_the_timing_ran(tmp_path, monkeypatch):
    """A drawn draft verified by speculative sampling costs more a step than the heads' top-k
    verified greedily: latencies timed for one are not read for the other."""
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path))
    model, draft, rule, sizes = latency_setup()
    drawn, sampled = DrawnDraft(draft.heads, draft.trees, 0.7, 1), speculative(0.7, seed=0)
    assert latency_key(model, draft, rule) != latency_key(model, drawn, sampled)
    assert latency_key(model, draft, rule) != latency_key(model, draft, typical(0.7))
    machine_latency(model, draft, rule, sizes, repeats=1)
    assert machine_latency(model, drawn, sampled, sizes, repeats=1)[1] == "measured here"
    assert machine_latency(model, draft, rule, sizes)[1] == "cached"


@pytest.mark.parametrize("damage", [
    b"\xff\xfe{", b'{"key": {"0": 0.1', b"[1, 2]", b'{"key": 5}', b'{"key": {"0": "fast"}}',
    b'{"key": {"plain": 0.1}}', b'{"key": {"0": 0}}', b'{"key": {"0": NaN}}'],
    ids=["not utf-8", "cut short", "a list", "a number", "a string", "a size", "zero", "nan"])
def test_a_damaged_latency_cache_is_measured_again_and_rewritten(damage, tmp_path,
                                                                  monkeypatch, capsys):
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path))
    (tmp_path / "step_latency.json").write_bytes(damage)
    model, draft, rule, sizes = latency_setup()
    latency, source = machine_latency(model, draft, rule, sizes, repeats=1)
    assert source == "measured here" and set(latency) == {0, 1, 3}
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "step_latency.json was damaged (" in lines[0]
    assert lines[0].endswith("; measured again")
    assert machine_latency(model, draft, rule, sizes) == (latency, "cached")  # the next run's
    assert capsys.readouterr().err == ""
    assert os.listdir(tmp_path) == ["step_latency.json"]  # renamed into place, nothing left


@pytest.mark.parametrize("unwritable", [
    "a file", "a folder in the file's place",
    pytest.param("a read-only folder", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root writes into read-only folders"))])
def test_an_unwritable_latency_cache_gives_the_latencies_and_says_so(unwritable, tmp_path,
                                                                     monkeypatch, capsys):
    cache = tmp_path / "cache"
    if unwritable == "a file":  # MINIMEDUSA_CACHE naming a regular file
        cache.write_text("not a folder")
    elif unwritable == "a folder in the file's place":
        (cache / "step_latency.json").mkdir(parents=True)
    else:
        cache.mkdir(mode=0o555)
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(cache))
    model, draft, rule, sizes = latency_setup()
    latency, source = machine_latency(model, draft, rule, sizes, repeats=1)
    assert source == "measured here" and set(latency) == {0, 1, 3}
    lines = capsys.readouterr().err.splitlines()
    said = ("step latencies measured here were not kept" if unwritable.startswith("a folder ")
            else f"the cache folder {cache} cannot be written")  # cache_folder.py's one line
    assert len(lines) == 1 and said in lines[0]
    assert lines[0].endswith("set MINIMEDUSA_CACHE to a writable folder")
    assert not list(tmp_path.rglob("*.tmp"))

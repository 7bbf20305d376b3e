"""Batched decoding (batch_decoding.py; Medusa in a batch: experiments/batch_medusa.py): many
prompts at once, each row its own sequence in one KV cache. Proven on random tiny models for
random prompts, batch sizes and stop ids: every row's answer is its batch-1 answer, greedy and
sampled (each row its own generator), whatever the rows beside it and whenever they finish;
with Medusa's trees in the batch (random trees, each row its own acceptance and compaction),
greedy rows are batch-1 plain greedy and rejection sampled rows batch-1 Medusa's; the cache's
per-row writes and views; the fused step's batches (a row's bits whatever the rows beside it);
generate.py --prompts --batch."""
import itertools
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import generate
from helpers import (copycat_model, cycling_heads, cycling_model, DEVICES, four_bit_model, fused,
                    tiny_model, trees)
from minimedusa.acceptance import Sampling, greedy, rejection
from minimedusa.batch_decoding import batch_decode, batch_step
from minimedusa.experiments.batch_medusa import (BatchMedusa, batch_medusa_decode,
                                                 batch_tree_mask, batch_tree_step, compact_row,
                                                 max_tree_size)
from minimedusa.budget import Budget, fixed, nested_trees
from minimedusa.decoding import (decode_step, medusa_decode, plain_decode, prefill, tree_forward,
                                 tree_mask)
from minimedusa.context_candidates import ContextDraft
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.errors import UserError
from minimedusa.kv_cache import KVCache
from minimedusa.speculative_sampling import DrawnDraft
from minimedusa.speed import group_kernel
from minimedusa.speed.compiled_step import compile_blocks, compiler_problem
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.training.self_distill import answer_batch
from minimedusa.tree import build_tree


def flat(steps):
    return [t for step in steps for t in step.tokens]


def random_prompts(seed: int, n: int, longest: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(k),), generator=g).tolist()
            for k in torch.randint(1, longest + 1, (n,), generator=g)]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 10), batch=st.integers(1, 8),
       max_new=st.integers(1, 25), repetitive=st.booleans())
def test_every_rows_greedy_answer_is_its_batch_1_answer(device, seed, n, batch, max_new,
                                                        repetitive):
    """Rows finish early (a stop id, which some answers hit) and take the next prompt, or
    leave the batch: no other row's answer changes."""
    model = copycat_model(seed, 4.0, device=device) if repetitive else tiny_model(seed,
                                                                                  device=device)
    prompts, stop = random_prompts(seed, n, 12), {seed % 64, 1}
    answers = dict(batch_decode(model, prompts, max_new, Sampling(), stop, batch))
    assert answers == {i: flat(plain_decode(model, p, max_new, Sampling(), stop))
                       for i, p in enumerate(prompts)}


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), batch=st.integers(2, 8),
       temperature=st.sampled_from([0.5, 1.0, 1.5]), top_p=st.sampled_from([1.0, 0.8]))
def test_every_rows_sampled_answer_is_its_batch_1_answer(seed, n, batch, temperature, top_p):
    """Each row draws from a generator of its own, seeded as batch-1 seeds one: the same
    tokens, so the same law (plain sampling's)."""
    model = tiny_model(seed)
    sampling = Sampling(temperature, top_p, seed=seed)
    prompts = random_prompts(seed, n, 10)
    answers = dict(batch_decode(model, prompts, 20, sampling, {3}, batch))
    assert answers == {i: flat(plain_decode(model, p, 20, sampling, {3}))
                       for i, p in enumerate(prompts)}


def test_answers_come_as_each_finishes_and_every_prompt_once():
    model = tiny_model(2)
    prompts = random_prompts(2, 9, 8)
    order = [i for i, _ in batch_decode(model, prompts, 12, Sampling(), {5, 9, 17}, 3)]
    assert sorted(order) == list(range(9))


def test_a_rows_own_slots_take_its_keys_and_values():
    """LayerCache.update with slots (B, N): row b's entries at slots[b], as an index_copy_ of
    that row alone would put them."""
    cache, alone = KVCache(1, 3, 2, 10, 4, "cpu", torch.float64), KVCache(1, 3, 2, 10, 4, "cpu",
                                                                         torch.float64)
    k, v = torch.randn(3, 2, 2, 4, dtype=torch.float64), torch.randn(3, 2, 2, 4,
                                                                     dtype=torch.float64)
    slots = torch.tensor([[0, 1], [5, 6], [3, 9]])
    cache.layers[0].update(slots, k, v, 10)
    for b in range(3):
        alone.layers[0].k[b:b + 1].index_copy_(2, slots[b], k[b:b + 1])
        alone.layers[0].v[b:b + 1].index_copy_(2, slots[b], v[b:b + 1])
    assert torch.equal(cache.layers[0].k, alone.layers[0].k)
    assert torch.equal(cache.layers[0].v, alone.layers[0].v)


def test_a_rows_view_writes_into_the_batch_and_rows_leave_in_order():
    model = tiny_model(0)
    cache = KVCache.for_model(model, 16, batch_size=3)
    for b in range(3):
        prefill(model, cache.row(b), torch.tensor([[b + 2, b + 3]]))
    alone = KVCache.for_model(model, 16)
    prefill(model, alone, torch.tensor([[4, 5]]))
    assert torch.equal(cache.layers[0].k[2:3, :, :2], alone.layers[0].k[:, :, :2])
    cache.keep_rows([2, 0])
    assert torch.equal(cache.layers[0].k[0:1, :, :2], alone.layers[0].k[:, :, :2])


def test_a_batch_step_gives_each_rows_own_step():
    """Rows of different lengths: row b's logits are a batch-1 step's after its prompt (its own
    slots written, the others' masked)."""
    model = tiny_model(4)
    prompts = random_prompts(4, 4, 9)
    cache = KVCache.for_model(model, 16, batch_size=4)
    for b, p in enumerate(prompts):
        prefill(model, cache.row(b), torch.tensor([p]))
    tokens = torch.tensor([[7], [8], [9], [10]])
    logits, _ = batch_step(model, cache, tokens, [len(p) for p in prompts])
    for b, p in enumerate(prompts):
        alone = KVCache.for_model(model, 16)
        prefill(model, alone, torch.tensor([p]))
        # float64 products, whose rows torch's matrix product may round apart by an ulp
        torch.testing.assert_close(logits[b:b + 1], decode_step(model, alone, tokens[b:b + 1])[0],
                                   rtol=0, atol=1e-12)


def test_a_rows_tree_mask_is_its_batch_1_tree_mask_at_its_own_slots():
    """Row b sees its own cached slots and its tree's ancestors at lengths[b] + j: the batch-1
    mask, shifted past the row's cache, and nothing after it."""
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    lengths = [3, 7, 1]
    mask = batch_tree_mask(tree, torch.tensor(lengths).unsqueeze(1), 7 + tree.size)
    assert mask.shape == (3, tree.size, 7 + tree.size)
    for b, n in enumerate(lengths):
        assert torch.equal(mask[b, :, :n + tree.size], tree_mask(tree, n)[0])
        assert not mask[b, :, n + tree.size:].any()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 5), choices=trees(max_nodes=12))
def test_a_batched_tree_step_and_each_rows_compaction_are_each_rows_batch_1_ones(seed, batch,
                                                                                 choices):
    """Rows of different lengths, a tree each, each row keeping its own accepted chain: every
    node's logits are its row's batch-1 tree step's, and so are the next step's after each
    row's compaction (which read what the compaction left: a random model, whose tokens
    depend on every cached entry, unlike the cycling model's)."""
    model = tiny_model(seed % 7)
    tree = build_tree(choices)
    prompts = random_prompts(seed, batch, 9)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 64, (batch, tree.size), generator=g)
    leaves = torch.randint(0, tree.size, (batch,), generator=g).tolist()
    kept = [[tree.nodes.index(tree.nodes[leaf][:d]) for d in range(len(tree.nodes[leaf]) + 1)]
            for leaf in leaves]  # each row a root-to-node chain, root first
    nxt = torch.randint(2, 64, (batch, 1), generator=g)
    cache = KVCache.for_model(model, 32, batch_size=batch)
    for b, p in enumerate(prompts):
        prefill(model, cache.row(b), torch.tensor([p]))
    lengths = [len(p) for p in prompts]
    logits, _ = batch_tree_step(model, cache, tree, tokens, lengths)
    for b in range(batch):
        compact_row(cache, b, lengths[b], kept[b])
    after, _ = batch_step(model, cache, nxt, [n + len(k) for n, k in zip(lengths, kept)])
    for b, p in enumerate(prompts):
        alone = KVCache.for_model(model, 32)
        prefill(model, alone, torch.tensor([p]))
        close = dict(rtol=0, atol=1e-12)  # float64 products: an ulp apart at most
        torch.testing.assert_close(logits[b], tree_forward(model, alone, tree, tokens[b])[0],
                                   **close)
        alone.compact(kept[b])
        torch.testing.assert_close(after[b:b + 1], decode_step(model, alone, nxt[b:b + 1])[0],
                                   **close)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@settings(max_examples=12, deadline=None)
@given(choices=trees(max_nodes=20, max_depth=4), seed=st.integers(0, 10_000),
       n=st.integers(1, 8), batch=st.integers(1, 8), max_new=st.integers(1, 30))
def test_every_rows_batched_medusa_greedy_answer_is_its_batch_1_plain_greedy_answer(
        kind, choices, seed, n, batch, max_new):
    """Each row its own tree's candidates and its own acceptance; rows accepting different
    lengths in one cache (each its own compaction), finishing early (a stop id) and refilled:
    every answer is plain greedy's, token for token."""
    model = cycling_model(seed % 5)
    heads = cycling_heads(model, kind, seed)
    draft, budget = fixed(heads, build_tree(choices, num_heads=4))
    prompts, stop = random_prompts(seed, n, 10), {seed % 64}
    answers = dict(batch_medusa_decode(model, prompts, max_new,
                                       BatchMedusa(draft, budget, greedy()), stop, batch))
    assert answers == {i: flat(plain_decode(model, p, max_new, Sampling(), stop))
                       for i, p in enumerate(prompts)}


def test_a_budget_mixing_plain_steps_and_tree_sizes_keeps_every_row_lossless():
    """The budget picks each step's size for the whole batch, plain steps among them (a fake
    clock: every step as long; a prior that no tree pays, until a probe shows what they
    accept): the answers stay plain greedy's, and the trees accept (more than one token a
    row-step)."""
    model = cycling_model(1)
    heads = cycling_heads(model, "hydra", 1)
    nodes = [(0,), (1,), (0, 0), (0, 0, 0), (1, 0), (0, 1), (0, 0, 0, 0)]
    trees_by_size, rank = nested_trees(nodes, [1, 2, 4, 7], 4, None, "cpu")
    ticks = itertools.count()
    budget = Budget([0, 1, 2, 4, 7], dict.fromkeys([1, 2, 4, 7], 1.0),
                    dict.fromkeys([0, 1, 2, 4, 7], 1.0), clock=lambda: next(ticks))
    prompts = random_prompts(3, 6, 10)
    medusa = BatchMedusa(fast_draft(TreeDraft(heads, trees_by_size, rank), model), budget,
                         greedy())
    answers = dict(batch_medusa_decode(model, prompts, 40, medusa, set(), 4))
    assert answers == {i: flat(plain_decode(model, p, 40, Sampling(), set()))
                       for i, p in enumerate(prompts)}
    assert budget.used[0] > 0 and sum(budget.used[n] for n in (1, 2, 4, 7)) > 0
    assert 6 * 40 > 1.2 * sum(budget.used.values())  # tokens over row-steps


class RowsBudget(Budget):
    """A Budget that notes how many rows recorded each of its steps (a step: one choose)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_a_step: list[int] = []

    def choose(self, group: int = 0) -> int:
        self.rows_a_step.append(0)
        return super().choose(group)

    def record(self, *args, **kwargs) -> None:
        self.rows_a_step[-1] += 1
        super().record(*args, **kwargs)


def test_a_batchs_tail_is_timed_by_a_budget_of_its_own_row_count():
    """Rows leave once no prompt is left (answers of different lengths: stop ids), and a step's
    time is its rows': each count of rows gets a budget of its own (fewer), which sees only
    steps of that many rows; the answers stay plain greedy's."""
    model = cycling_model(2)
    heads = cycling_heads(model, "hydra", 2)
    trees_by_size, rank = nested_trees([(0,), (1,), (0, 0)], [1, 3], 4, None, "cpu")
    ticks = itertools.count()

    def budget(rows: int) -> RowsBudget:
        made[rows] = RowsBudget([0, 1, 3], {1: 1.5, 3: 2.0}, {0: 1.0, 1: 1.0, 3: 1.0},
                                rows=rows, clock=lambda: next(ticks))
        return made[rows]
    made: dict[int, RowsBudget] = {}
    prompts = random_prompts(5, 7, 10)
    medusa = BatchMedusa(fast_draft(TreeDraft(heads, trees_by_size, rank), model), budget(4),
                         greedy(),
                         budget)
    stop = {11, 23, 37}
    answers = dict(batch_medusa_decode(model, prompts, 30, medusa, stop, 4))
    assert answers == {i: flat(plain_decode(model, p, 30, Sampling(), stop))
                       for i, p in enumerate(prompts)}
    assert len(made) > 1  # the tail ran fewer rows
    for rows, b in made.items():
        assert b.rows_a_step and set(b.rows_a_step) == {rows}


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), batch=st.integers(2, 6),
       temperature=st.sampled_from([0.5, 1.0]))
def test_every_rows_rejection_sampled_answer_is_its_batch_1_medusa_answer(seed, n, batch,
                                                                         temperature):
    """Rejection sampling, each row drawing from its own generator seeded as batch-1 Medusa
    seeds its one: the same tokens as batch-1 Medusa, whose law is plain sampling's
    (test_rejection_sampling.py's chi-square), so each row keeps that law."""
    model = cycling_model(seed % 5)
    heads = cycling_heads(model, "hydra", seed)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]], num_heads=4)
    rule = rejection(temperature, seed=seed)
    prompts = random_prompts(seed, n, 8)
    answers = dict(batch_medusa_decode(model, prompts, 20, BatchMedusa(*fixed(heads, tree), rule),
                                       {3}, batch))
    assert answers == {i: flat(medusa_decode(model, *fixed(heads, tree), rule, p, 20, {3}))
                       for i, p in enumerate(prompts)}


def test_batches_trees_stay_within_the_exact_attentions_rows():
    assert max_tree_size(1) == 255 and (max_tree_size(8) + 1) * 8 <= 256
    model = cycling_model(0)
    tree = build_tree([[i] for i in range(4)] + [[i, j] for i in range(4) for j in range(4)],
                      num_heads=4)  # 20 nodes
    medusa = BatchMedusa(*fixed(cycling_heads(model, "medusa", 0), tree), greedy())
    with pytest.raises(ValueError, match="at most 15"):
        list(batch_medusa_decode(model, [[5, 6]] * 16, 4, medusa, set(), 16))


@pytest.mark.parametrize("wrap, needle", [
    (ContextDraft, "ContextDraft keeps a sequence's state"),
    (lambda draft: RankedDraft(draft.heads), "RankedDraft keeps a sequence's state"),
    (lambda draft: DrawnDraft(draft.heads, draft.trees, 0.7), "drawn candidates")])
def test_a_draft_the_batch_cannot_run_is_one_line(wrap, needle):
    """Drafts whose state is a sequence's, whose tree is each row's, or whose draws the
    acceptance must be told: refused before a step, not decoded wrong."""
    model = cycling_model(0)
    draft, budget = fixed(cycling_heads(model, "medusa", 0), build_tree([[0], [1]], 4))
    with pytest.raises(UserError, match=needle):
        list(batch_medusa_decode(model, [[5, 6]] * 2, 4, BatchMedusa(wrap(draft), budget,
                                                                     greedy()), set(), 2))


@pytest.mark.kernels
@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="the fused step runs group_kernel.c's products")
@pytest.mark.parametrize("batch", [2, 5])
def test_the_fused_steps_batches_answer_as_its_batch_1_steps(batch):
    """The default path: an int4 model's blocks in one C++ call, a batch's rows each its cache
    row and slots: every answer its fused batch-1 answer, token for token."""
    model = fused(four_bit_model(1), "int4", torch.bfloat16)
    prompts = random_prompts(1, 7, 12)
    answers = dict(batch_decode(model, prompts, 16, Sampling(), set(), batch))
    assert answers == {i: flat(plain_decode(model, p, 16, Sampling(), set()))
                       for i, p in enumerate(prompts)}
    cache = KVCache.for_model(model, 16, batch_size=batch)  # and a step's logits, to the bit
    for b, p in enumerate(prompts[:batch]):
        prefill(model, cache.row(b), torch.tensor([p]))
    tokens = torch.arange(5, 5 + batch).unsqueeze(1)
    logits, _ = batch_step(model, cache, tokens, [len(p) for p in prompts[:batch]])
    for b, p in enumerate(prompts[:batch]):
        alone = KVCache.for_model(model, 16)
        prefill(model, alone, torch.tensor([p]))
        assert torch.equal(logits[b:b + 1], decode_step(model, alone, tokens[b:b + 1])[0])


@pytest.mark.kernels
@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="the fused step runs group_kernel.c's products")
def test_the_fused_steps_batched_trees_give_each_row_its_batch_1_tree_logits():
    """The default path's one C++ call for the blocks, a tree a row: row b's logits are its
    batch-1 tree step's, to the bit; and batched Medusa greedy answers as plain greedy."""
    model = fused(four_bit_model(1), "int4", torch.bfloat16)
    prompts = random_prompts(5, 3, 12)
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    tokens = torch.randint(2, 64, (3, tree.size), generator=torch.Generator().manual_seed(5))
    cache = KVCache.for_model(model, 32, batch_size=3)
    for b, p in enumerate(prompts):
        prefill(model, cache.row(b), torch.tensor([p]))
    logits, _ = batch_tree_step(model, cache, tree, tokens, [len(p) for p in prompts])
    for b, p in enumerate(prompts):
        alone = KVCache.for_model(model, 32)
        prefill(model, alone, torch.tensor([p]))
        assert torch.equal(logits[b], tree_forward(model, alone, tree, tokens[b])[0])


@pytest.mark.kernels
def test_the_compiled_steps_batches_answer_as_its_batch_1_steps():
    """The compiled step (float32, prepacked products) takes a batch's step too."""
    problem = compiler_problem()
    if problem is not None:
        pytest.skip(f"torch.compile does not work here: {problem}")
    model = apply_format(tiny_model(3, dtype=torch.float32), format_named("float32"))
    compile_blocks(model)
    prompts = random_prompts(3, 5, 10)
    answers = dict(batch_decode(model, prompts, 12, Sampling(), {1}, 3))
    assert answers == {i: flat(plain_decode(model, p, 12, Sampling(), {1}))
                       for i, p in enumerate(prompts)}


def test_generate_answers_a_file_in_batches_as_one_at_a_time_in_the_files_order(
        tmp_path, monkeypatch, capsys, chat_folder):
    path = tmp_path / "prompts.txt"
    path.write_text("What is 2 + 2?\nHello\nName a colour\nCount to five\nSay yes\n")
    flags = ["--model", str(chat_folder), "--prompts", str(path), "--no-compile", "--dtype",
             "float32", "--max-new-tokens", "12"]
    runs = {}
    for batch in ("1", "3"):
        monkeypatch.setattr("sys.stdin", open("/dev/null"))
        generate.main([*flags, "--batch", batch, "--baseline"])
        out, err = capsys.readouterr()
        runs[batch] = [json.loads(line) for line in out.splitlines()]
    assert [r["answer"] for r in runs["3"]] == [r["answer"] for r in runs["1"]]
    assert [r["prompt"] for r in runs["3"]] == path.read_text().splitlines()
    assert "3 prompts at a time; 5 prompts]" in err


def test_batch_is_for_a_prompts_file():
    with pytest.raises(SystemExit):
        generate.parse_args(["--prompt", "Hi", "--batch", "4"])


def test_batch_with_medusas_flags_is_one_error_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hi\nHello\n")
    with pytest.raises(SystemExit) as stop:
        generate.main(["--prompts", str(path), "--batch", "4", "--tree", "cpu_8"])
    assert "--tree ask for Medusa's trees" in str(stop.value) and "\n" not in str(stop.value)


def test_a_stopped_batched_run_keeps_the_answers_it_finished_in_order(tmp_path, monkeypatch):
    """Ctrl-C after the second prompt's answer and then the first's: both are kept beside --out
    (.partial, which the same command resumes from), in the file's order (the second waited
    for the first), whole; the third, unfinished, is not."""
    from minimedusa.cli import prompts as prompts_module
    path, out = tmp_path / "prompts.txt", tmp_path / "answers.jsonl"
    path.write_text("What is 2 + 2?\nName a colour.\nSay yes.\n")

    def stopped(model, prompts, n, sampling, stops, batch):
        yield 1, [5, 6]
        yield 0, [7]
        raise KeyboardInterrupt
    monkeypatch.setattr(prompts_module, "batch_decode", stopped)
    with pytest.raises(SystemExit, match="interrupted"):
        generate.main(["--prompts", str(path), "--out", str(out), "--max-new-tokens", "4",
                       "--batch", "3", "--no-compile"])
    partial = out.with_name(out.name + ".partial")
    assert [json.loads(line)["prompt"] for line in partial.read_text().splitlines()] == [
        "What is 2 + 2?", "Name a colour."]


@pytest.mark.kernels
@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="the fused step runs group_kernel.c's products")
def test_self_distillation_answers_in_the_fused_step_as_generate_does_alone():
    """answer_batch (training/self_distill.py) decodes batch_decoding's rows: in the default
    int4 step, every answer is the prompt's batch-1 answer."""
    model = fused(four_bit_model(2), "int4", torch.bfloat16)
    prompts = random_prompts(2, 6, 12)
    rows = answer_batch(model, prompts, 16, Sampling(), set(), None)
    assert [a for a, _ in rows] == [flat(plain_decode(model, p, 16, Sampling(), set()))
                                    for p in prompts]

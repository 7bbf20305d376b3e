"""Batched decoding (batch_decoding.py): many prompts at once, each row its own sequence in one
KV cache. Proven on random tiny models for random prompts, batch sizes and stop ids: every
row's answer is its batch-1 answer, greedy and sampled (each row its own generator), whatever
the rows beside it and whenever they finish; the cache's per-row writes and views; the fused
step's batches (a row's bits whatever the rows beside it); generate.py --prompts --batch."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import generate
from conftest import DEVICES, copycat_model, tiny_model
from minimedusa.batch_decoding import batch_decode, batch_step
from minimedusa.decoding import decode_step, plain_decode, prefill
from minimedusa.kv_cache import KVCache
from minimedusa.sampling import Sampling
from minimedusa.speed import group_kernel
from minimedusa.speed.compiled_step import compile_blocks, compiler_problem
from minimedusa.speed.weight_formats import apply_format
from minimedusa.training.self_distill import answer_batch
from test_chat import chat_folder  # noqa: F401 (a fixture)
from test_fused_block import fused
from test_weight_formats import four_bit_model


def flat(steps):
    return [t for step in steps for t in step]


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


def test_the_compiled_steps_batches_answer_as_its_batch_1_steps():
    """The compiled step (float32, prepacked products) takes a batch's step too."""
    problem = compiler_problem()
    if problem is not None:
        pytest.skip(f"torch.compile does not work here: {problem}")
    model = apply_format(tiny_model(3, dtype=torch.float32), "float32")
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
    """Ctrl-C after the second prompt's answer and then the first's: both are in --out, in the
    file's order (the second waited for the first), whole; the third, unfinished, is not."""
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
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == [
        "What is 2 + 2?", "Name a colour."]


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

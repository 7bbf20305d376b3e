"""Self-distillation data: batched answers equal each prompt decoded alone,
and the saved hidden states are the ones a plain forward computes; the seed prompts are many,
diverse and deterministic."""
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from helpers import tiny_model
from minimedusa.model import causal_mask
from minimedusa.decoding import plain_decode
from minimedusa.acceptance import Sampling
from minimedusa.training.seed_prompts import seed_prompts
from minimedusa.training.self_distill import answer_batch, model_written_prompts, same_settings
from minimedusa.files.tokenizer import Tokenizer


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), max_new=st.integers(1, 12))
def test_batched_answers_equal_each_prompt_decoded_alone(seed, lengths, max_new):
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in lengths]
    stop = {int(seed % 64)}
    rows = answer_batch(model, prompts, max_new, Sampling(), stop, None)
    for prompt, (answer, hidden) in zip(prompts, rows):
        assert answer == [t for s in plain_decode(model, prompt, max_new, Sampling(), stop)
                          for t in s.tokens]
        # hidden[i] is the state at the token before answer[i]
        seq = prompt + answer[:-1]
        T = len(seq)
        expected = model.hidden_states(torch.tensor([seq]), torch.arange(T)[None],
                                       causal_mask(0, T))[0, len(prompt) - 1:]
        torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-10)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_sampled_row_draws_the_same_whatever_the_rows_beside_it_do(seed):
    """The rows share one generator and a finished row leaves the batch, yet every row draws a
    token each step: a row's sampled answer is the same whichever row is beside it and whenever
    that row ends. Negative control: drawing only for the rows still answering fails this."""
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompt, *others = [torch.randint(2, 64, (5,), generator=g).tolist() for _ in range(3)]
    stops = set(range(2, 64, 4))  # a quarter of the tokens: rows end at many lengths
    rows = [answer_batch(model, [prompt, other], 16, Sampling(1.0), stops,
                         torch.Generator().manual_seed(seed)) for other in others]
    (first, (beside, _)), (second, (beside_too, _)) = rows
    # the test bites only where a row beside ends while the first row goes on
    assume(len(beside) != len(beside_too) and min(len(beside), len(beside_too)) < len(first[0]))
    assert first[0] == second[0]


def test_seed_prompts_are_many_diverse_and_deterministic():
    prompts = seed_prompts(0)
    assert len(prompts) >= 5000
    assert len({p["prompt"] for p in prompts}) == len(prompts)
    assert {p["category"] for p in prompts} == {"writing", "roleplay", "reasoning", "math",
                                                "coding", "extraction", "stem", "humanities",
                                                "chitchat"}
    assert seed_prompts(0) == prompts and seed_prompts(1) != prompts


def test_a_finished_run_may_grow_only_by_whole_batches_with_the_same_settings():
    meta = {"model": "m", "tokenizer": "t", "prompts": 128, "batch_size": 64, "seed": 0}
    assert same_settings(meta, meta)
    assert same_settings(meta, {**meta, "prompts": 4096})  # appends batches 2, 3, ...
    assert not same_settings(meta, {**meta, "prompts": 64})  # would drop a finished batch
    assert not same_settings({**meta, "prompts": 100}, {**meta, "prompts": 4096})  # short last
    assert not same_settings(meta, {**meta, "prompts": 4096, "seed": 1})
    assert same_settings(meta, {**meta, "samples": 1})  # older folders name no samples
    assert not same_settings(meta, {**meta, "samples": 2})
    # 96 prompts answered twice fill three whole batches of 64: the run may grow
    sampled = {**meta, "prompts": 96, "samples": 2}
    assert same_settings(sampled, {**sampled, "prompts": 128})


@pytest.mark.kernels
def test_model_written_prompts_are_finished_distinct_and_resume_to_the_same_turns(
        smollm2_packed, default_model_dir, tmp_path):
    if smollm2_packed.embed.weight.device.type != "cpu":
        return  # one device is enough: this checks the bookkeeping, not the model
    tokenizer = Tokenizer.from_folder(default_model_dir)
    write = lambda n, folder: model_written_prompts(smollm2_packed, tokenizer, n, folder, 4,  # noqa
                                                    0, lambda msg: None)
    (tmp_path / "once").mkdir(), (tmp_path / "resumed").mkdir()
    once = write(5, tmp_path / "once")  # two batches here (the first finishes 3 turns)
    # a run killed after its first batch leaves that batch's line (the file is replaced whole
    # after each batch, and a batch's turns depend only on its index: the seed + its number)
    batches = (tmp_path / "once" / "user_turns.jsonl").read_text().splitlines(keepends=True)
    assert len(batches) >= 2  # else the resume below would resume nothing
    first = batches[0]
    (tmp_path / "resumed" / "user_turns.jsonl").write_text(first)
    assert write(5, tmp_path / "resumed") == once  # ...resumed, it makes the same turns
    turns = [p["prompt"] for p in once]
    assert len(turns) == 5 == len(set(turns))
    assert all(len(t.split()) >= 3 and "<|im_end|>" not in t for t in turns)



"""Hydra++'s draft layer (experiments/draft_layer.py): a fresh one passes h_t through (a fresh
Hydra++ draft is a fresh Hydra draft); its cache equals a fresh prefill of the accepted
sequence after any steps; what it reads while decoding equals what training feeds it (teacher
forcing, an off-by-one in the answer's positions caught); decoding with it is lossless over
adapted trees with plain steps (over random trees: test_hydra.py's test, for both kinds); its
files hold the layer; train.py --kind hydra++ learns, with and without --distill."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train
from helpers import copycat_model, NODES, perturbed, perturbed_hydra_pp, tiny_model, trees
from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import Budget, fixed, nested_trees
from minimedusa.assembly.recipe import decoding_heads
from minimedusa.context_candidates import ContextDraft
from minimedusa.decoding import (medusa_decode, medusa_step, new_cache, plain_decode, prefill,
                                 root_step)
from minimedusa.draft import Candidates, TreeDraft, tree_tokens
from minimedusa.experiments.draft_layer import (HydraPlusPlusHeads, PlusPlusDraft, new_draft_cache,
                                                read_accepted, with_draft_layer)
from minimedusa.experiments.draft_layer_rows import ANSWERS_PER_BATCH, answer_rows, layer_features
from minimedusa.files.heads_files import load_heads, save_heads
from minimedusa.heads import HydraHeads
from minimedusa.model import causal_mask
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.training.medusa1 import read_answers
from minimedusa.tree import build_tree
from minimedusa.files.weights import load_model

VOCAB = 64


def flat(steps):
    return [t for step in steps for t in step.tokens]


def test_a_fresh_draft_layer_passes_the_hidden_states_through():
    model = tiny_model()
    heads = HydraPlusPlusHeads.for_model(model, 3)
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)  # (B, T, C)
    positions = torch.arange(5).expand(2, 5)
    out = heads.draft_layer(hidden, positions, causal_mask(0, 5).expand(2, 5, 5))
    torch.testing.assert_close(out, hidden, rtol=0, atol=0)
    hydra = HydraHeads.for_model(model, 3)
    tokens = torch.randint(0, VOCAB, (4, 3))
    torch.testing.assert_close(heads(hidden[0, :4], tokens, model.embed, model.lm_head),
                               hydra(hidden[0, :4], tokens, model.embed, model.lm_head))


@settings(max_examples=15, deadline=None)
@given(choices=trees(max_nodes=10, max_depth=3), seed=st.integers(0, 10_000),
       n_steps=st.integers(1, 6), plain_steps=st.lists(st.booleans(), min_size=6, max_size=6))
def test_the_draft_cache_equals_a_fresh_prefill_of_the_accepted_sequence(choices, seed, n_steps,
                                                                        plain_steps):
    """After a prefill and any mix of tree steps and plain steps, the draft layer's cache holds
    exactly what the layer computes from the accepted sequence's hidden states in one go, and
    its last output is that one-go output's last row."""
    model = copycat_model(seed, 4.0)
    heads = perturbed_hydra_pp(model, 3, seed, 0.1)
    tree = build_tree(choices, num_heads=3)
    prompt = [3, 1, 4, 1, 5]
    cache = new_cache(model, len(prompt), 6 * n_steps, margin=tree.size)
    draft_cache = new_draft_cache(heads, cache.capacity)
    logits, hidden = prefill(model, cache, torch.tensor([prompt]))
    features = read_accepted(heads, draft_cache, hidden)
    sequence = prompt + [logits[0].argmax().item()]
    for plain in plain_steps[:n_steps]:
        if plain:
            step, kept = root_step(model, cache, sequence[-1], greedy(), None)
        else:
            candidates = Candidates(tree, tree_tokens(heads, model, tree, sequence[-1], features),
                                    {})
            step, kept = medusa_step(model, candidates, cache, greedy(), None)
        features = read_accepted(heads, draft_cache, kept)
        sequence += step.tokens
    n = len(sequence) - 1  # both caches hold all but the newest token
    assert cache.length == draft_cache.length == n
    all_hidden = model.hidden_states(torch.tensor([sequence[:n]]), torch.arange(n)[None],
                                     causal_mask(0, n))  # (1, n, C)
    fresh = new_draft_cache(heads, n)
    expected = heads.draft_layer(all_hidden, torch.arange(n)[None], causal_mask(0, n), fresh,
                                 fresh.slots(0, n))
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(draft_cache.layers[0], name)[:, :, :n],
                                   getattr(fresh.layers[0], name), rtol=0, atol=1e-10)
    torch.testing.assert_close(features, expected[0, -1], rtol=0, atol=1e-10)


def test_decoding_reads_what_training_feeds_the_layer(tiny_setup):
    """The data's greedy answers, decoded again step by step: at every answer position the
    draft layer's output while decoding (its cache fed step by step) equals training's output
    for that answer (prompt states, then the stored rows, in one forward). An off-by-one in how
    training lays the answer after its prompt shifts every position and fails this."""
    model_dir, data = tiny_setup
    model = load_model(model_dir)  # float32, as training runs it
    heads = perturbed_hydra_pp(model, 3, 1, 0.2)
    answers = read_answers(data, tokenizer_fingerprint(model_dir), VOCAB)[:4]
    rows = answer_rows(model, answers, 3)
    trained = layer_features(heads.draft_layer, rows, torch.arange(len(answers)),
                             torch.device("cpu"))  # (M, C): the rows of the 4 answers
    decoded = []
    for prompt, answer, _ in answers:
        cache = new_cache(model, len(prompt), len(answer))
        draft = PlusPlusDraft(TreeDraft(heads, {}))
        draft.start(prompt.tolist(), cache)
        _, hidden = prefill(model, cache, prompt[None])
        decoded.append(draft.read(hidden))  # row 0: predicts answer[0]
        for token in answer[:-1].tolist():
            _, kept = root_step(model, cache, token, greedy(), None)
            decoded.append(draft.read(kept))  # row i: the state after answer[i - 1]
    # the stored rows are bfloat16, so the two agree to bfloat16's precision
    torch.testing.assert_close(trained, torch.stack(decoded), rtol=0.05, atol=0.05)
    shifted = torch.cat([trained[1:], trained[-1:]])
    assert not torch.allclose(shifted, torch.stack(decoded), rtol=0.05, atol=0.05)


def test_a_training_step_reads_the_answers_of_its_rows_whole(tiny_setup):
    """A step's rows come from at most ANSWERS_PER_BATCH answers, and the layer's output at
    them is its output over their answers whole, picked at those rows."""
    model_dir, data = tiny_setup
    model = load_model(model_dir)
    layer = perturbed_hydra_pp(model, 3, 2, 0.2).draft_layer
    rows = answer_rows(model, read_answers(data, tokenizer_fingerprint(model_dir), VOCAB), 3)
    index = rows.sample_rows(step=3, batch_size=40, seed=0)
    assert len(index) == 40 and (index[1:] > index[:-1]).all()
    assert len((torch.searchsorted(rows.offsets, index, right=True) - 1).unique()) \
        <= ANSWERS_PER_BATCH
    every = layer_features(layer, rows, torch.arange(len(rows)), torch.device("cpu"))
    torch.testing.assert_close(rows.features_at(layer, index, torch.device("cpu")), every[index])


def test_hydra_pp_heads_save_and_load_with_their_draft_layer(tmp_path):
    model = tiny_model()
    heads = perturbed_hydra_pp(model, 3, 0, 0.1)
    save_heads(heads, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_kind"] == "hydra++"
    loaded = load_heads(tmp_path, model)
    assert isinstance(loaded, HydraPlusPlusHeads)
    assert heads.state_dict().keys() == loaded.state_dict().keys()
    for name, theirs in loaded.state_dict().items():  # loading goes through float32
        torch.testing.assert_close(heads.state_dict()[name], theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("distill", [False, True])
def test_train_frozen_hydra_pp_learns(tiny_setup, tmp_path, distill):
    model_dir, data = tiny_setup
    train.main(["--frozen", "--kind", "hydra++", "--model", str(model_dir), "--data", str(data),
                "--out", str(tmp_path), "--batch-size", "64", "--heads", "3", "--warmup", "2",
                "--eval-every", "4", "--lr", "3e-3", "--epochs", "6"]
               + (["--distill"] if distill else []))
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log[-1]["loss"][0] < log[0]["loss"][0]  # held-out CE of head 1
    assert isinstance(decoding_heads(str(tmp_path), load_model(model_dir)),  # as generate.py
                      HydraPlusPlusHeads)
    heads = load_heads(tmp_path, load_model(model_dir))  # float32, unpacked
    assert heads.draft_layer.block.mlp.down.weight.abs().sum() > 0  # the layer learned


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), context=st.booleans())
def test_hydra_pp_adapted_trees_with_plain_steps_stay_lossless(seed, context):
    """generate.py's default loop: the budget mixes plain steps (size 0) and trees of 4 and 8,
    each feeding the draft layer its kept positions; greedy output is plain greedy's."""
    model = copycat_model(seed, 4.0)
    heads = perturbed_hydra_pp(model, 4, seed, 0.1)
    trees, rank = nested_trees(NODES[:8], [4, 8], 4, model.config.vocab_size, "cpu")
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3]
    budget = Budget([0, 4, 8], {4: 2.0, 8: 2.4}, {0: 1.0, 4: 1.2, 8: 1.5})
    draft = PlusPlusDraft(TreeDraft(heads, trees, rank))
    out = medusa_decode(model, ContextDraft(draft) if context else draft, budget, greedy(),
                        prompt, 40, set())
    assert flat(out) == flat(plain_decode(model, prompt, 40, Sampling(), set()))


def test_trained_hydra_heads_behind_a_fresh_layer_draft_as_before():
    """train.py --kind hydra++ --init-heads HYDRA: the heads start where they were."""
    model = tiny_model(5)
    hydra = perturbed(HydraHeads.for_model(model, 3), 5, 0.2)
    heads = with_draft_layer(hydra, model)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]], num_heads=3)
    prompt = [4, 8, 15, 16]
    draft, budget = fixed(heads, tree)
    assert flat(medusa_decode(model, PlusPlusDraft(draft), budget, greedy(), prompt, 30,
                              set())) == flat(plain_decode(model, prompt, 30, Sampling(), set()))
    cache = new_cache(model, len(prompt), 1)
    reader = PlusPlusDraft(draft)
    reader.start(prompt, cache)
    _, hidden = prefill(model, cache, torch.tensor([prompt]))
    features = reader.read(hidden)
    torch.testing.assert_close(tree_tokens(heads, model, tree, 9, features),
                               tree_tokens(hydra, model, tree, 9, hidden[-1]), rtol=0, atol=0)

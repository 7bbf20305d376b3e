"""Hydra heads (heads.HydraHeads): a fresh Hydra head is a fresh Medusa head; training feeds head k
the answer up to the token before its target, which is what drafting feeds it; decoding with
them is lossless over random trees (greedy == plain greedy, also with a draft vocabulary); their
files name their kind; they learn."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train
from helpers import copycat_model, DEVICES, perturbed, perturbed_hydra, tiny_model, trees
from minimedusa.budget import fixed
from minimedusa.acceptance import Sampling, greedy
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import tree_tokens
from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads, hydra_candidates
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads, PlusPlusDraft
from minimedusa.training.self_distill import tokenizer_fingerprint
from minimedusa.assembly.recipe import decoding_heads
from minimedusa.speed.defaults import CPU_DRAFT_VOCAB, cpu_draft_vocab
from minimedusa.training.medusa1 import IGNORE, draft_columns, head_inputs, head_targets, read_rows
from minimedusa.tree import build_tree
from minimedusa.files.export_v1 import export_v1
from minimedusa.files.heads_files import HeadsError, load_heads, read_draft_vocab, save_heads
from minimedusa.files.weights import load_model

VOCAB = 64


def flat(steps):
    return [t for step in steps for t in step.tokens]


def test_fresh_hydra_heads_guess_what_fresh_shared_medusa_heads_guess():
    model = tiny_model()
    hydra = HydraHeads.for_model(model, num_heads=3, num_layers=2)
    medusa = MedusaHeads.for_model(model, num_heads=3, num_layers=2, shared_lm_head=True)
    hidden = torch.randn(5, 32, dtype=torch.float64)  # (B, C)
    tokens = torch.randint(0, VOCAB, (5, 3))  # (B, K)
    torch.testing.assert_close(hydra(hidden, tokens, model.embed, model.lm_head),
                               medusa(hidden, model.lm_head))


def test_head_k_reads_the_answer_up_to_the_token_before_its_target():
    answer = torch.tensor([10, 11, 12, 13])
    inputs, targets = head_inputs(answer, 2), head_targets(answer, 2)
    assert inputs.tolist() == [[10, 11], [11, 12], [12, 13], [13, 0]]
    # head k's last input is exactly the token before its target, wherever there is a target
    for k in range(1, 3):
        has = targets[:, k - 1] != IGNORE
        assert torch.equal(answer[torch.arange(4)[has] + k - 1], inputs[has, k - 1])
        assert torch.equal(answer[torch.arange(4)[has] + k], targets[has, k - 1])


def test_rows_give_each_position_its_root_token_first(tiny_setup):
    """Row i's hidden state predicted answer[i] with the LM head: that token is the root a Hydra
    head reads first. An off-by-one in the inputs breaks the first assert, one in the targets
    (against the inputs) the second."""
    model_dir, data = tiny_setup
    rows, _ = read_rows(data, 3, tokenizer_fingerprint(model_dir), VOCAB)
    predicted = rows.targets[:, 0]  # answer[i + 1]: the token after row i's root
    first_rows = rows.tokens[1:, 0]  # the next row's root: the same answer[i + 1] inside one answer
    inside = predicted[:-1] != IGNORE
    assert torch.equal(first_rows[inside], predicted[:-1][inside])
    for k in range(1, 3):
        has = rows.targets[:, k - 1] != IGNORE
        assert torch.equal(rows.tokens[has, k], rows.targets[has, k - 1])


def test_drafting_a_path_computes_the_teacher_forced_guesses():
    """Along a chain tree, the draft's token at depth k is head k's top-1 when it reads the
    draft's own tokens before it, which is what training computes with those tokens."""
    model = tiny_model(3)
    heads = perturbed_hydra(model, 3, 3, 0.3)
    hidden = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tree = build_tree([[0], [0, 0], [0, 0, 0]], num_heads=3)
    tokens = hydra_candidates(heads, model, hidden, torch.tensor(7), tree)  # (4,): root, chain
    forced = heads(hidden[None], tokens[None, :3], model.embed, model.lm_head)  # (3, 1, V)
    assert tokens[0] == 7
    assert forced[:, 0].argmax(-1).tolist() == tokens[1:].tolist()


def test_siblings_hold_the_best_guesses_at_their_parent():
    model = tiny_model(4)
    heads = perturbed_hydra(model, 2, 4, 0.3)
    hidden = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0]], num_heads=2)
    tokens = hydra_candidates(heads, model, hidden, torch.tensor(5), tree)
    index = {p: i for i, p in enumerate(tree.nodes)}
    for parent in [(0,), (1,)]:
        path = torch.tensor([[5, tokens[index[parent]].item()]])
        top = heads.head(2, hidden, path, model.embed, model.lm_head)[0].topk(2).indices
        for r in range(2):
            if parent + (r,) in index:
                assert tokens[index[parent + (r,)]] == top[r]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [HydraHeads, HydraPlusPlusHeads], ids=["hydra", "hydra++"])
@settings(max_examples=20, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=4), seed=st.integers(0, 10_000),
       scale=st.sampled_from([0.0, 0.05, 0.5]), repetitive=st.sampled_from([None, 4.0, 10.0]),
       prompt_len=st.integers(1, 8), max_new=st.integers(1, 30))
def test_hydra_greedy_equals_plain_greedy(device, kind, choices, seed, scale, repetitive,
                                          prompt_len, max_new):
    model = (tiny_model(seed, device=device) if repetitive is None
             else copycat_model(seed, repetitive, device=device))
    heads = perturbed(kind.for_model(model, 4), seed, scale)  # a Hydra++ layer's too
    tree = build_tree(choices, num_heads=4, device=device)
    prompt = torch.randint(0, VOCAB, (prompt_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    stop = {int(seed % VOCAB)}
    plain = flat(plain_decode(model, prompt, max_new, Sampling(), stop))
    draft, budget = fixed(heads, tree)
    draft = PlusPlusDraft(draft) if kind is HydraPlusPlusHeads else draft  # through its layer
    assert flat(medusa_decode(model, draft, budget, greedy(), prompt, max_new, stop)) == plain


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@settings(max_examples=10, deadline=None)
@given(choices=trees(max_nodes=12, max_depth=3), seed=st.integers(0, 10_000),
       size=st.integers(1, VOCAB))
def test_a_draft_vocabulary_restricts_the_guesses_never_the_output(kind, choices, seed, size):
    model = copycat_model(seed, 4.0)
    heads = (perturbed_hydra(model, 3, seed, 0.05) if kind == "hydra" else
             MedusaHeads.for_model(model, 3, shared_lm_head=True).eval().requires_grad_(False))
    tree = build_tree(choices, num_heads=3)
    size = max(size, tree.top_k)  # a draft vocabulary ranks at least the tree's top-k
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:size]
    heads.vocabulary = DraftVocabulary(ids, model.lm_head)
    hidden = torch.randn(32, dtype=torch.float64)
    guessed = tree_tokens(heads, model, tree, 1, hidden)[1:]
    assert torch.isin(guessed, ids).all()
    prompt = [3, 9, 27]
    assert flat(medusa_decode(model, *fixed(heads, tree), greedy(), prompt, 25, set())) == \
        flat(plain_decode(model, prompt, 25, Sampling(), set()))


def test_hydra_heads_save_and_load_as_their_kind(tmp_path):
    model = tiny_model()
    heads = perturbed_hydra(model, 3, 0, 0.1)
    save_heads(heads, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_kind"] == "hydra"
    loaded = load_heads(tmp_path, model)
    assert isinstance(loaded, HydraHeads)
    hidden, tokens = torch.randn(4, 32, dtype=torch.float64), torch.randint(0, VOCAB, (4, 3))
    torch.testing.assert_close(loaded(hidden, tokens, model.embed, model.lm_head),
                               heads(hidden, tokens, model.embed, model.lm_head))
    with pytest.raises(HeadsError, match="hydra heads have no V1 layout"):
        export_v1(loaded, model.lm_head, tmp_path / "v1", "tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_kind": "eagle"}))
    with pytest.raises(HeadsError, match="unknown head_kind 'eagle'"):
        load_heads(tmp_path, model)


@pytest.mark.parametrize("draft_vocab", [0, 24])
def test_train_frozen_hydra_learns_and_saves_its_draft_vocabulary(tiny_setup, tmp_path,
                                                                  draft_vocab):
    model_dir, data = tiny_setup
    train.main(["--frozen", "--kind", "hydra", "--model", str(model_dir), "--data", str(data),
                "--out", str(tmp_path), "--batch-size", "32", "--heads", "3", "--warmup", "2",
                "--eval-every", "5", "--lr", "3e-3", "--epochs", "2",
                "--draft-vocab", str(draft_vocab)])
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    model = load_model(model_dir)
    heads = decoding_heads(str(tmp_path), model)  # as generate.py loads them
    assert isinstance(heads, HydraHeads)
    learned = load_heads(tmp_path, model)  # float32, unpacked (a packed layer lets its go)
    assert any(h.read.weight.abs().sum() > 0 for h in learned.heads)  # the token part learned
    ids, counts = read_draft_vocab(tmp_path, model.config.vocab_size)
    rows, _ = read_rows(data, 3, tokenizer_fingerprint(model_dir), VOCAB)
    assert counts.sum() == rows.tokens.shape[0] and (counts[:-1] >= counts[1:]).all()
    if draft_vocab:  # the config makes the trained-with vocabulary the decoding default
        assert torch.equal(heads.vocabulary.ids, ids[:draft_vocab].sort().values)
    else:
        assert heads.vocabulary is None


def test_a_cpu_ranks_at_most_cpu_draft_vocab_tokens_by_default():
    """On a CPU the heads' own draft vocabulary is cut to CPU_DRAFT_VOCAB (none stays none);
    elsewhere (here a meta-device stand-in for a GPU) it is kept."""
    cpu, other = torch.device("cpu"), torch.device("meta")
    assert cpu_draft_vocab(8192, cpu) == CPU_DRAFT_VOCAB and cpu_draft_vocab(24, cpu) == 24
    assert cpu_draft_vocab(0, cpu) == 0 and cpu_draft_vocab(8192, other) == 8192


def test_draft_columns_map_tokens_outside_the_vocabulary_to_no_target():
    model = tiny_model()
    vocabulary = DraftVocabulary(torch.tensor([3, 7, 50]), model.lm_head)
    targets = torch.tensor([[7, IGNORE], [50, 4], [3, 7]])
    assert draft_columns(targets, vocabulary).tolist() == [[1, IGNORE], [2, IGNORE], [0, 1]]

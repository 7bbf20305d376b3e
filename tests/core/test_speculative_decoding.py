"""Speculative decoding with a draft model (speculative_decoding.py), a draft of the one loop
(decoding.medusa_decode), is lossless: greedy, the target's plain greedy tokens exactly, with
drafts kept and rejected (random tiny models, the draft a perturbed copy of the target, over k,
prompts and the Budget's changes of k; and the real default model, float32 verifying its own
int4 rounding, on the fixture's chats); sampling, the target's exact law (a chi-square on a
Markov chain through the loop's verifier, speculative_sampling.verify_drawn, and end to end on a
tiny model). Negative controls: a draft kept where the target disagreed, a draft whose cache is
not cut to the text, a rejection that draws from p instead of the residual: each fails here."""
import json
import math
import shutil
from collections import Counter
from itertools import product

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import goodness_of_fit, model_folder, perturbed, tiny_model
from generate import main as generate_main
from dataclasses import replace

from minimedusa.acceptance import Acceptance, Sampling, Verdict, greedy, probabilities
from minimedusa.budget import Budget, FixedSize
from minimedusa.assembly.recipe import Recipe, build, decoding_model, draft_model
from minimedusa.context_candidates import merged_tree
from minimedusa.files.default_model import DEFAULT_HEADS_DIR
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import TreeDraft
from minimedusa.heads import MedusaHeads
from minimedusa.speculative_decoding import (DraftModelWithHeads, ModelDraft, chain_paths,
                                             chain_proposal)
from minimedusa.speculative_sampling import speculative, verify_drawn
from minimedusa.speed.weight_formats import format_named
from minimedusa.tree import build_tree

ALPHA = 1e-4


def draft_of(target, scale: float, seed: int):
    """A copy of the target with every weight perturbed: its drafts right often, not always."""
    draft = tiny_model(seed=0, vocab_size=target.config.vocab_size)
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return draft


def tokens_of(steps) -> list[int]:
    return [t for step in steps for t in step.tokens]


def rule_of(sampling: Sampling) -> Acceptance:
    """The loop's acceptance for a draft model's chains: greedy, or speculative sampling."""
    if sampling.greedy:
        return greedy()
    return speculative(sampling.temperature, sampling.top_p, sampling.seed)


def speculative_tokens(target, draft, budget, prompt, n, sampling=Sampling(), rule=None):
    proposer = ModelDraft(draft, sampling.temperature, sampling.top_p, sampling.seed)
    steps = list(medusa_decode(target, proposer, budget, rule or rule_of(sampling), prompt, n,
                               set()))
    return tokens_of(steps), proposer


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 6),
       prompt=st.lists(st.integers(2, 63), min_size=1, max_size=12))
def test_greedy_is_the_targets_plain_greedy_for_any_draft_and_k(seed, k, prompt):
    target = tiny_model(seed)
    draft = draft_of(target, 0.05, seed)
    got, proposer = speculative_tokens(target, draft, FixedSize(k), prompt, 30)
    assert got == tokens_of(plain_decode(target, prompt, 30, Sampling(), set()))
    assert proposer.proposed > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_draft_decoding_with_its_heads_drafts_the_targets_greedy_text(seed):
    """Medusa inside the draft (DraftModelWithHeads: medusa_decode on the draft's cache each
    round, several drafts a forward where its heads guess right): the target's plain greedy
    text."""
    target = tiny_model(seed)
    draft = draft_of(target, 0.02, seed)
    heads = perturbed(MedusaHeads.for_model(draft, 3, shared_lm_head=True), seed, 0.01)
    tree = build_tree([[0], [0, 0], [1], [0, 0, 0]], 3)
    proposer = DraftModelWithHeads(draft, TreeDraft(heads, {4: tree}), FixedSize(4), greedy())
    steps = list(medusa_decode(target, proposer, FixedSize(6), greedy(), [5, 9, 11], 60, set()))
    assert tokens_of(steps) == tokens_of(plain_decode(target, [5, 9, 11], 60, Sampling(),
                                                       set()))
    assert 0 < proposer.kept <= proposer.proposed


def test_drafts_are_kept_and_rejected_and_the_budget_moves_k():
    """On a draft that is right most of the time: both outcomes happen, and a Budget's k
    changes from round to round (each round timed as one second: the budget's clock counts)."""
    target = tiny_model(3)
    draft = draft_of(target, 0.02, 3)
    sizes = (0, 1, 2, 4, 8)
    budget = Budget(sizes, {k: 1 + 0.8 * k for k in sizes if k}, {k: 1.0 for k in sizes},
                    clock=iter(range(10**6)).__next__)
    got, proposer = speculative_tokens(target, draft, budget, [5, 9, 11], 120)
    assert got == tokens_of(plain_decode(target, [5, 9, 11], 120, Sampling(), set()))
    assert 0 < proposer.kept < proposer.proposed
    assert len([k for k, used in budget.used.items() if used]) >= 2


def test_a_perfect_draft_is_kept_whole():
    """The target drafting for itself: every draft kept, the text the target's."""
    target = tiny_model(5)
    got, proposer = speculative_tokens(target, target, FixedSize(4), [7, 8], 60)
    assert proposer.kept == proposer.proposed > 0
    assert got == tokens_of(plain_decode(target, [7, 8], 60, Sampling(), set()))


def test_a_draft_whose_cache_is_not_cut_to_the_text_cannot_run(monkeypatch):
    """The negative control of the cut: a draft that keeps its rejected drafts cached holds
    more than the text after the first rejection, and has nothing left to feed."""
    target = tiny_model(3)
    draft = draft_of(target, 0.02, 3)
    monkeypatch.setattr(ModelDraft, "forget_rejected", lambda self: None)
    with pytest.raises(RuntimeError):
        speculative_tokens(target, draft, FixedSize(4), [5, 9, 11], 120)


def test_a_draft_kept_where_the_target_disagreed_is_caught():
    """The negative control of the greedy test: keeping one draft too many changes the text."""
    exact = greedy()

    def one_too_many(logits, candidates, generator):
        verdict = exact.accept(logits, candidates, generator)
        nodes, new, chain = verdict.kept, verdict.tokens, candidates.tokens.tolist()
        if len(nodes) < len(chain):  # the next draft too, then the argmax after it
            nodes = nodes + [len(nodes)]
            new = new[:-1] + [chain[nodes[-1]], int(logits[nodes[-1]].argmax())]
        return Verdict(nodes, new, verdict.numbers)
    rule = Acceptance("greedy, one too many", one_too_many, exact.first)
    target = tiny_model(3)
    got, _ = speculative_tokens(target, draft_of(target, 0.05, 3), FixedSize(4), [5, 9], 60,
                                rule=rule)
    assert got != tokens_of(plain_decode(target, [5, 9], 60, Sampling(), set()))


# --- sampling: the target's exact law -------------------------------------------------------

V, M = 4, 3  # a Markov chain's vocabulary; tokens in a sampled sequence
N_SAMPLES = 20_000


def chain_kept(rows: torch.Tensor, drafted: list[int], laws: torch.Tensor, g) -> tuple[int, int]:
    """The one loop's verifier on the chain as ModelDraft hands it (its tree, its Proposal):
    (drafts kept, the closing token); rows (k + 1, V) the target's p along the chain."""
    tree = merged_tree(chain_paths(len(drafted)), torch.device("cpu"))
    verdict = verify_drawn(lambda node: rows[node], tree, torch.tensor([0, *drafted]),
                           chain_proposal(drafted, list(laws)), g)
    return len(verdict.kept) - 1, verdict.tokens[-1]


def chain_sample(p_table, q_table, k: int, n: int, seed: int, keep=chain_kept) -> Counter:
    """n sequences of M tokens after token 0, each from rounds of k drafts drawn from the q
    chain and kept or replaced by `keep` against the p chain (rows: the next token's law)."""
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        sequence = [0]
        while len(sequence) <= M:
            drafted, laws = [], []
            for _ in range(k):
                laws.append(q_table[(drafted or sequence)[-1]])
                drafted.append(int(torch.multinomial(laws[-1], 1, generator=g)))
            rows = torch.stack([p_table[t] for t in [sequence[-1], *drafted]])  # (k + 1, V)
            kept, last = keep(rows, drafted, torch.stack(laws), g)
            sequence += drafted[:kept] + [last]
        counts[tuple(sequence[1:M + 1])] += 1
    return counts


def chain_law(p_table) -> dict[tuple, float]:
    law = {}
    for sequence in product(range(V), repeat=M):
        law[sequence] = math.prod(p_table[a, b].item() for a, b in zip((0, *sequence), sequence))
    return law


def tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(V, V, generator=g, dtype=torch.float64)
    p = probabilities(logits, 0.7, 1.0)
    q = probabilities(logits + 1.5 * torch.randn(V, V, generator=g, dtype=torch.float64), 0.7,
                      1.0)
    return p, q


@pytest.mark.parametrize("k", [3])
def test_speculative_sampling_of_a_chain_emits_the_targets_exact_law(k):
    """Power: 20,000 sequences over 64 outcomes: a total variation of 0.035 is caught with
    probability > 0.99 (test_rejection_exact.py's computation)."""
    p, q = tables(k)
    assert goodness_of_fit(chain_sample(p, q, k, N_SAMPLES, k), chain_law(p)) > ALPHA


def test_a_rejection_that_draws_from_p_instead_of_the_residual_fails_the_law():
    def from_p(rows, drafted, laws, g):
        for i, token in enumerate(drafted):
            if torch.rand((), generator=g) * laws[i, token] >= rows[i, token]:
                return i, int(torch.multinomial(rows[i], 1, generator=g))
        return len(drafted), int(torch.multinomial(rows[-1], 1, generator=g))
    p, q = tables(1)
    assert goodness_of_fit(chain_sample(p, q, 1, 8_000, 1, from_p), chain_law(p)) < ALPHA


@pytest.mark.slow  # the law by default: the chain's above; through the loop, in CI
def test_sampling_end_to_end_follows_plain_samplings_law():
    """A tiny model of 4 tokens, 2 new tokens after a fixed prompt, 2,000 runs:
    speculative sampling with a perturbed draft against plain sampling's exact law (its
    probabilities of all 16 continuations, from the target's forwards). Power: the chain test's
    computation at n = 2,000 and 15 degrees of freedom: a total variation of about 0.1."""
    target = tiny_model(2, vocab_size=4)
    draft = draft_of(target, 0.3, 2)
    prompt, T = [1, 2, 3], 0.8
    law = {}
    for a, b in product(range(4), repeat=2):
        with torch.inference_mode():
            logits, _ = target(torch.tensor([[*prompt, a]]), torch.arange(4)[None],
                               torch.ones(1, 4, 4, dtype=torch.bool).tril())
        p = probabilities(logits[0].float(), T, 1.0)
        law[(a, b)] = p[2, a].item() * p[3, b].item()
    counts = Counter()
    for seed in range(2_000):
        got, _ = speculative_tokens(target, draft, FixedSize(2), prompt, 2,
                                    Sampling(temperature=T, seed=seed))
        counts[tuple(got)] += 1
    assert goodness_of_fit(counts, law) > ALPHA


# --- the real default model: float32 verifying its own int4 rounding -----------------------

@pytest.mark.slow  # the loop's greedy law on tiny models above; this, the real model's, in CI
@pytest.mark.kernels
def test_float32_drafted_by_its_int4_rounding_writes_float32_greedy_text(default_model_dir,
                                                                         reference):
    """Two fixture chats, 32 tokens each, one drafted plainly, one by the draft decoding with
    the shipped heads (as generate.py --draft int4 does): the float32 model's plain greedy
    tokens exactly, and most drafts kept (the system prompt's chat, of near-ties, fewest: a
    draft cache rewound wrong keeps few, its drafts following text the target never wrote)."""
    recipe = Recipe(folder=default_model_dir, device=torch.device("cpu"),
                    weight_format=format_named("float32"), compile=False, draft_model="int4")
    target, _ = decoding_model(recipe)
    drafter, _ = draft_model(recipe)  # fused
    decodings = [build(recipe, target, drafter=drafter),  # as generate.py's, with its heads
                 build(replace(recipe, draft_model_heads=str(DEFAULT_HEADS_DIR)), target,
                       drafter=drafter)]
    for decoding, case in zip(decodings, reference["greedy"]["cases"][::2]):
        prompt = case["prompt_ids"]
        got = tokens_of(decoding.decode(prompt, 32, set()))
        assert got == tokens_of(plain_decode(target, prompt, 32, Sampling(), set()))
        assert isinstance(decoding.draft, DraftModelWithHeads) == (decoding is decodings[1])
        assert decoding.draft.kept > 0.6 * decoding.draft.proposed > 0  # 77-96% where measured


# --- generate.py --draft ----------------------------------------------------------------------

@pytest.fixture
def tiny_folder(tmp_path, default_model_dir):
    """A tiny random Llama with the real tokenizer (sizes a multiple of int8's groups)."""
    return model_folder(tmp_path / "tiny", default_model_dir, 64)


def test_generate_with_a_draft_writes_the_baselines_text_and_says_what_it_kept(tiny_folder,
                                                                               capsys):
    flags = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "24",
             "--no-compile", "--json"]
    generate_main(flags + ["--draft", "int8"])
    out, err = capsys.readouterr()
    drafted = json.loads(out)
    generate_main(flags + ["--baseline", "--dtype", "float32"])
    plain = json.loads(capsys.readouterr()[0])
    assert drafted["output_ids"] == plain["output_ids"] and drafted["format"] == "float32"
    assert "speculative decoding, drafts by the int8 model" in drafted["mode"]
    assert "drafts kept: " in drafted["mode"]


@pytest.mark.parametrize("flags, needle", [
    (["--draft", "int5"], "neither a weight format"),
    (["--draft", "int4", "--quantize", "int4"], "--quantize int4 would round the verifier"),
    (["--draft", "int8", "--chat"], "not a chat"),
])
def test_a_draft_that_cannot_run_is_one_line(tiny_folder, flags, needle, capsys):
    with pytest.raises(SystemExit) as end:
        generate_main(["--model", str(tiny_folder), "--prompt", "Hi", "--no-compile", *flags]
                      if "--chat" not in flags else
                      ["--model", str(tiny_folder), "--no-compile", *flags])
    said = str(end.value.code) + capsys.readouterr().err
    assert needle in said and "Traceback" not in said


def test_a_draft_folder_with_another_tokenizer_is_one_line(tiny_folder, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(tiny_folder, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    ids = tokenizer["model"]["vocab"]  # two tokens' ids swapped: another model's numbering
    ids["the"], ids["and"] = ids["and"], ids["the"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SystemExit) as end:
        generate_main(["--model", str(tiny_folder), "--prompt", "Hi", "--no-compile",
                       "--draft", str(other)])
    assert "is not the target's" in str(end.value.code)


@pytest.mark.kernels
def test_a_draft_folder_with_the_targets_tokenizer_drafts(tiny_folder, tmp_path, capsys):
    """--draft DIR: another model folder of the same tokenizer (here the model itself, copied,
    in its machine's default format) drafts for the target."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    flags = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "24",
             "--no-compile", "--json"]
    generate_main(flags + ["--draft", str(copy)])
    drafted = json.loads(capsys.readouterr()[0])
    generate_main(flags + ["--baseline", "--dtype", "float32"])
    assert drafted["output_ids"] == json.loads(capsys.readouterr()[0])["output_ids"]
    kept, proposed = drafted["mode"].split("drafts kept: ")[1].split(")")[0].split("/")
    assert int(kept) > int(proposed) / 2  # in the folder's own default format (bfloat16 here)

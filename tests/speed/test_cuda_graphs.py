"""The decoding step in CUDA graphs (speed/cuda_graphs.py) against the eager step: the same
logits for a plain step and a tree of every size, so Medusa greedy in graphs == plain greedy,
after cache compaction, across prompts whose caches take turns in the static one, across a
chat's turns in one cache, and when a longer run grows the static cache.
On a CPU nothing is captured (capture() runs the function): these check the static discipline
(inputs copied into fixed buffers, attention over the whole static cache, caches held and given
back); on CUDA they check the graphs themselves, in bfloat16."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import cached_keys_values, cycling_heads, cycling_model, DEVICES, trees
from minimedusa.acceptance import Sampling, greedy
from minimedusa.batch_decoding import batch_decode
from minimedusa.experiments.batch_medusa import BatchMedusa, batch_medusa_decode
from minimedusa.budget import fixed
from minimedusa.decoding import (decode_step, medusa_decode, new_cache, plain_decode, prefill,
                                 tree_forward)
from minimedusa.draft import TreeDraft
from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, LlamaConfig
from minimedusa.speed.cuda_graphs import MAX_ROWS, GraphedBlocks, graph_step, is_graphed
from minimedusa.speed.graphed_draft import GraphedDraft
from minimedusa.speed.plug_in import eager_step
from minimedusa.tree import build_tree

DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


def twins(device, seed=3):
    """(graphed, eager): the same cycling model twice, one with its blocks in graphs."""
    graphed, eager = (cycling_model(seed, dtype=DTYPES[device], device=device) for _ in range(2))
    graph_step(graphed, compiled=False)
    return graphed, eager


@pytest.fixture(scope="module", params=DEVICES)
def pair(request):
    return twins(request.param)


def flat(steps):
    return [t for step in steps for t in step.tokens]


def test_graph_step_swaps_the_blocks_and_captures_a_plain_step_and_the_budgets_sizes(pair):
    graphed, eager = pair
    assert is_graphed(graphed) and not is_graphed(eager)
    assert {(1, T, 1) for T in (1, 2, 3, 5, 9, 17, 33, 65)} <= set(graphed.layers.graphs)
    assert graphed.state_dict().keys() == eager.state_dict().keys()


@settings(max_examples=20, deadline=None)
@given(choices=trees(max_nodes=64, max_depth=4), seed=st.integers(0, 1000),
       prompt_len=st.integers(1, 40))
def test_graphed_steps_give_the_eager_logits(pair, choices, seed, prompt_len):
    """A plain step and a tree step from the same prompt: the same logits to the bit."""
    graphed, eager = pair
    device = graphed.embed.weight.device
    tree = build_tree(choices, device=device)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 64, (1, prompt_len), generator=g).to(device)
    tokens = torch.randint(0, 64, (tree.size,), generator=g).to(device)
    for step in (lambda m, c: decode_step(m, c, tokens[:1].view(1, 1))[0],
                 lambda m, c: tree_forward(m, c, tree, tokens)[0]):
        logits = []
        for model in (graphed, graphed, eager):  # a row count is graphed when asked again
            cache = new_cache(model, prompt_len, 8, margin=tree.size)
            prefill(model, cache, prompt)
            logits.append(step(model, cache))
        assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])
    assert (1, tree.size, 1) in graphed.layers.graphs


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@settings(max_examples=8, deadline=None)
@given(choices=trees(max_nodes=64, max_depth=4), seed=st.integers(0, 1000))
def test_graphed_medusa_greedy_equals_eager_plain_greedy(pair, kind, choices, seed):
    """With the draft in graphs too (GraphedDraft): every tree size, compaction included."""
    graphed, eager = pair
    device = graphed.embed.weight.device
    heads = cycling_heads(graphed, kind, seed)
    tree = build_tree(choices, num_heads=4, device=device)
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    draft, budget = fixed(heads, tree)
    steps = list(medusa_decode(graphed, GraphedDraft(heads, draft.trees), budget, greedy(),
                               prompt, 40, set()))
    assert flat(steps) == flat(plain_decode(eager, prompt, 40, Sampling(), set()))


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_compaction_through_the_graph_leaves_the_eager_runs_cache(pair, kind):
    """The held cache's compaction (one graph for every layer) keeps what the eager loop keeps:
    every entry, bit for bit (the cycling model's tokens hardly depend on them)."""
    entries = []
    for model in pair:
        heads = cycling_heads(model, kind, 2)
        tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]], num_heads=4,
                          device=model.embed.weight.device)
        draft, budget = fixed(heads, tree)
        cache = KVCache.for_model(model, 64)
        flat(medusa_decode(model, GraphedDraft(heads, draft.trees), budget, greedy(), [5, 6, 7],
                           40, set(), cache))
        entries.append(cached_keys_values(cache, cache.length))
    assert all(torch.equal(a, b) for a, b in zip(*entries))


def test_the_lossless_test_sees_candidates_accepted(pair):
    graphed, _ = pair
    heads = cycling_heads(graphed, "hydra", 0)
    tree = build_tree([[0], [0, 0], [0, 0, 0], [1]], num_heads=4,
                      device=graphed.embed.weight.device)
    draft, budget = fixed(heads, tree)
    steps = list(medusa_decode(graphed, GraphedDraft(heads, draft.trees), budget, greedy(),
                               [5, 6, 7], 40, set()))
    assert len(flat(steps)) / len(steps) > 1.5


def test_caches_taking_turns_in_the_static_cache_keep_their_entries(pair):
    """Two runs interleaved step by step: each step holds its cache, giving the other's back."""
    graphed, eager = pair
    runs = [plain_decode(graphed, prompt, 30, Sampling(), set()) for prompt in ([1, 2, 3],
                                                                                 [9, 8, 7, 6])]
    interleaved = [[], []]
    for a, b in zip(*runs):
        interleaved[0] += a.tokens
        interleaved[1] += b.tokens
    assert interleaved == [flat(plain_decode(eager, p, 30, Sampling(), set()))
                           for p in ([1, 2, 3], [9, 8, 7, 6])]


def test_a_longer_run_grows_the_static_cache_and_keeps_the_eager_answer():
    graphed, eager = twins(DEVICES[-1], seed=5)
    slots = graphed.layers.statics[1].slots
    prompt, new = list(range(2, 60)), slots - 58  # prompt + new tokens + MAX_ROWS > slots
    assert flat(plain_decode(graphed, prompt, new, Sampling(), set())) == \
        flat(plain_decode(eager, prompt, new, Sampling(), set()))
    assert graphed.layers.statics[1].slots >= len(prompt) + new + MAX_ROWS > slots


def test_a_chats_turns_continue_in_the_held_cache(pair):
    """A conversation's cache kept from turn to turn (cli/chat.py), the second turn's prompt
    longer than a graph's rows (prefilled eagerly), as in the eager model."""
    answers = []
    for model in pair:
        cache = KVCache.for_model(model, 200)
        history = [4, 5, 6]
        for added in ([], [10 + i % 50 for i in range(MAX_ROWS + 5)]):
            history += added
            answer = flat(plain_decode(model, history, 20, Sampling(), set(), cache))
            history += answer[:-1]  # the last token is not in the cache yet
            answers.append(answer)
    assert answers[:2] == answers[2:]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), n=st.integers(2, 9), batch=st.integers(2, 6))
def test_batches_in_graphs_answer_as_the_eager_model_one_at_a_time(pair, seed, n, batch):
    """batch_decoding's steps replayed from graphs of B rows, B shrinking as rows leave (each B
    its static cache), between Medusa runs held in the one-row static cache."""
    graphed, eager = pair
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 64, (int(k),), generator=g).tolist()
               for k in torch.randint(1, 12, (n,), generator=g)]
    answers = dict(batch_decode(graphed, prompts, 30, Sampling(), {seed % 64}, batch))
    assert answers == {i: flat(plain_decode(eager, p, 30, Sampling(), {seed % 64}))
                       for i, p in enumerate(prompts)}
    assert any(shape[0] > 1 for shape in graphed.layers.graphs)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), n=st.integers(2, 7), batch=st.integers(2, 5))
def test_medusa_in_a_batch_in_graphs_answers_as_the_eager_model_plain_greedy(pair, seed, n,
                                                                           batch):
    """batch_decoding's Medusa steps, a tree a row, replayed from graphs of (B, N) rows, each
    row's compaction in the held static cache: every answer is plain greedy's."""
    graphed, eager = pair
    heads = cycling_heads(graphed, "hydra", seed)
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0]], num_heads=4,
                      device=graphed.embed.weight.device)
    draft, budget = fixed(heads, tree)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 64, (int(k),), generator=g).tolist()
               for k in torch.randint(1, 12, (n,), generator=g)]
    medusa = BatchMedusa(GraphedDraft(heads, draft.trees), budget, greedy())
    answers = dict(batch_medusa_decode(graphed, prompts, 30, medusa, set(), batch))
    assert answers == {i: flat(plain_decode(eager, p, 30, Sampling(), set()))
                       for i, p in enumerate(prompts)}
    assert any(shape[0] > 1 and shape[1] == tree.size for shape in graphed.layers.graphs)


def test_eager_step_runs_the_eager_blocks_and_gives_the_graphs_back(pair):
    graphed, eager = pair
    blocks, captures = graphed.layers, graphed.layers.captures
    with eager_step(graphed):
        assert not is_graphed(graphed)
        run = flat(plain_decode(graphed, [3, 3, 3], 10, Sampling(), set()))
    assert graphed.layers is blocks and blocks.captures == captures
    assert run == flat(plain_decode(eager, [3, 3, 3], 10, Sampling(), set()))


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_the_graphed_draft_gives_the_drafts_tokens(pair, kind):
    graphed, _ = pair
    device = graphed.embed.weight.device
    heads = cycling_heads(graphed, kind, 1)
    trees_ = {n: build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]][:n], num_heads=4,
                            device=device) for n in (1, 3, 6)}
    draft, reference = GraphedDraft(heads, trees_), TreeDraft(heads, trees_)
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 6, 3):
        hidden = torch.randn(graphed.config.hidden_size, generator=g).to(device, DTYPES[
            device.type])
        root = int(torch.randint(0, 64, (), generator=g))
        with torch.inference_mode():
            ours, theirs = draft.tree(graphed, n, root, hidden), reference.tree(
                graphed, n, root, hidden)
        assert torch.equal(ours.tokens, theirs.tokens)


def test_batches_and_long_prompts_run_the_blocks_the_graphs_hold_uncaptured(pair):
    """(here the eager blocks: what graphs of the eager blocks hold)"""
    graphed, eager = pair
    device = graphed.embed.weight.device
    before = dict(graphed.layers.graphs)
    prompt = torch.randint(0, 64, (2, MAX_ROWS + 3), generator=torch.Generator().manual_seed(1))
    T = prompt.shape[1]
    args = (prompt.to(device), torch.arange(T, device=device).expand(2, T),
            torch.ones(2, T, T, dtype=torch.bool, device=device).tril())
    with torch.inference_mode():
        assert torch.equal(graphed(*args)[0], eager(*args)[0])
    assert graphed.layers.graphs == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of compiled blocks: "
                    "Triton's kernels need a GPU")
def test_compiled_blocks_in_graphs_keep_medusa_greedy_equal_to_plain_greedy():
    model = cycling_model(3, dtype=torch.bfloat16, device="cuda")
    graph_step(model, compiled=True)
    heads = cycling_heads(model, "hydra", 0)
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0], [0, 1]], num_heads=4, device="cuda")
    draft, budget = fixed(heads, tree)
    medusa = flat(medusa_decode(model, GraphedDraft(heads, draft.trees), budget, greedy(),
                                [5, 6, 7], 40, set()))
    assert medusa == flat(plain_decode(model, [5, 6, 7], 40, Sampling(), set()))
    assert isinstance(model.layers, GraphedBlocks) and model.layers.compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels of a GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_a_rows_bits_are_the_same_at_every_row_count_at_the_default_models_shape(compiled):
    """SmolLM2-135M's shape, random bfloat16 weights: a tree's root row, for trees of every row
    count a step graph takes, whether its graph is captured yet or not, is the plain step's row
    to the bit (what lossless greedy Medusa rests on; a tiny model's kernels can hide what the
    default model's shape shows: its compiled blocks' bits are not the eager blocks')."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Llama(config).to("cuda", torch.bfloat16)
    graph_step(model, compiled)
    cache = new_cache(model, 20, 100, MAX_ROWS)
    with torch.inference_mode():
        prefill(model, cache, torch.randint(0, 49152, (1, 20), device="cuda"))
    root, n = 123, cache.length
    rows = []
    # 2, 17 and 65 rows: graphs captured up front (the Budget's sizes); 7 and 20: run first
    # uncaptured, then from their graphs
    for T in (1, 2, 7, 17, 20, MAX_ROWS) * 2:
        tokens = torch.randint(0, 49152, (1, T), device="cuda")
        tokens[0, 0] = root
        depth = (torch.arange(T, device="cuda") > 0).long()  # the root, then its children
        tree = torch.eye(T, dtype=torch.bool, device="cuda")
        tree[:, 0] = True  # a star: each child sees the root and itself
        mask = torch.cat([torch.ones(T, n, dtype=torch.bool, device="cuda"), tree], 1)[None]
        with torch.inference_mode():
            hidden = model.hidden_states(tokens, (n + depth)[None], mask, cache,
                                         cache.next_slots(T))
        rows.append((T, hidden[0, 0].clone()))
    assert model.layers.captures >= 6
    for T, row in rows:
        assert torch.equal(row, rows[0][1]), f"the root's row in {T} rows is not a plain step's"

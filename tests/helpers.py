"""What the tests share (each test file imports what it needs from here; the fixtures are
conftest.py's): the tiny random models and heads they decode with, the broken steps of the
negative controls and the bound a fast step is held to against its own eager step, the 4- and
8-bit weights of the formats' tests, the statistical tests' laws and chi-square, the hypothesis
strategies of trees, generate.py's output as a process, and which cases the default run keeps."""

import functools
import math
import os
import pty
import shutil
import subprocess
import sys
from collections import Counter
from itertools import product
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import strategies as st

from minimedusa.acceptance import Sampling, pick_by_draws, probabilities
from minimedusa.budget import fixed
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads
from minimedusa.files.weights import save_model
from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads
from minimedusa.model import Blocks, Llama, LlamaConfig
from minimedusa.speed import group_kernel
from minimedusa.speed.fused_block import fusable, fuse_blocks
from minimedusa.speed.fused_draft import fusable_draft
from minimedusa.speed.grids import GROUP, dequantize_int4, quantize_int4
from minimedusa.speed.host_greedy import greedy_for
from minimedusa.speed.reference_check import SAME_FORMAT
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree

REPO = Path(__file__).resolve().parent.parent
# Logits, greedy continuations, tokenizer ids and the chat template of the default model, made by
# an independent reference implementation (the file's "source" field: the transformers library on
# the same GGUF weights); copied from the project's shared reference data into the repository, so
# that a clone with nothing beside it runs these tests too.
REFERENCE = REPO / "tests" / "fixtures" / "smollm2_reference.json"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# the exact-law tests' chain: its vocabulary and the tokens of a sampled sequence, how many
# sequences, and the p-value below which a law is refused
V, M = 4, 3
N_SAMPLES, ALPHA = 20_000, 1e-4
# the samplers' law tests through the decoding loops: the wrong sampler scores p ~ 1e-15 here
VOCAB, NEW, RUNS = 5, 3, 1000


# the default model's poem, written by generate.py in the watchers' tests (--show, --trace)
POEM = ["--prompt", "Write a short poem about the sea.", "--max-new-tokens", "48"]


def generate_output(flags: list[str], terminal: bool) -> str:
    """generate.py's standard output, written to a pseudo-terminal or a pipe."""
    command = [sys.executable, str(REPO / "generate.py"), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NO_COLOR", None)
    if not terminal:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout
    leader, follower = pty.openpty()
    run = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, env=env, cwd=REPO)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: the run is done
            break
        if not chunk:
            break
        out += chunk
    assert run.wait(timeout=600) == 0, run.stderr.read()[-2000:]
    os.close(leader)
    return out.decode(errors="replace")


def slow_except(cases: list, *kept) -> list:
    """A claim's cases for parametrize: those in `kept` run in the default run, every other one
    only under `-m slow` (which CI runs too). The default run proves each claim once and stays
    under 10 minutes on 2 cores; the further formats, settings and shapes run in CI."""
    def slow(case):
        return pytest.param(*(case if isinstance(case, tuple) else (case,)),
                            marks=pytest.mark.slow)
    return [case if case in kept else slow(case) for case in cases]


def tiny_model(seed: int = 0, dtype=torch.float64, device="cpu", **overrides) -> Llama:
    """A random tiny Llama; float64 by default so that exactness tests compare exactly."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.tiny(**overrides)).to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


def cached_keys_values(cache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's keys and values in slots [0, n): (L, B, G, n, D) each."""
    return (torch.stack([layer.k[:, :, :n] for layer in cache.layers]),
            torch.stack([layer.v[:, :, :n] for layer in cache.layers]))


def perturbed(heads, seed: int, scale: float):
    """Heads (fresh: each guesses what the LM head guesses) with every parameter randomly
    perturbed: wrong often enough to exercise rejection, right often enough to accept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
    return heads.eval().requires_grad_(False)


def copycat_model(seed: int = 0, embed_scale: float = 10.0, **kwargs) -> Llama:
    """A tiny Llama that tends to repeat its last token: tied embeddings scaled up, so the
    residual stream is dominated by the current token's embedding, which the tied LM head
    scores highest. Heads that guess "the same again" are then right: a model on which Medusa
    accepts many candidates, so that the lossless tests are not vacuous."""
    model = tiny_model(seed, tie_word_embeddings=True, **kwargs)
    model.embed.weight.mul_(embed_scale)
    return model


def cycling_model(seed: int = 0, dtype=torch.float32, embed_scale: float = 10.0,
                  **overrides) -> Llama:
    """A tiny Llama whose greedy continuation walks a cycle of distinct tokens: the embeddings
    scaled up so the residual stream is mostly the current token's (as copycat_model), and the
    LM head the embeddings permuted, so that the next token is a fixed permutation of the
    current one. Heads made for the cycle (cycling_heads) then guess right often, not always:
    the lossless tests see tokens accepted and rejected, on sequences that do not repeat."""
    model = tiny_model(seed, dtype=dtype, tie_word_embeddings=False, **overrides)
    model.embed.weight.mul_(embed_scale)
    model.cycle = torch.randperm(model.config.vocab_size,
                                 generator=torch.Generator().manual_seed(seed))
    model.lm_head.weight.copy_(model.embed.weight[model.cycle])
    return model


def cycling_heads(model: Llama, kind: str, seed: int, heads: int = 4):
    """Heads that know cycling_model's permutation, perturbed so that they are wrong at times
    (measured: 1.5-3 tokens a step): Medusa's head k projects with the LM head permuted k + 1
    more times (it guesses the token k + 2 ahead); Hydra's reads its path's last token (the
    shared LM head then gives the next one)."""
    from minimedusa.heads import HydraHeads, MedusaHeads
    C = model.config.hidden_size
    with torch.no_grad():
        if kind == "hydra":
            made = HydraHeads.for_model(model, heads)
            for head in made.heads:
                head.read.weight[:, -C:] = torch.eye(C, dtype=head.read.weight.dtype)
            return perturbed(made, seed, 0.2)
        made = MedusaHeads.for_model(model, heads, num_layers=1)
        rows = torch.arange(model.config.vocab_size)
        for head in made.heads:
            rows = model.cycle[rows]
            head[-1].weight.copy_(model.embed.weight[model.cycle[rows]])
    return perturbed(made, seed, 0.5)


def greedy_pair(model, heads, tree, prompt: list[int], new: int) -> tuple[list, list, float]:
    """(Medusa greedy's tokens with `tree` (greedy as decoding runs it on the model's device),
    plain greedy's, Medusa's tokens a step): for the
    lossless tests, which also check that candidates were accepted (an "equal" where the tree
    accepted nothing proves nothing)."""
    steps = list(medusa_decode(model, *fixed(heads, tree), greedy_for(model.embed.weight.device),
                               prompt, new, set()))
    plain = [t for step in plain_decode(model, prompt, new, Sampling(), set()) for t in step.tokens]
    medusa = [t for step in steps for t in step.tokens]
    return medusa, plain, len(medusa) / len(steps)


# --- the reference check's bound of a fast step against its own format's eager step ---------

# The most a fast step (fused, compiled) moves any token's logit against its OWN format's eager
# step, by format and activations' dtype: as tight as what the two share (a looser bound hides
# the bug it is for: a fused norm dividing by C - 1 moved int4's float32 step by 0.074). Where
# both run the same products in float32 (float32: oneDNN's in both; int4 with float32
# activations: group_kernel.c's), they differ by float32's rounding of the elementwise steps
# and the attention's sums: 1.2e-4 and 9.3e-5 measured, bound 1e-3. Where the activations are
# bfloat16, or rounded to 8 and 16 bits inside w4a8's products, a rounding that flips by one
# unit between the two moves what follows by a fraction of a logit: the largest measured (both
# steps) times 1.5, rounded up to 0.05 (3 fixture chats x 48 positions on a 2-core Xeon with
# AMX, records/xeon-amx/step-error-xeon-amx.txt): bfloat16 0.75, int8 0.75, int4 0.56, w4a8
# 1.09. Pairs not measured keep the two formats' error, SAME_FORMAT * the format's error.
STEP_ERROR = {("float32", torch.float32): 1e-3, ("int4", torch.float32): 1e-3,
              ("bfloat16", torch.bfloat16): 1.15, ("int8", torch.bfloat16): 1.15,
              ("int4", torch.bfloat16): 0.85, ("w4a8", torch.float32): 1.65}


def step_error(fmt: str, activations: torch.dtype) -> float:
    """The bound of a fast step against its own format's eager step (STEP_ERROR)."""
    return STEP_ERROR.get((fmt, activations), SAME_FORMAT * format_named(fmt).error)


# --- negative controls of the reference check: steps broken as steps break ----------------

class WrittenOneEarly(Blocks):
    """Blocks that write the keys and values one slot before where they belong (over the
    previous token's; their own slot left as it was)."""

    def forward(self, x, cos, sin, mask, cache=None, slots=None):
        early = None if slots is None else (slots - 1).clamp(min=0)
        return super().forward(x, cos, sin, mask, cache, early)


class OwnKeyHidden(Blocks):
    """Blocks whose mask hides each token's own key (a causal mask off by one)."""

    def forward(self, x, cos, sin, mask, cache=None, slots=None):
        T, S = mask.shape[-2:]
        own = torch.arange(T, device=mask.device) + (S - T)  # (T,): each row's own slot
        mask = mask.clone()
        mask[..., torch.arange(T), own] = False
        mask[..., 0] = True  # a row must see something
        return super().forward(x, cos, sin, mask, cache, slots)


class LastBlockSkipped(Blocks):
    """Blocks whose loop stops one block short."""

    def forward(self, x, cos, sin, mask, cache=None, slots=None):
        layer_caches = cache.layers if cache is not None else [None] * len(self)
        for layer, layer_cache in list(zip(self, layer_caches))[:-1]:
            x = layer(x, cos, sin, mask, layer_cache, slots)
        return x


class RoundedToBfloat16(Blocks):
    """Blocks whose float32 residual stream is rounded to bfloat16 after each block (a fast
    path that keeps its activations narrower than the format's): within bfloat16's bound,
    caught by float32's."""

    def forward(self, x, cos, sin, mask, cache=None, slots=None):
        layer_caches = cache.layers if cache is not None else [None] * len(self)
        for layer, layer_cache in zip(self, layer_caches):
            x = layer(x, cos, sin, mask, layer_cache, slots).bfloat16().to(x.dtype)
        return x


# each broken step, and the format whose bound it must break (the loosest it can: int8's)
BROKEN = [(WrittenOneEarly, "int8"), (OwnKeyHidden, "int8"), (LastBlockSkipped, "int8"),
          (RoundedToBfloat16, "float32")]


def broken(model, kind):
    """The model with its blocks run as `kind` (a broken step plugged in)."""
    model.layers = kind(model.layers)
    return model


def model_folder(folder, default_model_dir, context: int):
    save_model(tiny_model(dtype=torch.float32, max_position_embeddings=context,
                          vocab_size=49152), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


@st.composite
def trees(draw, max_nodes=24, max_depth=5, max_rank=4):
    """Random valid node paths: each new node hangs under an existing one, with a fresh rank."""
    nodes = [()]
    for _ in range(draw(st.integers(1, max_nodes))):
        parent = draw(st.sampled_from([p for p in nodes if len(p) < max_depth]))
        used = {p[-1] for p in nodes if p[:-1] == parent and p}
        free = [r for r in range(max_rank) if r not in used]
        if free:
            nodes.append(parent + (draw(st.sampled_from(free)),))
    choices = [list(p) for p in nodes[1:]]
    return draw(st.permutations(choices))  # any order must do


def perturbed_heads(model, num_heads, shared, seed, scale):
    """Heads in the paper's initialisation, randomly perturbed (conftest.perturbed)."""
    return perturbed(MedusaHeads.for_model(model, num_heads, num_layers=1, shared_lm_head=shared),
                     seed, scale)


def flat(steps):
    return [t for step in steps for t in step.tokens]


def perturbed_hydra(model, num_heads, seed, scale):
    """Fresh Hydra heads, randomly perturbed, token part included (conftest.perturbed)."""
    return perturbed(HydraHeads.for_model(model, num_heads), seed, scale)


def four_bit_weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A weight as a 4-bit file holds it: per group of 32 inputs, q * scale + minimum with
    q in 0..15, 0 and 15 both used, scale and minimum float16 (as Q4_1 stores them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    scales = (torch.rand(N, K // GROUP, 1, generator=g) * 0.01).half().float()
    minimums = (-torch.rand(N, K // GROUP, 1, generator=g) * 0.08).half().float()
    return (q * scales + minimums).view(N, K).float()


def eight_bit_weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """A weight as an 8-bit file holds it: per group of 32 inputs, q * scale with q in
    -127..127, |q| = 127 used, scale float16 (as Q8_0 stores it)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K // GROUP, GROUP), generator=g)
    q[..., 0] = 127 * (2 * torch.randint(0, 2, (N, K // GROUP), generator=g) - 1)
    scales = (torch.rand(N, K // GROUP, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (q * scales).view(N, K).float()


# skips where group_kernel.c does not multiply on this CPU (conftest's fixture: asked when the
# test runs, not when this file is read, which is before a sanitized run re-executes itself)
needs_group_kernel = pytest.mark.usefixtures("group_kernel_multiplies")


def four_bit_model(seed: int, **overrides):
    """A tiny float32 model whose blocks' weights lie on a 4-bit grid and whose (tied) LM head
    on an 8-bit one, as the default model's."""
    model = tiny_model(seed, dtype=torch.float32, tie_word_embeddings=True, **overrides)
    with torch.no_grad():
        for i, m in enumerate(model.layers.modules()):
            if isinstance(m, nn.Linear):
                m.weight.copy_(four_bit_weight(*m.weight.shape, seed=seed * 100 + i) * 8)
        model.embed.weight.copy_(eight_bit_weight(*model.embed.weight.shape, seed=seed) * 16)
    return model


def fused(model, weight_format: str, dtype: torch.dtype):
    """The model in `weight_format` with `dtype` activations, its blocks fused. float32 rows
    only where group_kernel.c multiplies them (its AVX2 path); bfloat16 rows on any CPU."""
    if dtype == torch.float32 and not group_kernel.takes_float32():
        pytest.skip("this CPU's group_kernel.c multiplies bfloat16 rows only")
    if weight_format == "bfloat16" and not group_kernel.multiplies_bfloat16():
        pytest.skip("this CPU's group_kernel.c does not multiply bfloat16 weights")
    model = apply_format(model, format_named(weight_format)).to(dtype)
    assert fusable(model) is None
    fuse_blocks(model)
    return model


def within_rounding(dtype: torch.dtype, weight_format: str = "int4") -> dict:
    """float32's rounding, or bfloat16's (a rounding of a step's result that flips by one unit
    between two orders of the same sums moves what follows by ~2**-8 of itself). w4a8 in
    float32: where the fused step's elementwise results are an ulp from torch's (silu's exp,
    the norm's sums), rounding them to 16 bits puts an activation one step (1 / 32767 of its
    group's largest) off now and then."""
    if dtype == torch.float32:
        tolerance = 2e-3 if weight_format == "w4a8" else 1e-4
        return {"rtol": tolerance, "atol": tolerance}
    return {"rtol": 3e-2, "atol": 3e-2}


def hydra_draft_setup(seed: int, dtype: torch.dtype, vocabulary: int = 0, scale: float = 0.5):
    """A 4-bit model (its LM head on an 8-bit grid) in int4 with `dtype` activations, and
    perturbed Hydra heads of 2 blocks a head in its format (with a draft vocabulary of that
    many tokens, if any), whose draft fuses."""
    if dtype == torch.float32 and not group_kernel.takes_float32():
        pytest.skip("this CPU's group_kernel.c multiplies bfloat16 rows only")
    model = apply_format(four_bit_model(seed), format_named("int4")).to(dtype)
    heads = perturbed(HydraHeads.for_model(model, 4, num_layers=2).float(), seed, scale)
    if vocabulary:
        ids = torch.randperm(model.config.vocab_size,
                             generator=torch.Generator().manual_seed(seed))[:vocabulary]
        heads.vocabulary = DraftVocabulary(ids.sort().values, model.lm_head)
    heads = apply_format(heads, format_named("int4")).to(dtype)  # plug_in_heads', in `dtype`
    assert fusable_draft(heads, model) is None
    return model, heads


def quantized_rows(x: torch.Tensor, largest: int) -> torch.Tensor:
    """x (M, K) as the kernel quantizes it per row and group of 32, dequantized, in float64: d =
    max |x| / largest (127: 8 bits, 32767: 16), a = x * (1 / d) rounded to nearest even, in
    float32 as there (in float64, x / d lands on the other side of a .5 now and then)."""
    M, K = x.shape
    groups = x.float().view(M, K // GROUP, GROUP)  # (M, G, 32)
    d = groups.abs().amax(-1, keepdim=True) / largest  # (M, G, 1)
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(groups * inverse).double() * d.double()).view(M, K)


def w4a8_reference(x: torch.Tensor, weight: torch.Tensor, largest: int = 127) -> torch.Tensor:
    """x (M, K) times a 4-bit grid's weight (N, K), the activations quantized first
    (quantized_rows), the product in float64: (M, N)."""
    q, scales, minimums = quantize_int4(weight)  # (N, K), (N, G), (N, G): float16 in the kernel
    w = dequantize_int4(q, scales.half().float(), minimums.half().float()).double()  # (N, K)
    return quantized_rows(x, largest) @ w.T  # (M, N)


NODES = [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0), (1, 0), (0, 0, 0, 0), (3,), (0, 2), (1, 1),
         (0, 0, 1), (2, 0), (0, 1, 0), (4,), (0, 0, 0, 1)]


def perturbed_hydra_pp(model, num_heads, seed, scale):
    """Fresh Hydra++ heads, every parameter perturbed (the draft layer's zero output
    projections too: the layer then changes what the heads read)."""
    return perturbed(HydraPlusPlusHeads.for_model(model, num_heads), seed, scale)


def chain(seed: int):
    """(logits (V, V): row a the next token's logits after token a, draft ranks (V, V): the
    drafts' guesses after a, best first, from a perturbed copy of the table, as heads guess)."""
    g = torch.Generator().manual_seed(seed)
    table = 2.0 * torch.randn(V, V, generator=g, dtype=torch.float64)
    guesses = table + 1.5 * torch.randn(V, V, generator=g, dtype=torch.float64)
    return table, guesses.argsort(dim=-1, descending=True)


def exact_law(table, root: int, temperature: float, top_p: float) -> dict[tuple, float]:
    """Plain sampling's probability of every sequence of M tokens after `root`."""
    p = probabilities(table, temperature, top_p).double()  # (V, V)
    law = {}
    for sequence in product(range(V), repeat=M):
        previous = (root, *sequence[:-1])
        law[sequence] = math.prod(p[a, b].item() for a, b in zip(previous, sequence))
    return law


def goodness_of_fit(counts: Counter, law: dict) -> float:
    """Pearson's chi-square p-value of counts against the law; outcomes expected fewer than 5
    times are pooled, so the chi-square law of the statistic holds."""
    n = sum(counts.values())
    assert set(counts) <= {o for o, q in law.items() if q > 0}, "an impossible sequence"
    rare = [o for o, q in law.items() if n * q < 5]
    bins = [(counts[o], n * q) for o, q in law.items() if o not in rare]
    bins.append((sum(counts[o] for o in rare), n * sum(law[o] for o in rare)))
    bins = [(x, e) for x, e in bins if e > 0]
    stat = sum((x - e) ** 2 / e for x, e in bins)
    return torch.special.gammaincc(torch.tensor((len(bins) - 1) / 2),
                                   torch.tensor(stat / 2)).item()


def argmax_a_quarter_of_the_time(temperature, top_p=1.0):
    def verify(logits, tree, tokens, g):
        draws = torch.multinomial(probabilities(logits, temperature, top_p), 1, generator=g)[:, 0]
        argmax = logits.argmax(dim=-1)
        biased = torch.rand(draws.shape, generator=g) < 0.25
        return (*pick_by_draws(torch.where(biased, argmax, draws), tree, tokens), {})
    return verify


TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two equal-sized samples from one distribution? Pearson's homogeneity test; outcomes
    seen fewer than 10 times in all are pooled into one bin so the chi-square law holds."""
    outcomes = set(a) | set(b)
    rare = [o for o in outcomes if a[o] + b[o] < 10]
    bins = [(a[o], b[o]) for o in outcomes if o not in rare]
    bins.append((sum(a[o] for o in rare), sum(b[o] for o in rare)))
    bins = [(x, y) for x, y in bins if x + y > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    return torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)).item()


def rejection_setup(kind="medusa"):
    model = tiny_model(1, vocab_size=VOCAB)
    kinds = {"medusa": MedusaHeads, "hydra": HydraHeads, "hydra++": HydraPlusPlusHeads}
    heads = kinds[kind].for_model(model, 3).requires_grad_(False)
    with torch.no_grad():  # untrained-looking heads: their guesses are right only sometimes
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2),
                                     dtype=p.dtype))
    return model, heads, build_tree(TREE, num_heads=3)


@functools.cache
def plain_samples(temperature, top_p) -> Counter:
    model, _, _ = rejection_setup()
    return Counter(tuple(t for step in plain_decode(model, [1, 2], NEW,
                                                    Sampling(temperature, top_p, seed=s), set())
                         for t in step.tokens)
                   for s in range(RUNS, 2 * RUNS))

"""Shared fixtures: the tiny random Llama, the real default model, the reference fixture file.

Tests that touch a model run on every available device (the CPU always, CUDA where present), so
the same suite proves the CUDA path on a GPU machine.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from minimedusa.files.default_model import ensure_default_model
from minimedusa.model import Blocks, Llama, LlamaConfig
from minimedusa.acceptance import Sampling
from minimedusa.training.self_distill import answer_batch, save_shard, tokenizer_fingerprint
from minimedusa.files.weights import load_model, save_model
from minimedusa.cli.recipe import Recipe, decoding_model
from minimedusa.speed import sanitizer
from minimedusa.speed.c_kernels import kernels_folder

# every run draws the same examples (a seed per test): a failure seen on one machine is replayed
# on every other and in CI, where no example database is kept between runs
settings.register_profile("replayable", derandomize=True)
settings.load_profile("replayable")



def pytest_configure(config):
    """The markers: `kernels` (under MINIMEDUSA_SANITIZE, the run is re-executed with the
    sanitizers' runtime loaded first, speed/sanitizer.py, here, where pytest is not holding the
    standard output in a file yet: `MINIMEDUSA_SANITIZE=address python -m pytest -q -m kernels`
    runs every test of a C kernel or operator instrumented) and `slow` (processes started,
    killed and started again, or run as another CPU: left out of a run that selects nothing,
    `-m slow` runs them; CI does both)."""
    config.addinivalue_line("markers", "kernels: runs a C kernel or operator (built by "
                            "speed/c_kernels.py): the tests MINIMEDUSA_SANITIZE checks")
    config.addinivalue_line("markers", "slow: starts, kills and restarts processes, or runs "
                            "one as another CPU; run with -m slow")
    if not config.option.markexpr:
        config.option.markexpr = "not slow"
    # --capture=sys: a sanitizer's report, written to the process's stderr as it stops it,
    # then reaches the terminal, not a file of pytest's that the stop loses
    sanitizer.ensure_runtime(("--capture=sys",))


REPO = Path(__file__).resolve().parent.parent
# Logits, greedy continuations, tokenizer ids and the chat template of the default model, made by
# an independent reference implementation (the file's "source" field: the transformers library on
# the same GGUF weights); copied from the project's shared reference data into the repository, so
# that a clone with nothing beside it runs these tests too.
REFERENCE = REPO / "tests" / "fixtures" / "smollm2_reference.json"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
    from minimedusa.speed.host_greedy import greedy_for  # the tests' own imports stay at their tops
    from minimedusa.budget import fixed
    from minimedusa.decoding import medusa_decode, plain_decode
    steps = list(medusa_decode(model, *fixed(heads, tree), greedy_for(model.embed.weight.device),
                               prompt, new, set()))
    plain = [t for step in plain_decode(model, prompt, new, Sampling(), set()) for t in step]
    medusa = [t for step in steps for t in step]
    return medusa, plain, len(medusa) / len(steps)


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


@pytest.fixture(scope="session")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model, fetched and converted on first use (as generate.py does)."""
    return ensure_default_model()


@pytest.fixture(scope="session", params=DEVICES)
def smollm2(request, default_model_dir):
    """SmolLM2-135M-Instruct in float32 on each available device, loaded once per device."""
    return load_model(default_model_dir, request.param, torch.float32)


@pytest.fixture(scope="session", params=DEVICES)
def smollm2_packed(request, default_model_dir):
    """The same, as generate.py's float32 format and self-distillation run it: on a CPU its
    products prepacked (speed/packed_linear.py), whose row bits are the same whatever rows
    beside them. The real-model decoding checks run on it (on the 2-core AVX2 EPYC 98 s where
    the plain core took 134); the reference checks on the plain core (smollm2)."""
    model, _ = decoding_model(Recipe(default_model_dir, request.param, "float32"))  # eager
    return model


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory, default_model_dir):
    """A tiny Llama folder (with the real tokenizer file, for its fingerprint) and greedy
    self-distilled data from it: 3 shards of 8 answers."""
    root = tmp_path_factory.mktemp("train")
    model_dir, data = root / "model", root / "data"
    model = tiny_model(7, dtype=torch.float32)
    save_model(model, model_dir)
    shutil.copy(default_model_dir / "tokenizer.json", model_dir / "tokenizer.json")
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    for s in range(3):
        prompts = [torch.randint(2, 64, (int(n),), generator=g).tolist()
                   for n in torch.randint(2, 8, (8,), generator=g)]
        rows = answer_batch(model, prompts, 24, Sampling(), {1}, None)
        save_shard(data / f"shard-{s:05d}.safetensors",
                   [{"prompt_ids": p, "answer_ids": a, "hidden": h}
                    for p, (a, h) in zip(prompts, rows)])
    (data / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(model_dir)}))
    return model_dir, data


@pytest.fixture(scope="session")
def built_kernels() -> Path:
    """The folder of built C kernels every test and every process it starts shares: the one
    the checks at collection (which kernels multiply here) already built into, the user's, as
    generate.py would. A kernel's file is named by a hash of its source, compiler and CPU, so
    sharing it is safe, and the kernels and their C++ operators (~15 s on a 2-core CPU) are
    built once, not once at collection and once more for the run."""
    folder = kernels_folder()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(autouse=True, scope="session")
def room_for_the_suites_graphs():
    """The suite compiles more models in its one process than any run does (tiny ones of
    several shapes, the real one in every format), and their graphs all sit on Block.forward's
    code: past recompile_limit (compile_blocks': 64) a fullgraph compile fails. Emptying the
    compiler between files instead would compile the same graphs again (~20 s a suite)."""
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096


@pytest.fixture(autouse=True)
def torch_threads():
    """A command's main run in the test's process with --threads N (bench, generate) sets
    torch's threads for the whole process: restored after each test, else every later test ran
    on that one thread (the real-model tests after test_bench.py took 1.6x as long)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def latency_cache(tmp_path_factory, monkeypatch, built_kernels):
    """Step latencies measured by a test go to a fresh folder of its own, never to the user's
    cache (cli/latency_cache.cache_file); its kernels folder is the run's (built_kernels)."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / built_kernels.name).symlink_to(built_kernels, target_is_directory=True)
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(cache))

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

from minimedusa import experiments
from minimedusa.files.default_model import ensure_default_model
from minimedusa.acceptance import Sampling
from minimedusa.training.self_distill import answer_batch, save_shard, tokenizer_fingerprint
from minimedusa.files.weights import load_model, save_model
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.speed import group_kernel, sanitizer
from minimedusa.speed.c_kernels import kernels_folder
from minimedusa.speed.weight_formats import format_named
from helpers import DEVICES, generate_output, model_folder, POEM, REFERENCE, tiny_model

# every run draws the same examples (a seed per test): a failure seen on one machine is replayed
# on every other and in CI, where no example database is kept between runs
settings.register_profile("replayable", derandomize=True)
settings.load_profile("replayable")



def pytest_configure(config):
    """The markers: `kernels` (under MINIMEDUSA_SANITIZE, the run is re-executed with the
    sanitizers' runtime loaded first, speed/sanitizer.py, here, where pytest is not holding the
    standard output in a file yet: `MINIMEDUSA_SANITIZE=address python -m pytest -q -m kernels`
    runs every test of a C kernel or operator instrumented) and `slow` (processes started,
    killed and started again, or run as another CPU; a claim's further cases, the default run
    proving each claim once, helpers.slow_except; the controls that show a statistical test
    can fail: left out of a run that selects nothing, `-m slow` runs them; CI does both)."""
    config.addinivalue_line("markers", "kernels: runs a C kernel or operator (built by "
                            "speed/c_kernels.py): the tests MINIMEDUSA_SANITIZE checks")
    config.addinivalue_line("markers", "slow: starts, kills and restarts processes, runs one "
                            "as another CPU, or a claim's further cases and controls; run "
                            "with -m slow")
    if not config.option.markexpr:
        config.option.markexpr = "not slow"
    if sanitizer.runtime_wanted():
        # pytest holds the standard output and error in files of its own by now (its capture
        # starts before this file is read): given back first, else the re-executed run writes
        # its dots, its summary and the sanitizer's report into files nobody reads. note: so
        # no kernel may load while this file and helpers.py are imported (needs_group_kernel
        # asks at run time): that would re-execute the run before here, mute.
        config.pluginmanager.getplugin("capturemanager").stop_global_capturing()
        # --capture=sys: a sanitizer's report, written to the process's stderr as it stops it,
        # then reaches the terminal, not a file of pytest's that the stop loses
        sanitizer.ensure_runtime(("--capture=sys",))


@pytest.fixture
def group_kernel_multiplies():
    """Skips the test where group_kernel.c does not multiply on this CPU (helpers'
    needs_group_kernel)."""
    if (problem := group_kernel.kernel_problem()) is not None:
        pytest.skip(f"group_kernel.c does not multiply on this CPU: {problem}")


@pytest.fixture(scope="session")
def poem_answer() -> str:
    """generate.py's answer to POEM through a pipe, without flags: what --show and --trace must
    leave as it is (one run for both)."""
    return generate_output(POEM, terminal=False)


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
    model, _ = decoding_model(Recipe(folder=default_model_dir, device=request.param,
                                     weight_format=format_named("float32")))  # eager
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
def experiments_registered():
    """Hydra++'s heads kind and training rows, as the recipe, train.py and the tree search
    register them where they start (experiments.register_training): the tests that read or
    train Hydra++ heads through the files and training modules directly need them too."""
    experiments.register_training()


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


def new_cache(tmp_path_factory, built_kernels) -> Path:
    """A fresh cache folder (never the user's: assembly/latency_cache.cache_file), its kernels
    folder the run's (built_kernels)."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / built_kernels.name).symlink_to(built_kernels, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory, built_kernels) -> Path:
    return new_cache(tmp_path_factory, built_kernels)


@pytest.fixture(autouse=True)
def latency_cache(run_cache, monkeypatch):
    """Step latencies a test measures go to the run's cache folder, shared by its tests and
    the processes they start, as a user's runs share theirs: a real model's trees or a draft
    model's chains (seconds each) are timed once a run, not once a test. A test about the
    timing and its cache itself takes a fresh folder (fresh_latency_cache)."""
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(run_cache))


@pytest.fixture
def fresh_latency_cache(tmp_path_factory, monkeypatch, built_kernels):
    """A cache folder of the test's own: what it times is measured here, not read."""
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(new_cache(tmp_path_factory, built_kernels)))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory, default_model_dir):
    """A tiny random Llama (context 512) with the real tokenizer, as an HF folder."""
    return model_folder(tmp_path_factory.mktemp("chat"), default_model_dir, 512)

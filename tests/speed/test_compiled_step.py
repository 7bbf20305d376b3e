"""The compiled decoding step (compiled_step.py) against its eager reference, on a tiny model
whose linear layers are prepacked as on a CPU: the same logits, Medusa greedy equal to plain
greedy under compilation too, and no step of a run compiled again after the warm-up. Skipped
where torch.compile does not work (no C++ compiler)."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import copycat_model, perturbed, REPO, tiny_model, trees
from minimedusa.budget import fixed
from minimedusa.acceptance import Sampling, greedy
from minimedusa.speed.compiled_step import compile_blocks, compiler_problem, is_compiled, warm_up
from minimedusa.decoding import (decode_step, medusa_decode, new_cache, plain_decode, prefill,
                                 tree_forward)
from minimedusa.heads import MedusaHeads
from minimedusa.tree import build_tree
from minimedusa.speed.weight_formats import apply_format, format_named

pytestmark = pytest.mark.kernels  # every test here runs a C kernel or operator

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def compiled():
    """A tiny float32 model, packed for the CPU and compiled, warmed up once for the module."""
    problem = compiler_problem()
    if problem is not None:
        pytest.skip(f"torch.compile does not work here: {problem}")
    model = apply_format(copycat_model(5, embed_scale=3.0, dtype=torch.float32),
                         format_named("float32"))
    compile_blocks(model)
    warm_up(model)
    return model


def eager(fn, *args):
    with torch.compiler.set_stance("force_eager"):
        return fn(*args)


def test_compile_marks_the_model_and_eager_stays_unmarked(compiled):
    assert is_compiled(compiled)
    assert not is_compiled(tiny_model())


def test_compiled_steps_give_the_eager_logits(compiled):
    """A plain step and a tree step, compiled, give what the eager model gives from the same
    cache (float32: equal up to the order fused loops add in)."""
    tree = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)], num_heads=2)
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])
    with torch.inference_mode():
        for step in (lambda c: decode_step(compiled, c, tokens[:1].view(1, 1)),
                     lambda c: tree_forward(compiled, c, tree, tokens)):
            results = []
            for run in (step, lambda c: eager(step, c)):
                cache = new_cache(compiled, len(PROMPT), 8, margin=tree.size)
                prefill(compiled, cache, torch.tensor([PROMPT]))
                results.append(run(cache))
            torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(choices=trees(max_nodes=16, max_depth=4), seed=st.integers(0, 1000),
       prompt_len=st.integers(1, 20))
def test_compiled_medusa_greedy_equals_compiled_plain_greedy_and_never_recompiles(
        compiled, choices, seed, prompt_len):
    """After the warm-up, every tree size, prompt length and cache capacity finds its graph
    made (torch raises on any recompilation), and Medusa greedy stays lossless."""
    heads = perturbed(MedusaHeads.for_model(compiled, 4), seed, 0.05)
    tree = build_tree(choices, num_heads=4)
    prompt = torch.randint(2, 64, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    with torch.compiler.set_stance("fail_on_recompile"):
        plain = [t for s in plain_decode(compiled, prompt.tolist(), 24, Sampling(), set())
                 for t in s.tokens]
        medusa = [t for s in medusa_decode(compiled, *fixed(heads, tree), greedy(),
                                           prompt.tolist(), 24, set()) for t in s.tokens]
    assert medusa == plain



# a tiny model's compiled batch step (2 rows, each its own length, as training's batch_seconds
# times it) against its eager step: prints the largest difference of their logits
BATCH_STEP = """
import torch
from helpers import tiny_model
from minimedusa.batch_decoding import batch_step
from minimedusa.kv_cache import KVCache
from minimedusa.speed.compiled_step import compile_blocks
from minimedusa.speed.weight_formats import apply_format, format_named
model = apply_format(tiny_model(3, dtype=torch.float32, hidden_size=96, intermediate_size=200),
                     format_named("float32"))
compile_blocks(model)
tokens, logits = torch.tensor([[5], [9]]), []
for stance in ("default", "force_eager"):
    cache = KVCache.for_model(model, 40, batch_size=2)
    with torch.compiler.set_stance(stance), torch.inference_mode():
        logits.append(batch_step(model, cache, tokens, [11, 23])[0])
print((logits[0] - logits[1]).abs().max().item())
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="a CPU whose torch kernels are AVX-512's: on others every process "
                    "generates for one vector width")
def test_graphs_cached_for_another_vector_width_are_not_reused(compiled, tmp_path):
    """The heap corruption of `train.py --frozen --prompts 2` (glibc's "malloc(): unaligned
    tcache chunk detected", exit 134) after a process run as an AVX2 CPU: inductor's disk cache
    handed it C++ generated for 8 floats a vector, which built for 16 stores past its buffers
    (compiled_step.key_graphs_by_vector_width). A process as AVX2 (ATEN_CPU_CAPABILITY, as
    bench.model_size --isa avx2 runs) fills a fresh cache, then a native one reads it: its
    compiled batch step gives the eager logits. (The other way round, NaN where it wrote none:
    the same key.)"""
    tests = REPO / "tests"
    for capability in ("avx2", "default"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
               "ATEN_CPU_CAPABILITY": capability,
               "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
        done = subprocess.run([sys.executable, "-c", BATCH_STEP], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, (capability, done.stderr[-2000:])
        assert float(done.stdout) <= 1e-5, (capability, done.stdout)

"""Every path the flags can pick writes the eager float32 reference's text on the REAL default
model (speed/reference_check.py): each weight format x step (eager, fused, compiled), its plain
step forced along the fixture's greedy chats (every position checked: the logits rule, then
the margin rule), its Medusa tree step and its batch of rows decoding freely (the margin rule,
and equal to the same path's plain greedy); each fast step against the eager step of its
format. A path may part from the reference only where the reference's top-2 margin is under
its format's bound (its `error`, weight_formats.py, measured by format_quality --steps).
Negative controls (conftest.BROKEN): steps broken as steps break (keys written one slot early,
a mask that hides a token's own key, a loop one block short, activations narrower than the
format's) fail every check here, and generate.py falls back to its eager step, with one line,
where its fast step fails. Not controls, as they change nothing: a rotation one position on
everywhere (RoPE sees only relative positions); keys kept in another block's layer of the cache
(each block still reads what it wrote). CUDA's paths (bfloat16 eager, and in CUDA graphs of the
compiled blocks, the default there) run where a GPU is (bench/gpu_session.py's first step).
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers import BROKEN, broken, LastBlockSkipped, REPO, slow_except, step_error
from generate import main as generate_main
from minimedusa.batch_decoding import batch_decode
from minimedusa.budget import fixed, grow_tree
from minimedusa.assembly.recipe import Recipe, decoding_heads, decoding_model, wrapped
from minimedusa.decoding import decode_step, medusa_decode, new_cache, plain_decode, prefill
from minimedusa.files.default_model import DEFAULT_HEADS_DIR
from minimedusa.files.heads_files import read_calibration
from minimedusa.files.weights import load_model
from minimedusa.heads import ranked_vocab_size
from minimedusa.model import Blocks
from minimedusa.acceptance import Sampling
from minimedusa.speed import group_kernel
from minimedusa.assembly.load import formatted_model
from minimedusa.speed.compiled_step import compiler_problem
from minimedusa.speed.fused_block import fusable, fuse_blocks
from minimedusa.speed.machine import AVX2_ENVIRONMENT, cpu_features
from minimedusa.speed.plug_in import eager_step
from minimedusa.speed.host_greedy import greedy_for
from minimedusa.speed.reference_check import checked_step, largest_shift, parting, probe_logits
from minimedusa.speed.weight_formats import format_named
from minimedusa.tree import build_tree

FORMATS = ("float32", "bfloat16", "int8", "int4", "w4a8")
# (device, format, step): every format's eager, fused and compiled steps on a CPU (float32 and
# int8 never fuse), and CUDA's two, bfloat16 eager (--no-compile) and in CUDA graphs (the
# default), where a GPU is present
PATHS = ([("cpu", fmt, step) for fmt in FORMATS for step in ("eager", "fused", "compiled")
          if (fmt, step) not in (("float32", "fused"), ("int8", "fused"))]
         + [("cuda", "bfloat16", step) for step in ("eager", "graphed")])
COMPILE_FLAG = {"eager": False, "fused": None, "compiled": True, "graphed": None}
HOW = {"eager": "eager", "fused": "fused", "compiled": "compiled", "graphed": "CUDA graphs"}
N = 16  # each chat's first 16 answer tokens (of the fixture's 48): 48 positions a path


def path_model(folder, device: str, fmt: str, step: str):
    """The default model in format `fmt` on `device`, its step `step` as plug_in makes it, or
    the reason this machine cannot run that path (a skip's)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no GPU here: the GPU session's script runs the CUDA paths"
    if fmt == "w4a8" and group_kernel.kernel_problem() is not None:
        return f"w4a8 multiplies in group_kernel.c only: {group_kernel.kernel_problem()}"
    if step == "compiled" and compiler_problem() is not None:
        return f"no compiled step here: {compiler_problem()}"
    model, how = decoding_model(Recipe(folder=folder, device=torch.device(device),
                                       weight_format=format_named(fmt),
                                       compile=COMPILE_FLAG[step]))
    if not how.startswith(HOW[step]):
        return f"{fmt}'s step here is {how}, not {step}"
    return model


@torch.inference_mode()
def forced_logits(model, case: dict, n: int) -> torch.Tensor:
    """The model's logits along the reference's greedy chat (the prompt, then one reference
    token a step, whatever the model would have picked): (n, V), every position checked."""
    device = model.embed.weight.device
    cache = new_cache(model, len(case["prompt_ids"]), n)
    logits, _ = prefill(model, cache, torch.tensor([case["prompt_ids"]], device=device))
    rows = [logits[0]]
    for token in case["output_ids"][:n - 1]:
        logits, _ = decode_step(model, cache, torch.tensor([[token]], device=device))
        rows.append(logits[0])
    return torch.stack(rows).float().cpu()  # (n, V)


class Paths:
    """Each path's model, and its forced logits on the fixture's chats, made once."""

    def __init__(self, folder, cases: list):
        self.folder, self.cases, self.models, self.forced = folder, cases, {}, {}

    def model(self, path: tuple):
        if path not in self.models:
            self.models[path] = path_model(self.folder, *path)
        if isinstance(self.models[path], str):
            pytest.skip(self.models[path])
        return self.models[path]

    def logits(self, path: tuple) -> list:
        if path not in self.forced:
            self.forced[path] = [forced_logits(self.model(path), c, N) for c in self.cases]
        return self.forced[path]


@pytest.fixture(scope="module")
def paths(default_model_dir, reference):
    return Paths(default_model_dir, reference["greedy"]["cases"])


@pytest.fixture(scope="module")
def reference_logits(default_model_dir, reference):
    """The eager float32 model's forced logits on each fixture chat, on the CPU: the
    reference of every path, CUDA's too."""
    model = load_model(default_model_dir, "cpu", torch.float32)
    return [forced_logits(model, case, N) for case in reference["greedy"]["cases"]]


def assert_keeps_the_reference(logits: list, reference_logits: list, cases: list, bound: float):
    """The logits rule at every position, then the margin rule on the tokens it would pick."""
    for case, got, expected in zip(cases, logits, reference_logits):
        shift = largest_shift(got, expected[:len(got)])  # (n,)
        assert shift.max() <= bound, (case["kind"], shift.argmax().item(), shift.max().item())
        picked = got.argmax(-1).tolist()
        for i, (token, wanted) in enumerate(zip(picked, case["output_ids"])):
            if token != wanted:  # a parting only where the reference was nearly tied
                assert case["top2_margin"][i] < bound, (case["kind"], i)


# the default run: a fused C step and CUDA's paths; every path under -m slow (the compiled
# steps, by default: lossless against their own plain steps, test_lossless_matrix.py)
@pytest.mark.kernels
@pytest.mark.parametrize("device, fmt, step", slow_except(PATHS, ("cpu", "int4", "fused"),
                                                          *PATHS[-2:]))
def test_each_paths_plain_step_keeps_the_reference_at_every_position(paths, reference_logits,
                                                                     device, fmt, step):
    logits = paths.logits((device, fmt, step))
    assert_keeps_the_reference(logits, reference_logits, paths.cases, format_named(fmt).error)
    if step != "eager":  # and the eager step of its own format, at the precision they share
        bound = step_error(fmt, paths.model((device, fmt, step)).embed.weight.dtype)
        for got, eager in zip(logits, paths.logits((device, fmt, "eager"))):
            assert largest_shift(got, eager).max() <= bound


@pytest.mark.kernels
def test_the_fused_step_in_float32_gives_its_eager_step_to_float32_rounding(paths,
                                                                           default_model_dir):
    """int4 weights, float32 activations (where group_kernel.c takes float32 rows): the fused
    and eager steps run the same products, so they part by float32's rounding alone; a fused
    norm dividing by C - 1 moved this step by 0.074, and the int4 path's bfloat16 bound (0.85)
    could not see it."""
    if not group_kernel.takes_float32() or group_kernel.kernel_problem() is not None:
        pytest.skip("this CPU's group_kernel.c does not take float32 rows")
    model = formatted_model(default_model_dir, "cpu", format_named("int4")).to(torch.float32)
    assert fusable(model) is None
    fuse_blocks(model)
    fast = [forced_logits(model, case, N) for case in paths.cases]
    with eager_step(model):
        eager = [forced_logits(model, case, N) for case in paths.cases]
    bound = step_error("int4", torch.float32)
    assert all(largest_shift(f, e).max() <= bound for f, e in zip(fast, eager))


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    return [t for step in plain_decode(model, prompt, n, Sampling(), set()) for t in step.tokens]


def shipped_draft(model):
    """The shipped Hydra heads on their grown 8-node tree, with context candidates (as
    generate.py decodes, its tree's size fixed so that the run does not hang on timings)."""
    heads = decoding_heads(str(DEFAULT_HEADS_DIR), model)
    nodes, _ = grow_tree(read_calibration(DEFAULT_HEADS_DIR), 8)
    tree = build_tree(nodes, heads.config.medusa_num_heads, ranked_vocab_size(heads, model),
                      model.embed.weight.device)
    draft, budget = fixed(heads, tree)
    return wrapped(draft, heads, True), budget


# every fast step's, the reading path's (float32 eager) and CUDA's eager one: the other CPU
# formats' eager steps differ from the reading path only in their products, whose rows of
# several tokens the plain steps' prefill checks above (and their Medusa, on toys:
# test_lossless_matrix.py)
TREE_PATHS = [path for path in PATHS
              if path[2] != "eager" or path[1] == "float32" or path[0] == "cuda"]


@pytest.mark.kernels
@pytest.mark.parametrize("device, fmt, step", slow_except(
    TREE_PATHS, ("cpu", "int4", "fused"), *PATHS[-2:]))
def test_each_paths_medusa_and_batch_write_the_reference_text(paths, device, fmt, step):
    """Medusa's tree step (the shipped heads) and a batch of the chats' rows (plain steps of 3
    rows), decoding freely: each batch row parts from the reference only where its margin is
    under the format's bound, and Medusa's answer is the batch row's, token for token (two
    loops, one of plain steps: lossless)."""
    model = paths.model((device, fmt, step))
    cases = paths.cases
    draft, budget = shipped_draft(model)
    batch = dict(batch_decode(model, [c["prompt_ids"] for c in cases], N, Sampling(), set(), 3))
    accepted = 0
    for i, case in enumerate(cases):
        steps = list(medusa_decode(model, draft, budget, greedy_for(torch.device(device)),
                                   case["prompt_ids"], N, set()))
        medusa = [t for s in steps for t in s.tokens]
        accepted += len(medusa) - len(steps)
        assert medusa == batch[i], case["kind"]
        assert parting(batch[i], case["output_ids"], case["top2_margin"],
                       format_named(fmt).error) is None, case["kind"]
    assert accepted > 0  # the tree step ran with candidates accepted, not plain steps only


# --- negative controls: steps broken as steps break (conftest.BROKEN) ---------------------

@pytest.fixture
def float32_model(paths):
    """The float32 model, eager (the file's one, loaded once); its blocks put back after a
    test that breaks them."""
    model = paths.model(("cpu", "float32", "eager"))
    blocks = model.layers
    yield model
    model.layers = blocks


@pytest.mark.parametrize("kind, fmt", slow_except(BROKEN, BROKEN[3]))  # the subtlest by default
def test_a_broken_step_fails_the_logits_rule(float32_model, reference, reference_logits,
                                             kind, fmt):
    """A float32 model with a broken step, held to the loosest bound it breaks (int8's, for
    the gross breaks; float32's for activations rounded to bfloat16, which bfloat16 does)."""
    fast = broken(float32_model, kind)
    cases = reference["greedy"]["cases"]
    with pytest.raises(AssertionError):  # within the chats' first 12 positions
        assert_keeps_the_reference([forced_logits(fast, c, 12) for c in cases],
                                   reference_logits, cases, format_named(fmt).error)


@pytest.mark.parametrize("kind", slow_except([kind for kind, fmt in BROKEN if fmt == "int8"],
                                             BROKEN[1][0]))
def test_a_broken_float32_step_fails_the_margin_rule_on_its_own_text(float32_model,
                                                                     reference, kind):
    """The same steps decoding freely, held to float32's bound: their text parts from the
    reference where it was sure. Text alone is the weaker check (keys written one slot early
    still write the coding chat's 48 tokens; activations rounded to bfloat16 all three chats),
    which is why the logits rule holds every position above."""
    fast = broken(float32_model, kind)
    partings = [parting(plain_greedy(fast, c["prompt_ids"], 8), c["output_ids"],
                        c["top2_margin"], format_named("float32").error)
                for c in reference["greedy"]["cases"]]  # within 8 tokens
    assert any(p is not None for p in partings)


# a gross break and a subtle one: the fallback is the same whatever broke the step
@pytest.mark.parametrize("kind, fmt", [BROKEN[2], BROKEN[3]])
def test_a_step_that_fails_the_check_falls_back_to_the_eager_step(float32_model, reference,
                                                                  kind, fmt, capsys):
    model = float32_model
    ids = reference["greedy"]["cases"][0]["prompt_ids"]
    eager = probe_logits(model, ids)
    how = checked_step(broken(model, kind), "compiled (warm-up 1.0 s)", ids)
    assert how.startswith("eager") and type(model.layers) is Blocks
    assert "failed" in how and capsys.readouterr().err.count("\n") == 1
    assert torch.equal(probe_logits(model, ids), eager)  # the eager step's, to the bit


@pytest.mark.kernels
def test_a_fast_step_that_passes_the_check_is_kept(paths, reference):
    model = paths.model(("cpu", "int4", "fused"))
    ids = reference["greedy"]["cases"][0]["prompt_ids"]
    assert checked_step(model, "fused", ids) == "fused" and model.weight_format.name == "int4"


def test_generate_falls_back_to_eager_where_its_step_fails(monkeypatch, capsys):
    """generate.py with a broken step plugged in: one notice line, and the eager step's
    answer (the reference's: "The capital of France is Paris.")."""
    from minimedusa.assembly import recipe
    real = recipe.plug_in

    def plug_in_broken(model, weight_format, compile_flag):
        real(model, weight_format, compile_flag)
        broken(model, LastBlockSkipped)
        return "compiled (warm-up 0.0 s)"
    monkeypatch.setattr(recipe, "plug_in", plug_in_broken)
    generate_main(["--prompt", "What is the capital of France?", "--dtype", "float32",
                   "--no-compile", "--baseline", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert out.startswith("The capital of France is Paris.")
    notices = [line for line in err.splitlines() if line.startswith("minimedusa:")]
    assert len(notices) == 1 and "decoding eagerly" in notices[0]
    assert "(the fast step failed the reference check) step" in err  # the summary says so


@pytest.mark.slow
def test_the_avx2_paths_keep_the_reference_run_as_an_avx2_cpu():
    """This file's plain-step checks of the AVX2 CPU's paths (float32 compiled, whose every
    logit was NaN there: inductor's cache handed it code of another vector width; w4a8 fused,
    its default) in a process run as one (machine.AVX2_ENVIRONMENT: the C kernels built for
    Haswell, torch's own held to AVX2), as a user's AVX2 laptop runs them."""
    if not {"avx2", "fma"} <= set(cpu_features().split("+")):
        pytest.skip("this CPU has no AVX2 and FMA")
    selection = "plain_step and (float32-compiled or w4a8-fused)"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           __file__, "-k", selection, "-m", "slow or not slow"],  # both slow
                          capture_output=True, text=True,
                          env={**os.environ, **AVX2_ENVIRONMENT}, cwd=REPO, timeout=900)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:]

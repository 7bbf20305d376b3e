"""generate.py as a user runs it: the real model end to end, one clear line (no traceback,
non-zero exit) for each kind of bad input, and one line where the machine falls short (a C
kernel that does not build, a cache folder that cannot be written) while the decoding goes on.
Whole processes where how it starts matters; its main in the test's process elsewhere."""
from argparse import Namespace
import json
import os
import subprocess
import sys

import pytest
import torch

from generate import main as generate_main
from helpers import REPO, model_folder, tiny_model
from minimedusa.errors import UserError
from minimedusa.cli.acceptance_rule import acceptance_kind
from minimedusa.assembly.load import device_and_format
from minimedusa.speed import attention_kernel, group_kernel
from minimedusa.speed.compiled_step import compiler_problem
from minimedusa.heads import MedusaHeads
from minimedusa.files.heads_files import save_heads

# these tests time steps and read their cache: each its own folder (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_latency_cache")


def generate(*args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "generate.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def tiny_folder(tmp_path, default_model_dir):
    """A tiny random Llama (context 64) with the real tokenizer, as an HF folder."""
    return model_folder(tmp_path / "tiny", default_model_dir, 64)


def test_json_output_matches_the_reference_greedy_continuation(reference):
    case = reference["greedy"]["cases"][0]
    done = generate("--prompt", case["messages"][0]["content"], "--max-new-tokens", "16",
                    "--json", "--device", "cpu", "--dtype", "float32", "--baseline",
                    "--no-compile")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["prompt_ids"] == case["prompt_ids"]
    assert result["output_ids"] == case["output_ids"][:16]
    assert result["new_tokens"] == result["steps"] == 16
    assert result["text"] and result["tokens_per_s"] > 0 and result["seconds"] > 0
    assert "tokens/s" in done.stderr


def test_generate_streams_text_on_the_tiny_model(tiny_folder):
    done = generate("--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "5",
                    "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--no-compile")
    assert done.returncode == 0, done.stderr
    assert "5 tokens" in done.stderr


def main_output(capsys, *args) -> tuple[str, str]:
    """(stdout, stderr) of generate.py's main run in this process: a test that checks what a
    run prints, not how the process starts, skips a process's ~3 s of imports."""
    generate_main(list(args))
    done = capsys.readouterr()
    return done.out, done.err


def assert_main_error(capsys, args, *needles):
    """generate.py's main, run in this process on bad input, ends in one line naming the
    problem (its exception a SystemExit, not a traceback); the line printed by an argparse
    error or carried by the SystemExit. A whole process doing so:
    test_missing_weights_file_gives_one_clear_line."""
    with pytest.raises(SystemExit) as stop:
        generate_main(list(args))
    code = stop.value.code
    lines = capsys.readouterr().err.strip().splitlines() + (
        [] if code is None or isinstance(code, int) else str(code).splitlines())
    assert code not in (0, None) and len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def assert_one_line_error(done, *needles):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("flags, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--model", "/no/such/folder"], "/no/such/folder"),
    (["--seed", str(2**64)], "--seed"),  # past torch's 64-bit generator
    (["--seed", "-1"], "--seed"),
    (["--seed", str(10**40)], "--seed"),
])
def test_bad_flags_give_one_clear_line(tiny_folder, flags, needle, capsys):
    model = [] if "--model" in flags else ["--model", str(tiny_folder)]
    assert_main_error(capsys, ["--prompt", "Hi", *model, *flags], needle)


def test_prompt_longer_than_the_context_gives_one_clear_line(tiny_folder, capsys):
    assert_main_error(capsys, ["--model", str(tiny_folder), "--raw", "--prompt", "word " * 100],
                      "context is 64 tokens")


def test_missing_weights_file_gives_one_clear_line(tiny_folder):
    (tiny_folder / "model.safetensors").unlink()
    assert_one_line_error(generate("--model", str(tiny_folder), "--prompt", "Hi"),
                          "missing weights file")


def test_truncated_weights_file_gives_one_clear_line(tiny_folder, capsys):
    path = tiny_folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi"], "truncated")


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
    (lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "only runs Llama"),
])
def test_bad_config_gives_one_clear_line(tiny_folder, edit, needle, capsys):
    config = json.loads((tiny_folder / "config.json").read_text())
    edit(config)
    (tiny_folder / "config.json").write_text(json.dumps(config))
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi"], needle)


@pytest.mark.slow  # a process's memory, measured: CI's -m slow run
def test_generate_peak_memory_beyond_torch_stays_below_1_3_gb(default_model_dir):
    """Peak resident memory of a whole generate.py run on the default model (CPU, its default
    format), less what importing torch takes before it (218 MiB for the CPU wheel, 496 for a
    CUDA build, measured: a build's libraries are not generate.py's to shrink). Read from
    /proc (VmHWM, this process's own memory since exec): ru_maxrss would also count the pytest
    process it was forked from, large after tests that loaded models."""
    probe = ("import sys, torch; hwm = lambda: int(open('/proc/self/status').read()"
             ".split('VmHWM:')[1].split()[0]); torch_kb = hwm(); import runpy; "
             "sys.argv = ['generate.py', '--prompt', 'Hi', '--max-new-tokens', '16', "
             "'--device', 'cpu']; runpy.run_path('generate.py', run_name='__main__'); "
             "print(hwm() - torch_kb, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    grown_kb = int(done.stderr.strip().splitlines()[-1])  # VmHWM is in kB
    assert grown_kb < 1.3 * 1024 * 1024, f"{grown_kb / 1024:.0f} MiB beyond torch's own"


# note: --no-compile where what a test checks does not depend on the step (compiled steps:
# test_compiled_step.py; the default flags: the tests around these): each process then skips
# its ~5 s of torch.compile start-up and warm-up

@pytest.mark.kernels
def test_medusa_json_reports_steps_acceleration_and_histogram(tiny_folder, capsys):
    out, _ = main_output(capsys, "--model", str(tiny_folder), "--prompt", "Hi",
                         "--max-new-tokens", "12", "--heads", "untrained:3", "--tree", "chain3",
                         "--json", "--no-compile")
    result = json.loads(out)
    assert result["mode"].startswith("medusa heads, tree chain3 (3 nodes, --tree)")
    assert result["new_tokens"] == 12
    assert sum(int(n) * c for n, c in result["accepted_histogram"].items()) == 12
    assert result["acceleration_rate"] == pytest.approx(12 / result["steps"], abs=1e-3)


@pytest.mark.kernels
def test_medusa_greedy_cli_output_equals_baseline(tiny_folder, capsys):
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "10", "--json",
            "--no-compile"]
    medusa = json.loads(main_output(capsys, *args, "--heads", "untrained:4", "--tree",
                                    "cpu_8")[0])
    plain = json.loads(main_output(capsys, *args, "--heads", "untrained:4", "--baseline")[0])
    assert medusa["output_ids"] == plain["output_ids"] and plain["mode"] == "plain"


@pytest.mark.kernels
def test_the_step_is_compiled_where_it_can_be_and_eager_otherwise(tiny_folder, capsys):
    """By default the decoding step is compiled where torch.compile works (in float32: a
    bfloat16 model's step is fused where group_kernel.c multiplies it); --no-compile keeps it
    eager."""
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "4", "--json",
            "--device", "cpu", "--dtype", "float32"]
    compiles = compiler_problem() is None
    default = json.loads(main_output(capsys, *args)[0])
    assert default["step"].startswith("compiled (warm-up" if compiles else "eager")
    eager = json.loads(main_output(capsys, *args, "--no-compile")[0])
    assert eager["step"] == "eager (--no-compile)"


@pytest.mark.kernels
@pytest.mark.slow  # a process of its own
def test_without_a_working_compiler_the_step_stays_eager_and_says_why(tiny_folder, tmp_path):
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "4", "--json",
            "--device", "cpu", "--dtype", "float32"]
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    broken = subprocess.run([sys.executable, str(REPO / "generate.py"), *args],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert broken.returncode == 0, broken.stderr
    assert json.loads(broken.stdout)["step"] == "eager (no working compiler)"
    assert "torch.compile does not work here, decoding eagerly" in broken.stderr


@pytest.mark.kernels
def test_default_tree_size_adapts_and_the_summary_says_which_and_why(tiny_folder, capsys):
    """Without --tree the budget picks each step's size (plain included) from latencies it
    measured here at load time, which is reported apart from the decoding's seconds; the
    output stays plain greedy's. (Eager steps: the compiled ones are
    test_the_step_is_compiled_where_it_can_be_and_eager_otherwise's.)"""
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "10", "--json",
            "--heads", "untrained:4", "--no-compile"]
    out, err = main_output(capsys, *args)
    medusa, plain = json.loads(out), json.loads(main_output(capsys, *args, "--baseline")[0])
    assert medusa["output_ids"] == plain["output_ids"]
    assert medusa["mode"].startswith("medusa heads, tree of ")
    assert "steps by size: " in medusa["mode"] and "latencies measured here" in medusa["mode"]
    assert medusa["load_seconds"] > 0 and "not counted" in err
    again = json.loads(main_output(capsys, *args)[0])  # a second run reads the cache file
    assert "latencies cached" in again["mode"]


@pytest.mark.kernels
@pytest.mark.parametrize("tree", ["ranked:5", "ranked"])
def test_confidence_ranked_trees_decode_as_the_baseline(tiny_folder, tree, capsys):
    """ranked:N, each step's N most probable nodes; ranked, N chosen by the budget."""
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "10", "--json",
            "--heads", "untrained-hydra:3", "--no-compile"]
    ranked = json.loads(main_output(capsys, *args, "--tree", tree)[0])
    plain = json.loads(main_output(capsys, *args, "--baseline")[0])
    assert ranked["output_ids"] == plain["output_ids"]
    assert ranked["mode"].startswith("hydra heads, confidence-ranked tree of ")
    assert_main_error(capsys, [*args, "--tree", "ranked:0"], "use ranked:N with N >= 1")


@pytest.mark.parametrize("tree", ["ranked:100000", "dense:100,100,100"])
def test_a_tree_past_the_bound_gives_one_clear_line(tiny_folder, tree, capsys):
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi", "--heads",
                               "untrained:3", "--tree", tree, "--no-compile"],
                      tree, "at most 1024")


def test_ctrl_c_while_torch_loads_ends_in_one_line():
    """A Ctrl-C during generate.py's imports (torch takes seconds to load), simulated as a
    KeyboardInterrupt raised by the import of torch."""
    script = ("import builtins, runpy, sys\n"
              "real = builtins.__import__\n"
              "def ctrl_c(name, *args, **kwargs):\n"
              "    if name == 'torch':\n"
              "        raise KeyboardInterrupt\n"
              "    return real(name, *args, **kwargs)\n"
              "builtins.__import__ = ctrl_c\n"
              f"sys.argv = ['generate.py', '--prompt', 'Hi']\n"
              f"runpy.run_path({str(REPO / 'generate.py')!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode != 0 and done.stderr.strip() == "interrupted", done.stderr


def test_malformed_tree_file_gives_one_clear_line(tiny_folder, tmp_path, capsys):
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [1, 0]]")
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi", "--heads",
                               "untrained:2", "--tree", str(tree)],
                      "node path [1, 0] has no parent")


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "[[[0]]]", "[[0], [true]]",
                                  "[[0], [-1]]", '[[0], ["a"]]', "[[0], [0.5]]", '{"a": 1}', "7"])
def test_a_tree_file_of_another_shape_gives_one_clear_line(tiny_folder, tmp_path, text,
                                                           capsys):
    """Lists nested past a node path's (thousands deep: JSON's reader recursed out), entries
    that are not integers >= 0, a file that holds no list."""
    tree = tmp_path / "tree.json"
    tree.write_text(text)
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi", "--heads",
                               "untrained:2", "--tree", str(tree)], str(tree))


def test_tree_deeper_than_the_heads_gives_one_clear_line(tiny_folder, capsys):
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi", "--heads",
                               "untrained:2", "--tree", "chain5"], "only 2 Medusa heads")


def test_heads_for_another_model_give_one_clear_line(tiny_folder, tmp_path, capsys):
    other = tiny_model(dtype=torch.float32, hidden_size=48, vocab_size=49152)
    save_heads(MedusaHeads.for_model(other, 2), tmp_path / "heads")
    assert_main_error(capsys, ["--model", str(tiny_folder), "--prompt", "Hi", "--heads",
                               str(tmp_path / "heads")],
                      "hidden_size is 48 but the model's is 32")


@pytest.mark.kernels
@pytest.mark.slow  # a second graph compiled: half a minute of the default run
def test_a_kernel_that_cannot_be_built_is_named_in_one_line(tiny_folder, monkeypatch, capsys):
    """With a C compiler that fails, the compiled step attends in PyTorch, and the summary
    line says so and why."""
    if compiler_problem() is not None:
        pytest.skip(f"torch.compile does not work here: {compiler_problem()}")
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(attention_kernel, "_kernel", {})  # built anew, by that compiler
    generate_main(["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "4",
                   "--device", "cpu"])
    summary = capsys.readouterr().err.splitlines()[-1]
    assert ("compiled (warm-up" in summary and "; attention in PyTorch, no C kernel: "
            "RuntimeError: /bin/false failed (exit status 1))" in summary), summary


@pytest.mark.parametrize("cpu_has_it", [True, False])
def test_int4_names_its_missing_kernel_only_where_the_cpu_could_run_it(
        cpu_has_it, tiny_folder, monkeypatch, capsys):
    """group_kernel.c needs AVX-512 BF16 or AVX2: on such a CPU a kernel that does not build is a
    fault, named in one line; elsewhere torch's int4 kernel is the normal case, and quiet."""
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(group_kernel, "_kernel", {})  # built anew, by that compiler
    monkeypatch.setattr(group_kernel, "expected_here", lambda: cpu_has_it)
    generate_main(["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "4",
                   "--quantize", "int4", "--no-compile"])
    lines = capsys.readouterr().err.splitlines()
    assert "int4 weights" in lines[-1]
    notices = [line for line in lines if "int4's C kernel" in line]
    assert notices == (["minimedusa: int4's C kernel (group_kernel.c) is not available here "
                        "(RuntimeError: /bin/false failed (exit status 1)); torch's int4 kernel "
                        "multiplies instead (slower)"] if cpu_has_it else [])


def test_w4a8_without_the_kernel_is_one_line(tiny_folder, monkeypatch):
    monkeypatch.setattr(group_kernel, "_kernel", {"problem": "RuntimeError: no compiler"})
    with pytest.raises(SystemExit) as stop:
        generate_main(["--model", str(tiny_folder), "--prompt", "Hi", "--quantize", "w4a8"])
    assert str(stop.value) == ("error: --quantize w4a8 multiplies in group_kernel.c only, which "
                               "does not here: RuntimeError: no compiler")


def test_the_cpu_formats_run_on_the_cpu_where_auto_would_pick_a_gpu(tiny_folder, monkeypatch):
    """--quantize's formats multiply on a CPU: --device auto takes it on a GPU machine too
    (first seen on one: it refused), and an explicit GPU is one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as auto sees
    flags = dict(threads=None, dtype="auto", quantize="int8")
    device, weight_format = device_and_format(Namespace(device="auto", **flags), tiny_folder)
    assert (device.type, weight_format.name) == ("cpu", "int8")
    with pytest.raises(UserError, match="--quantize int8 runs on a CPU"):
        device_and_format(Namespace(device="cuda", **flags), tiny_folder)


@pytest.mark.kernels
def test_an_unwritable_latency_cache_still_decodes_and_says_so(tiny_folder, tmp_path,
                                                                monkeypatch, capsys):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path / "cache"))
    args = ["--model", str(tiny_folder), "--prompt", "Hi", "--max-new-tokens", "6",
            "--heads", "untrained:2", "--no-compile", "--json"]
    generate_main(args)
    medusa, err = capsys.readouterr()
    generate_main([*args, "--baseline"])
    assert json.loads(medusa)["output_ids"] == json.loads(capsys.readouterr().out)["output_ids"]
    [notice, summary] = err.splitlines()
    assert notice.startswith(f"minimedusa: the cache folder {tmp_path / 'cache'} cannot be "
                             "written (")
    assert notice.endswith("set MINIMEDUSA_CACHE to a writable folder")
    assert "latencies measured here" in summary


@pytest.mark.parametrize("acceptance, temperature, tree, kind", [
    ("auto", 0.0, None, "greedy"), ("auto", 0.7, None, "speculative"),
    ("auto", 0.7, "ranked", "rejection"), ("auto", 0.7, "ranked:8", "rejection"),
    ("rejection", 0.7, None, "rejection"), ("rejection", 0.0, None, "greedy"),
    ("speculative", 0.0, None, "greedy"), ("typical", 0.7, "ranked", "typical"),
    ("auto", 0.7, "mc_sim_7b_63", "speculative")])
def test_acceptance_flags_pick_the_rule(acceptance, temperature, tree, kind):
    args = Namespace(acceptance=acceptance, temperature=temperature, tree=tree)
    assert acceptance_kind(args) == kind


@pytest.mark.parametrize("acceptance, tree", [("greedy", None), ("speculative", "ranked")])
def test_acceptance_flags_that_contradict_fail_in_one_line(acceptance, tree):
    args = Namespace(acceptance=acceptance, temperature=0.7, tree=tree)
    with pytest.raises(UserError, match="--acceptance"):
        acceptance_kind(args)

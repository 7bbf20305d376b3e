"""The benchmark end to end on a tiny model: every engine runs on every question, Medusa greedy
reproduces plain greedy, and the report holds the paper's metrics per category and overall.
MT-Bench is not in the repository, so these tests time the project's held-out seed prompts,
whatever lies beside the clone, and give MT-Bench's shape as a small file of their own."""
import json
import re

import pytest

from helpers import broken, LastBlockSkipped, model_folder
from minimedusa.bench import bench, processes as bench_generate, questions as bench_questions
from minimedusa.files.heads_files import CALIBRATION, save_heads
from minimedusa.heads import MedusaHeads
from minimedusa.training.pipeline import CPU_PROMPTS
from minimedusa.training.seed_prompts import seed_prompts
from minimedusa.assembly.device import pick_device
from minimedusa.assembly.load import machine_format
from minimedusa.files.weights import load_model, save_model


@pytest.fixture(autouse=True)
def no_mt_bench(tmp_path, monkeypatch):
    """No MT-Bench at the default place, as in a clone with nothing beside it."""
    monkeypatch.setattr(bench_questions, "MT_BENCH",
                        tmp_path / "absent" / "mt_bench_questions.jsonl")


@pytest.fixture
def tiny_folder(tmp_path, default_model_dir):
    """A tiny random Llama with the real tokenizer and chat template, long enough a context for
    MT-Bench prompts."""
    return model_folder(tmp_path / "tiny", default_model_dir, 2048)


@pytest.mark.kernels
def test_quick_bench_reports_every_engine_per_category(tmp_path, tiny_folder):
    """--quick times every engine on each category's question; eager (--no-compile): the
    compiled step's own tests compile, and its ~15 s warm-up would be most of this test's."""
    folder = tiny_folder
    bench.main(["--quick", "--model", str(folder), "--heads", "untrained-shared:3",
                "--tree", "chain3", "--threads", "1", "--no-compile",
                "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    engines = {"plain", "plain T=0.7", "medusa greedy", "medusa typical T=0.7",
               "medusa rejection T=0.7", "medusa speculative T=0.7"}
    assert set(result["totals"]) == engines
    assert len(result["per_category"]) == 8 and len(result["questions"]) == 8
    greedy = result["totals"]["medusa greedy"]
    assert greedy["identical"] == 8  # lossless: greedy Medusa == plain greedy
    assert all(t["tokens"] == 8 * 32 for t in result["totals"].values())
    for totals in result["per_category"].values():
        for t in totals.values():
            assert t["speedup"] == round(t["tokens_per_s"] / totals["plain"]["tokens_per_s"], 3)
            assert t["acceleration_rate"] >= 1.0


QUICK_GREEDY = ["--quick", "--heads", "untrained-shared:3", "--tree", "chain3", "--threads", "1",
                "--no-compile", "--no-sampling"]


@pytest.mark.kernels
def test_every_greedy_engine_is_held_to_the_reference_text(tmp_path, tiny_folder, capsys):
    bench.main(QUICK_GREEDY + ["--model", str(tiny_folder), "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    assert all(t["same_as_reference"] == 8 for t in result["totals"].values())
    out = capsys.readouterr().out
    assert out.startswith("reference check: all 2 greedy engines wrote the eager float32 text")
    assert "| same as plain | same as the reference |" in out


@pytest.mark.kernels
def test_a_broken_step_fails_the_reference_column_though_it_equals_plain(tmp_path, tiny_folder,
                                                                         monkeypatch, capsys):
    """A step broken in both engines alike: "same as plain" passes, the reference fails it, and
    the report's first line says so. On the tiny model with its LM head scaled up: a random
    model's top two tokens are nearly tied everywhere, and a parting there is forgiven."""
    model = load_model(tiny_folder)
    model.lm_head.weight.data.mul_(100)  # its margins 100 times wider
    save_model(model, tiny_folder)
    real = bench.decoding_model

    def broken_model(*args, **kwargs):
        model, step = real(*args, **kwargs)
        return broken(model, LastBlockSkipped), step
    monkeypatch.setattr(bench, "decoding_model", broken_model)
    bench.main(QUICK_GREEDY + ["--model", str(tiny_folder), "--out", str(tmp_path / "b.json")])
    totals = json.loads((tmp_path / "b.json").read_text())["totals"]
    assert totals["medusa greedy"]["identical"] == 8
    assert totals["plain"]["same_as_reference"] < 8
    assert capsys.readouterr().out.startswith("REFERENCE CHECK FAILED: plain (")


@pytest.mark.slow  # a draft model's text: test_speculative_decoding.py's, by default
@pytest.mark.kernels
def test_draft_engines_write_float32_plains_text(tmp_path, tiny_folder):
    """--draft int8: float32 plain, float32 verifying its int8 rounding's drafts, drafted
    plainly and with the heads: the same answers as float32 plain, and the reference's."""
    bench.main(QUICK_GREEDY + ["--model", str(tiny_folder), "--draft", "int8",
                               "--out", str(tmp_path / "b.json")])
    totals = json.loads((tmp_path / "b.json").read_text())["totals"]
    drafted = ["[float32] drafted by int8", "[float32] drafted by int8 with heads"]
    assert {"[float32] plain", *drafted} <= set(totals)
    for name in drafted:
        assert totals[name]["identical"] == totals[name]["same_as_reference"] == 8
        assert totals[name]["acceleration_rate"] > 1.0  # drafts were kept


@pytest.mark.slow  # --profile's two tests: CI's -m slow run
@pytest.mark.kernels
def test_profile_shows_where_a_plain_and_a_medusa_step_spend_time(tiny_folder, capsys):
    bench.main(["--profile", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                "--tree", "chain3", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("plain: ") and "\nmedusa greedy: " in out
    assert "aten::" in out  # the operator table
    assert "\na forward of M rows" in out and "\nproducts" in out  # row count by row count
    assert "\nsteps by tree size: the heads have no calibration.json" in out  # untrained heads


@pytest.mark.slow  # --profile's two tests: CI's -m slow run
@pytest.mark.kernels
def test_profile_times_a_whole_step_and_its_draft_at_each_tree_size(tiny_folder, tmp_path,
                                                                    capsys):
    """With calibrated heads, --profile also times a step at each size grown from them, 8- and
    16-row steps included, against a plain step, after a short and a long context; and the
    heads' draft alone at each size."""
    heads = MedusaHeads.for_model(load_model(tiny_folder), 3, shared_lm_head=True)
    save_heads(heads, tmp_path)
    (tmp_path / CALIBRATION).write_text(json.dumps({"accuracy": [[0.6, 0.2, 0.1]] * 3}))
    bench.main(["--profile", "--model", str(tiny_folder), "--heads", str(tmp_path),
                "--tree", "chain3", "--threads", "1"])
    *lines, drafts = capsys.readouterr().out.splitlines()[-3:]
    assert lines[0].startswith("a whole step after 256 cached tokens, ms (x a plain step): plain ")
    # and after a long context: 1536 tokens, or half of a short one (this model's 2048)
    assert lines[1].startswith("a whole step after 1024 cached tokens, ms (x a plain step): ")
    assert all("7 nodes (8 rows)" in line and "16 nodes (17 rows)" in line for line in lines)
    assert drafts.startswith("the heads' draft alone, ms (its depths): 1 nodes ")
    assert " 7 nodes " in drafts and drafts.endswith("(3)")  # 16 nodes of 3 heads: depth 3


def test_bad_tree_is_one_line_not_a_traceback(tiny_folder):
    with pytest.raises(SystemExit, match="^error: unknown tree 'bogus'"):
        bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                    "--tree", "bogus", "--threads", "1"])


@pytest.mark.kernels
def test_quick_bench_adapts_the_tree_size_and_reports_the_steps_at_each(tmp_path, tiny_folder):
    """Without --tree the Medusa engines decode as generate.py does, the budget choosing each
    step's size; still lossless, and the report says which sizes ran how often, and what
    guessed each token (every token once; the model's own at most one a step)."""
    bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                "--no-sampling", "--threads", "1", "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["totals"]["medusa greedy"]["identical"] == 8
    steps = result["steps_by_tree_size"]["medusa greedy"]
    assert sum(steps.values()) == result["totals"]["medusa greedy"]["steps"] - 8  # - prefills
    origins = result["tokens_by_origin"]["medusa greedy"]
    totals = result["totals"]["medusa greedy"]
    assert sum(origins.values()) == totals["tokens"]
    assert 0 < origins["model"] <= totals["steps"]
    assert set(origins) <= {"model", "context", *map(str, range(1, 4))}
    device = pick_device("auto")  # the GPU where there is one
    fmt = machine_format(device, tiny_folder)
    assert result["machine"].startswith(f"{device.type}/{fmt.name}/")


def test_generate_processes_compare_default_flags_with_baseline(tiny_folder):
    """--generate: generate.py as a user runs it, once per question, both ways, interleaved,
    the baseline with its own extra flags, and an in-process engine timed between them;
    --no-compile passed on to both (the compiled step's own tests compile)."""
    args = bench.parse_args(["--generate", "--rounds", "1", "--max-new-tokens", "6",
                             "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                             "--threads", "1", "--dtype", "float32", "--no-compile",
                             "--baseline-flags", "--seed 1"])
    question = {"id": 1, "category": "writing", "prompt": "Hi"}
    asked = []

    def other(ids, n, seed):
        asked.append(ids)
        return [0] * n, 0.5, n
    totals = bench_generate.generate_processes(args, [question],
                                               {"other": (other, lambda p: [len(p)])})
    assert totals["default"]["tokens"] == totals["baseline"]["tokens"] == 6
    assert totals["default"]["modes"][0].startswith("medusa heads, tree of ")
    assert totals["baseline"]["modes"] == ["plain"]
    assert (totals["baseline"]["formats"][0] == totals["default"]["formats"][0]
            == "float32 eager (--no-compile)")  # both processes were given it
    assert asked == [[2]] and totals["other"]["tokens_per_s"] == 12.0
    assert totals["speedup"] > 0 and totals["wall_ratio"] > 0
    assert totals["other"]["vs_baseline"] > 0
    assert totals["identical"] == "1/1"  # float32 both ways: greedy Medusa is plain greedy


@pytest.mark.slow  # --generate's processes by default: the test above
def test_generate_processes_time_several_heads_side_by_side(tiny_folder):
    """--generate with --heads repeated (old heads beside new): a default process for each
    heads, each compared with the baseline and the others with the first, a tokens/s ratio and
    a tokens-a-step ratio; greedy, each identical to plain."""
    args = bench.parse_args(["--generate", "--rounds", "1", "--max-new-tokens", "6",
                             "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                             "--heads", "untrained-hydra:2", "--threads", "1",
                             "--dtype", "float32", "--no-compile"])
    question = {"id": 1, "category": "writing", "prompt": "Hi"}
    totals = bench_generate.generate_processes(args, [question], {})
    other = totals["default --heads untrained-hydra:2"]
    assert ": 3 heads)" in totals["default"]["modes"][0]  # each process its own heads
    assert ": 2 heads)" in other["modes"][0]
    assert other["tokens"] == totals["default"]["tokens"] == totals["baseline"]["tokens"] == 6
    assert other["vs_default"] == round(other["tokens_per_s"] /
                                        totals["default"]["tokens_per_s"], 3)
    assert other["steps_vs_default"] == round(other["tokens_per_step"] /
                                              totals["default"]["tokens_per_step"], 3)
    assert other["identical"] == totals["default"]["identical"] == totals["identical"] == "1/1"
    assert "vs_default" not in totals["default"]


@pytest.mark.slow  # engines side by side by default: the quick bench's test
@pytest.mark.kernels
def test_formats_are_timed_side_by_side_each_lossless_against_its_own_plain(tmp_path, tiny_folder):
    """--formats: '[int8] plain' and '[int8] medusa greedy' beside the main format's engines,
    each Medusa engine identical to plain decoding in its own format; every engine's bytes of
    weights per step (int8 about a quarter of float32's) and the machine's streaming bandwidth
    are reported. Eager (--no-compile), as the quick bench's test."""
    bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                "--no-sampling", "--threads", "1", "--formats", "float32,int8", "--no-compile",
                "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    totals = result["totals"]
    assert {"[float32] plain", "[float32] medusa greedy", "[int8] plain",
            "[int8] medusa greedy"} <= set(totals)
    assert all(t["identical"] == 8 for n, t in totals.items() if "] " in n)
    assert totals["[int8] plain"]["weight_bytes"] < totals["[float32] plain"]["weight_bytes"] / 3
    assert totals["[int8] medusa greedy"]["weight_bytes"] > totals["[int8] plain"]["weight_bytes"]
    assert result["memory_bandwidth"]["read_gb_s"] > 0
    assert all(t["gb_s"] > 0 for t in totals.values())


def test_unknown_format_is_one_line_not_a_traceback(tiny_folder):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                    "--formats", "int3"])


def test_bench_without_mt_bench_times_the_projects_own_prompts_and_says_so(capsys):
    """Two held-out seed prompts in each of MT-Bench's 8 categories, none of them a prompt the
    shipped heads (or a CPU run of train.py) trained on, and one line on stderr saying so."""
    questions = bench_questions.questions_to_time(None, 2)
    assert [q["category"] for q in questions] == [c for c in bench_questions.CATEGORIES
                                                  for _ in range(2)]
    trained_on = {p["prompt"] for p in seed_prompts()[:CPU_PROMPTS]}
    assert not trained_on & {q["prompt"] for q in questions}
    assert all(q["id"].startswith("seed-") for q in questions)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"minimedusa: MT-Bench questions not found at "
                          f"{bench_questions.MT_BENCH}; timing the project's own held-out seed "
                          "prompts")


def test_questions_given_are_timed_first_turn_first_per_category(tmp_path, capsys):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": 10 * c + i, "category": category,
                                        "turns": [f"{category} {i}?", "and then?"]}) + "\n"
                            for c, category in enumerate(("writing", "math")) for i in range(3)))
    questions = bench_questions.questions_to_time(path, 2)
    assert questions == [{"id": 0, "category": "writing", "prompt": "writing 0?"},
                         {"id": 1, "category": "writing", "prompt": "writing 1?"},
                         {"id": 10, "category": "math", "prompt": "math 0?"},
                         {"id": 11, "category": "math", "prompt": "math 1?"}]
    assert capsys.readouterr().err == f"questions: MT-Bench first turns from {path}\n"


def test_missing_questions_given_are_one_line_not_a_fallback(tiny_folder, tmp_path):
    missing = tmp_path / "question.jsonl"
    with pytest.raises(SystemExit, match=f"^error: MT-Bench questions not found at "
                                         f"{re.escape(str(missing))}$"):
        bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                    "--questions", str(missing), "--threads", "1"])


@pytest.mark.slow  # --generate's processes by default: the two tests above
def test_generate_processes_pass_flags_to_both_and_default_flags_to_the_default(tiny_folder):
    args = bench.parse_args(["--generate", "--rounds", "1", "--max-new-tokens", "4",
                             "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                             "--threads", "1", "--dtype", "float32", "--no-compile",
                             "--flags", "--temperature 0.7 --seed 1",
                             "--default-flags", "--acceptance typical"])
    question = {"id": 1, "category": "writing", "prompt": "Hi"}
    totals = bench_generate.generate_processes(args, [question], {})
    assert "typical(T=0.7" in totals["default"]["modes"][0]
    assert totals["baseline"]["modes"] == ["plain"]

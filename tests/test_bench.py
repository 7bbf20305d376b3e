"""The benchmark end to end on a tiny model: every engine runs on every question, Medusa greedy
reproduces plain greedy, and the report holds the paper's metrics per category and overall."""
import json
import shutil

import pytest
import torch

from conftest import tiny_model
from minimedusa import bench
from minimedusa.weights import save_model


@pytest.fixture
def tiny_folder(tmp_path, default_model_dir):
    """A tiny random Llama with the real tokenizer and chat template, long enough a context for
    MT-Bench prompts."""
    folder = tmp_path / "tiny"
    save_model(tiny_model(dtype=torch.float32, max_position_embeddings=2048, vocab_size=49152),
               folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def test_quick_bench_reports_every_engine_per_category(tmp_path, tiny_folder):
    folder = tiny_folder
    bench.main(["--quick", "--model", str(folder), "--heads", "untrained-shared:3",
                "--tree", "chain3", "--threads", "1", "--out", str(tmp_path / "b.json")])
    result = json.loads((tmp_path / "b.json").read_text())
    engines = {"plain", "medusa greedy", "medusa typical T=0.7", "medusa rejection T=0.7"}
    assert set(result["totals"]) == engines
    assert len(result["per_category"]) == 8 and len(result["questions"]) == 8
    greedy = result["totals"]["medusa greedy"]
    assert greedy["identical"] == 8  # lossless: greedy Medusa == plain greedy
    assert all(t["tokens"] == 8 * 32 for t in result["totals"].values())
    for totals in result["per_category"].values():
        for t in totals.values():
            assert t["speedup"] == round(t["tokens_per_s"] / totals["plain"]["tokens_per_s"], 3)
            assert t["acceleration_rate"] >= 1.0


def test_profile_shows_where_a_plain_and_a_medusa_step_spend_time(tiny_folder, capsys):
    bench.main(["--profile", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                "--tree", "chain3", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("plain: ") and "\nmedusa greedy: " in out
    assert "aten::" in out  # the operator table


def test_bad_tree_is_one_line_not_a_traceback(tiny_folder):
    with pytest.raises(SystemExit, match="^error: unknown tree 'bogus'"):
        bench.main(["--quick", "--model", str(tiny_folder), "--heads", "untrained-shared:3",
                    "--tree", "bogus", "--threads", "1"])

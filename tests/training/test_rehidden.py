"""Data moved as token ids: the hidden states recomputed from them are the ones saved while
answering, and training refuses a folder of ids alone in one line."""
import pytest
import torch
from safetensors.torch import load_file

from helpers import tiny_model
from minimedusa.acceptance import Sampling
from minimedusa.training.medusa1 import DataError, stacked_hidden
from minimedusa.training.progress import progress_bar
from minimedusa.training.rehidden import main, rehidden
from minimedusa.training.self_distill import answer_batch, save_shard


@pytest.mark.parametrize("seed", [0, 1])
def test_states_recomputed_from_moved_ids_are_the_ones_saved_while_answering(seed, tmp_path):
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    # prompts of several lengths: the recomputing forward pads the short rows
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]
    (tmp_path / "src").mkdir()
    for shard, batch in enumerate((prompts[:3], prompts[3:])):
        rows = answer_batch(model, batch, 10, Sampling(), {int(seed % 64)}, None)
        save_shard(tmp_path / "src" / f"shard-{shard:05d}.safetensors",
                   [{"prompt_ids": p, "answer_ids": a, "hidden": h}
                    for p, (a, h) in zip(batch, rows)])
    rehidden(tmp_path / "src", tmp_path / "ids", None, progress_bar())
    rehidden(tmp_path / "ids", tmp_path / "out", model, progress_bar())
    for shard in ("shard-00000.safetensors", "shard-00001.safetensors"):
        saved, moved = load_file(tmp_path / "src" / shard), load_file(tmp_path / "ids" / shard)
        assert "hidden" not in moved
        recomputed = load_file(tmp_path / "out" / shard)
        for name in ("prompt_ids", "prompt_offsets", "answer_ids", "answer_offsets"):
            assert torch.equal(moved[name], saved[name])
            assert torch.equal(recomputed[name], saved[name])
        # float64 states rounded to bf16 twice: equal but for a rare flip of the last bit
        torch.testing.assert_close(recomputed["hidden"].double(), saved["hidden"].double(),
                                   rtol=2 ** -7, atol=0)


def test_training_refuses_ids_without_states_in_one_line(tmp_path):
    save_shard(tmp_path / "shard-00000.safetensors",
               [{"prompt_ids": [1, 2], "answer_ids": [3, 4, 5]}])
    with pytest.raises(DataError, match="token ids alone.*rehidden"):
        stacked_hidden(tmp_path, 3)


def test_folders_it_cannot_copy_end_in_one_error_line(tmp_path):
    src, out = tmp_path / "src", str(tmp_path / "out")
    src.mkdir()
    with pytest.raises(SystemExit, match="^error: no meta.json in"):
        main([str(src), "--out", out, "--ids-only"])
    (src / "meta.json").write_text("{}")
    with pytest.raises(SystemExit, match="^error: no shards in"):
        main([str(src), "--out", out, "--ids-only"])
    save_shard(src / "shard-00000.safetensors", [{"prompt_ids": [1], "answer_ids": [2, 3]}])
    with pytest.raises(SystemExit, match="^error: --out is the source folder"):
        main([str(src), "--out", str(src), "--ids-only"])
    (src / "shard-00001.safetensors").write_bytes(b"not a shard")  # truncated, or not one
    with pytest.raises(SystemExit, match="^error: .*shard-00001.safetensors"):
        main([str(src), "--out", out, "--ids-only"])

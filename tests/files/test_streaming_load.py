"""Loading streams: a model is read a block at a time and each block put in its weight format as
it comes (files/weights.load_model's convert_block), so that loading never holds the model whole
in its file's dtype, let alone in float32. Measured as what it is for a user: the peak resident
memory of a fresh process (Linux's VmHWM, reset just before the loading), on a model of 16
blocks, large enough that one block and the whole model are far apart."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO
from minimedusa.files.weights import load_model, save_model
from minimedusa.model import Llama, LlamaConfig
from minimedusa.speed.weight_formats import format_named

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="peak memory is read from Linux's /proc")

# in a fresh process: the kernels and torch's first products warmed up (their one-time memory
# is not the model's), the peak reset, the model loaded; the peak and the live bytes after
LOAD = """
import sys, torch
from pathlib import Path
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.speed import group_kernel
from minimedusa.speed.weight_formats import format_named
group_kernel.kernel_problem()
decoding_model(Recipe(folder=Path(sys.argv[1]), device=torch.device("cpu"),
                      weight_format=format_named(sys.argv[2])))
def status(key):
    return int(dict(line.split(":", 1) for line in open("/proc/self/status"))[key].split()[0])
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
model, _ = decoding_model(Recipe(folder=Path(sys.argv[1]), device=torch.device("cpu"),
                                 weight_format=format_named(sys.argv[2])))
print((status("VmHWM") - before) * 1024)
"""
CONFIG = dict(vocab_size=1024, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256,
              eos_token_id=1)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A random 16-block Llama stored in bfloat16 (a 150 MB file)."""
    folder = tmp_path_factory.mktemp("streaming") / "model"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**CONFIG))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_model(model, folder)
    return folder


def block_bytes(dtype_bytes: int) -> int:
    C, I, H, G = (CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads"))
    D = C // H
    return (C * (H + 2 * G) * D + H * D * C + 3 * C * I) * dtype_bytes


@pytest.mark.slow  # a process's memory, measured: CI's -m slow run
@pytest.mark.parametrize("weight_format", ["int4", "bfloat16"])
def test_loading_peaks_at_the_formats_bytes_and_one_block_not_the_whole_model(
        weight_format, model_folder):
    done = subprocess.run([sys.executable, "-c", LOAD, str(model_folder), weight_format],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    blocks = CONFIG["num_hidden_layers"]
    formatted = blocks * (block_bytes(1) * 0.625 if weight_format == "int4" else block_bytes(2))
    # the format's bytes, and one block read as stored and rounded (float32 temporaries), with
    # room for the allocator; the whole model in float32 alone would be 4x the int4's bound
    bound = formatted + 4 * block_bytes(4) + (32 << 20)
    assert peak < bound, f"{peak >> 20} MB, bound {int(bound) >> 20} MB"
    assert blocks * block_bytes(4) > bound  # the control: a float32 copy could not fit


def test_a_block_formatted_as_read_equals_the_model_formatted_after(model_folder):
    """The same bits, streamed or not: the format's rounding sees the weights as stored."""
    streamed = load_model(model_folder, "cpu", None,
                          convert_block=format_named("int8").block_format())
    whole = load_model(model_folder, "cpu", None)
    format_named("int8").block_format()(whole.layers[3])
    for (name, a), b in zip(streamed.layers[3].state_dict().items(),
                            whole.layers[3].state_dict().values()):
        assert torch.equal(a, b), name

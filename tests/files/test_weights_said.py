"""What the summary line says of the weights (defaults.describe_weights): the format's
size, true to the bytes the loaded model holds; "rounded ... lossy" exactly where the file's
weights were not on the format's grid; the faster 4-bit format's size (w4a8 on an AVX2 CPU,
int4 on AVX-512 BF16's) beside a float format for a model of real size, where group_kernel.c
multiplies."""
import pytest
import torch

from helpers import four_bit_model, tiny_model
from minimedusa.files.weights import save_model
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.assembly.load import four_bit_checkpoint
from minimedusa.speed import format_layers, group_kernel
from minimedusa.speed.defaults import describe_weights, faster_four_bit
from minimedusa.speed.kept_weights import layer_tensors, quantized_layers
from minimedusa.speed.weight_formats import format_named

CPU = torch.device("cpu")


def held_bytes(model) -> int:
    """The bytes of every tensor the model holds once (a tied LM head counted once)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    for block in model.layers:
        for layer in quantized_layers(block).values():
            tensors |= {t.data_ptr(): t for t in layer_tensors(layer).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.kernels
@pytest.mark.parametrize("weight_format", ["int4", "int8"])
def test_the_size_said_is_the_size_held(weight_format, tmp_path):
    save_model(tiny_model(0, dtype=torch.float32, hidden_size=128, intermediate_size=256,
                          vocab_size=256), tmp_path)
    fmt = format_named(weight_format)
    model, _ = decoding_model(Recipe(folder=tmp_path, device=CPU, weight_format=fmt))
    said = fmt.weight_bytes(model.config)
    assert abs(said - held_bytes(model)) <= 0.05 * said


def test_rounded_weights_are_said_to_be_lossy_and_a_four_bit_files_are_not(tmp_path):
    save_model(four_bit_model(0), tmp_path / "four bit")
    save_model(tiny_model(0, dtype=torch.float32), tmp_path / "random")
    assert four_bit_checkpoint(tmp_path / "four bit")
    assert not four_bit_checkpoint(tmp_path / "random")
    config = four_bit_model(0).config
    int4 = format_named("int4")
    assert "lossy" not in describe_weights(config, int4, False, CPU)
    assert describe_weights(config, int4, True, CPU).startswith(
        "int4 weights, 0.00 GB, rounded from the file's (lossy")


@pytest.mark.skipif(group_kernel.kernel_problem() is not None,
                    reason="4 bits are said to be faster only where group_kernel.c multiplies")
def test_a_large_model_in_a_float_format_is_told_the_faster_four_bit_formats_size(monkeypatch):
    config, bfloat16 = tiny_model(0).config, format_named("bfloat16")
    assert "--quantize" not in describe_weights(config, bfloat16, False, CPU)
    monkeypatch.setattr(format_layers, "LARGE", 0)  # as if of real size
    said = describe_weights(config, bfloat16, False, CPU)
    fast = faster_four_bit()  # w4a8 on an AVX2 CPU, int4 on AVX-512 BF16's
    assert said.endswith(f"; --quantize {fast.name}: {fast.weight_bytes(config) / 1e9:.2f} GB, "
                         "faster here, lossy")
    assert "--quantize" not in describe_weights(config, bfloat16, False, torch.device("meta"))

"""From command-line flags to the model decoding runs: the device and weight format (the
machine's default: speed/defaults.py), the model read in that format and its speed plugged in
(speed/plug_in.py); decided here once for generate.py, bench and the training tools alike.
The acceptance rule: cli/acceptance_rule.py.
"""
import sys
from pathlib import Path

import torch

from minimedusa.cli.device import pick_device, pick_dtype
from minimedusa.errors import UserError
from minimedusa.model import Llama
from minimedusa.speed import group_kernel
from minimedusa.speed.defaults import default_format
from minimedusa.speed.kept_weights import formatted_model
from minimedusa.speed.plug_in import plug_in
from minimedusa.speed.weight_formats import bf16_is_native


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The flags' device and dtype; sets torch's CPU threads if asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    return device, pick_dtype(args.dtype, device)


def device_and_format(args, folder: Path) -> tuple[torch.device, str]:
    """The flags' device and weight format for decoding the model in `folder`
    (weight_formats.py): --quantize int8, int4 or w4a8, else --dtype, whose auto is the
    machine's and the model's default_format. Sets torch's CPU threads."""
    device, dtype = device_and_dtype(args)
    if args.quantize != "none":
        if args.device == "auto":
            device = torch.device("cpu")  # the quantized formats multiply on a CPU, GPU or not
        if device.type != "cpu" or args.dtype not in ("auto", "bfloat16", "bf16"):
            raise UserError(f"--quantize {args.quantize} runs on a CPU, its activations in the "
                            "dtype its kernels take (weight_formats.py): drop --dtype/--device")
        problem = group_kernel.kernel_problem() if args.quantize == "w4a8" else None
        if problem is not None:
            raise UserError(f"--quantize w4a8 multiplies in group_kernel.c only, which does not "
                            f"here: {problem}")
        return device, args.quantize
    if args.dtype == "auto":
        return device, default_format(device, folder)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and name == "bfloat16" and not bf16_is_native():
        print("minimedusa: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products run "
              "without native kernels, slower than float32 (--dtype float32 is faster here)",
              file=sys.stderr)
    return device, name


def decoding_model(folder: Path, device, weight_format: str, compile_flag: bool | None = False,
                   check=None) -> tuple[Llama, str]:
    """(the model for decoding, how its step runs in words): loaded, then its speed plugged in
    (speed/plug_in.py): the weight format's layers, the step compiled as --compile asks.
    check(model), if given, runs on the model as read, before its speed: flags that must fit
    the model fail there in seconds, not after the compiler's warm-up."""
    if not Path(folder).is_dir():
        raise UserError(f"model folder {folder} does not exist")
    model = formatted_model(folder, device, weight_format)
    if check is not None:
        check(model)
    return model, plug_in(model, weight_format, compile_flag)

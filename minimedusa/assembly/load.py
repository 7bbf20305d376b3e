"""From command-line flags to the model as read: the device and weight format (the machine's
default: speed/defaults.py, for a model whose file is 4-bit or not), and the model read block by
block in that format, its rounded blocks kept for later runs (speed/kept_weights.py). Its speed
is plugged in by the recipe (recipe.decoding_model), for generate.py, bench and training alike.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from minimedusa.assembly.device import pick_device, pick_dtype
from minimedusa.errors import UserError
from minimedusa.files.outputs import write_atomically
from minimedusa.files.weights import (load_model, read_config, read_tensor, safetensors_files,
                                      tensor_files)
from minimedusa.speed import group_kernel
from minimedusa.speed.cache_folder import one_at_a_time, remove_leftovers
from minimedusa.speed.defaults import bf16_is_native, default_format
from minimedusa.speed.grids import on_four_bit_grid
from minimedusa.speed.kept_weights import (KeptBlocksError, kept_file, kept_state, read_kept,
                                           weights_key, worth_keeping)
from minimedusa.speed.weight_formats import dtype_format, format_named


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The flags' device and dtype; sets torch's CPU threads if asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    return device, pick_dtype(args.dtype, device)


def device_and_format(args, folder: Path) -> tuple[torch.device, object]:
    """The flags' device and weight format (weight_formats.py's object, chosen here once) for
    decoding the model in `folder`: --quantize int8, int4 or w4a8, else --dtype's, whose auto
    is the machine's and the model's default_format. Sets torch's CPU threads."""
    device, dtype = device_and_dtype(args)
    if args.quantize != "none":
        fmt = format_named(args.quantize)
        if args.device == "auto":
            device = torch.device("cpu")  # the quantized formats multiply on a CPU, GPU or not
        if device.type != "cpu" or (args.dtype != "auto" and dtype != torch.bfloat16):
            raise UserError(f"--quantize {fmt.name} runs on a CPU, its activations in the "
                            "dtype its kernels take (weight_formats.py): drop --dtype/--device")
        problem = group_kernel.kernel_problem() if fmt.kernel_only else None
        if problem is not None:
            raise UserError(f"--quantize {fmt.name} multiplies in group_kernel.c only, which "
                            f"does not here: {problem}")
        return device, fmt
    if args.dtype == "auto":
        return device, machine_format(device, folder)
    if device.type == "cpu" and dtype == torch.bfloat16 and not bf16_is_native():
        print("minimedusa: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products run "
              "without native kernels, slower than float32 (--dtype float32 is faster here)",
              file=sys.stderr)
    return device, dtype_format(dtype)


def machine_format(device: torch.device, folder: Path):
    """The machine's format for the model in `folder` (speed/defaults.default_format)."""
    return default_format(device, four_bit_checkpoint(folder))


def four_bit_checkpoint(folder) -> bool:
    """Whether every weight of the model's blocks in `folder` lies on a 4-bit grid of GROUP
    (what a GGUF's Q4_0, Q4_1 or Q4_K file converted to floats holds); stops at the first that
    does not (one matrix read for most models). Asked once a process for a folder as it is
    (the default format asks, and the summary line)."""
    if not Path(folder).is_dir():
        return False  # the loader says so, in its words
    files = safetensors_files(folder)
    key = (str(Path(folder).resolve()), *((f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _four_bit:
        _four_bit[key] = all(on_four_bit_grid(read_tensor(path, name))  # one tensor in memory
                             for name, path in tensor_files(files).items()
                             if ".layers." in name and name.endswith("proj.weight"))
    return _four_bit[key]


_four_bit: dict[tuple, bool] = {}  # four_bit_checkpoint's answers, by folder and files


def formatted_model(folder: Path, device, fmt) -> nn.Module:
    """The model, each block in the format as it is read: a dtype's weights read straight into
    it, int8's and int4's rounded from the weights as stored, so that the model is never held
    whole in another dtype beside its format's bytes (peak memory). A large model's rounded
    blocks are kept after the first run and read back by later ones (speed/kept_weights.py);
    of runs started together, one rounds and keeps them, the others wait and read them."""
    device = torch.device(device)
    if device.type != "cpu" or not fmt.rounds:  # the formats that round: others read as stored
        return read_formatted(folder, device, fmt)
    key = weights_key([Path(folder) / "config.json", *safetensors_files(folder)], fmt)
    model = read_kept_model(folder, fmt, key)
    if model is not None or not worth_keeping(read_config(folder), fmt):
        return model if model is not None else read_formatted(folder, device, fmt)
    # rounded and kept by one process: others started with it wait, then read what it kept
    where = kept_file(folder, fmt).parent
    with one_at_a_time(where, f"rounding {Path(folder).name}'s blocks to {fmt.name}"):
        remove_leftovers(where, ("*.tmp",))  # what a killed run was writing
        model = read_kept_model(folder, fmt, key)
        if model is None:
            model = read_formatted(folder, device, fmt)
            keep(folder, fmt, model, key)
    return model


def read_formatted(folder: Path, device, fmt) -> nn.Module:
    """The model, its blocks rounded to the format from its stored weights as they are read."""
    return load_model(folder, device, fmt.dtype, fmt.block_format(),
                      convert_head=fmt.head_format())


def read_kept_model(folder: Path, fmt, key: str) -> nn.Module | None:
    """The model on the CPU, its blocks those kept under `key` (kept_weights.py), or None
    where there are none, or they are damaged (said in a line)."""
    kept = read_kept(folder, fmt, key)
    if kept is None:
        return None
    try:
        return load_model(folder, torch.device("cpu"), fmt.dtype, fmt.block_format(), kept,
                          fmt.head_format())
    except KeptBlocksError as e:
        print(f"minimedusa: the kept weights were damaged ({e}); rounding again",
              file=sys.stderr)
        return None


def keep(folder: Path, fmt, model, key: str) -> None:
    """Write the model's blocks, formatted, to kept_file (beside its name, then renamed), in
    place of any older one; a line on stderr says where and how big. Where the cache folder
    cannot take it (a full disk), the run goes on: a line says so."""
    state, layers = kept_state(model)
    path = kept_file(folder, fmt)
    metadata = {"key": key, "layers": json.dumps(layers)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: save_file(state, tmp, metadata=metadata))
    except OSError as e:
        print(f"minimedusa: the {fmt.name} weights were not kept ({e.strerror or e}): the "
              "next run rounds them again", file=sys.stderr)
        return
    print(f"minimedusa: {fmt.name} weights kept in {path} ({path.stat().st_size / 1e9:.2f} "
          "GB): later runs read them in seconds", file=sys.stderr)

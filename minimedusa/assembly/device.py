"""Where the model runs and in which dtype: decided here, once, for every entry point.

Defaults: CUDA when present, else the CPU; bfloat16 on CUDA (what the paper's GPUs run),
float32 on the CPU (bf16 matmuls are slow on most CPUs, and the fixtures are float32).
"""
import torch

from minimedusa.errors import UserError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; a UserError for anything else or a missing GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {name!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} asked for, but this machine has no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name!r} asked for, but only "
                             f"{torch.cuda.device_count()} CUDA GPU(s) are present")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' or one of DTYPES' names."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]

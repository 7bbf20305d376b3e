"""Where the model runs and in which dtype: decided here, once, for every entry point.

Defaults: CUDA when present, else the CPU; bfloat16 on CUDA (what the paper's GPUs run),
float32 on the CPU (bf16 matmuls are slow on most CPUs, and the fixtures are float32).
"""
import os
import platform
from pathlib import Path

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


def cpu_model() -> str:
    """The CPU's model name as Linux reports it, else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """The hardware, in words, for benchmark reports and the machine key."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {os.cpu_count()} cores"


# the CPU features that set the speed of a decoding step's products: the vector instruction
# sets (x86: AVX2, AVX-512 and its bf16 extension, AMX; Arm: NEON/ASIMD, SVE)
VECTOR_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_features() -> str:
    """"avx2+fma": the vector features /proc/cpuinfo lists, of VECTOR_FEATURES."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                found = set(line.split(":", 1)[1].split())
                return "+".join(f for f in VECTOR_FEATURES if f in found) or "no vector flags"
    except OSError:
        pass
    return platform.machine() or "unknown features"


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a step's latency depends on, in words: device type, dtype, the hardware, and on a
    CPU its cores, torch's threads and vector features, because two CPUs of one name differ (a
    tree tuned on an AVX-512 "AMD EPYC" ran at 0.97x plain decoding on an AVX2 one)."""
    kind = f"{device.type}/{str(dtype).removeprefix('torch.')}"
    if device.type == "cuda":
        return f"{kind}/{device_name(device)}"
    return f"{kind}/{device_name(device)}, {torch.get_num_threads()} threads, {cpu_features()}"

"""This machine in words: its CPU (or GPU), its vector features, and the key that step
latencies and built kernels are kept under (a speed measured on one machine holds for it only).
"""
import os
import platform
from pathlib import Path

import torch


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
# sets (x86: AVX2 and AVX-VNNI, AVX-512 and its VNNI and bf16 extensions, AMX; Arm: NEON/ASIMD,
# SVE); the C kernels' builds are keyed by them too (group_kernel.c's paths follow them)
VECTOR_FEATURES = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16",
                   "amx_tile", "asimd", "sve")


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

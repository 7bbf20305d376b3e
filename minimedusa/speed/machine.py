"""This machine in words: its CPU (or GPU), its vector features, and the key that step
latencies and built kernels are kept under (a speed measured on one machine holds for it only).

MINIMEDUSA_ISA=avx2 runs a process as a CPU with AVX2 and FMA alone would (most laptops' and
desktops', AMD's Zen 2 and 3), on any x86 CPU that has them: its features said without the
rest, so the C kernels are built for Haswell (c_kernels.py) and the formats chosen as there.
torch's own kernels follow where ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 are set
before it starts (`python -m minimedusa.bench.model_size --isa avx2` sets the three).
"""
import os
import platform
from pathlib import Path

import torch

from minimedusa.errors import UserError

ISA_VARIABLE = "MINIMEDUSA_ISA"
AVX2_ONLY = ("avx2", "fma")  # what MINIMEDUSA_ISA=avx2 keeps of the CPU's vector features
# a process run as an AVX2 CPU: this project's kernels (MINIMEDUSA_ISA) and torch's (ATen's and
# oneDNN's, read as torch starts: for a process to come) held to AVX2
AVX2_ENVIRONMENT = {ISA_VARIABLE: "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2"}


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
    """"avx2+fma": the vector features /proc/cpuinfo lists, of VECTOR_FEATURES (of AVX2_ONLY
    where MINIMEDUSA_ISA=avx2)."""
    kept = AVX2_ONLY if forced_avx2() else VECTOR_FEATURES
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                found = set(line.split(":", 1)[1].split())
                if kept == AVX2_ONLY and not set(AVX2_ONLY) <= found:
                    raise UserError(f"{ISA_VARIABLE}=avx2: this CPU has no AVX2 and FMA")
                return "+".join(f for f in kept if f in found) or "no vector flags"
    except OSError:
        pass
    return platform.machine() or "unknown features"


def forced_avx2() -> bool:
    """Whether this process runs as on a CPU with AVX2 and FMA alone (MINIMEDUSA_ISA=avx2)."""
    value = os.environ.get(ISA_VARIABLE, "native")
    if value not in ("native", "avx2"):
        raise UserError(f"{ISA_VARIABLE}={value!r}: use avx2 (run as a CPU with AVX2 and FMA "
                        "alone) or native (this CPU's every feature: the default)")
    return value == "avx2"


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a step's latency depends on, in words: device type, dtype, the hardware, and on a
    CPU its cores, torch's threads and vector features, because two CPUs of one name differ (a
    tree tuned on an AVX-512 "AMD EPYC" ran at 0.97x plain decoding on an AVX2 one)."""
    kind = f"{device.type}/{str(dtype).removeprefix('torch.')}"
    if device.type == "cuda":
        return f"{kind}/{device_name(device)}"
    return f"{kind}/{device_name(device)}, {torch.get_num_threads()} threads, {cpu_features()}"

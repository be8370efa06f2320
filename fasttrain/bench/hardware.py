"""What machine a benchmark ran on, and the peak FLOP rate MFU is measured against."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Dict, Optional

import torch

# Dense (no structured sparsity) peak tensor-core rates from NVIDIA's data sheets, in FLOP/s.
# "fp32" is the plain FP32 rate: PyTorch does not use TF32 for matmuls unless asked to.
# Order matters: the first key contained in the device name wins ("A100" before "A10").
_PEAK_FLOPS = (
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12}),
    ("H200 NVL", {"bf16": 835e12, "fp32": 60e12}),
    ("H200", {"bf16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp32": 30.3e12}),
    ("A10G", None),  # clocks differ from the A10's data sheet; no trustworthy number
    ("A10", {"bf16": 125e12, "fp32": 31.2e12}),
)


def peak_flops(device: torch.device | str, precision: str = "bf16") -> Optional[float]:
    """The device's peak FLOP/s for ``precision`` (``"bf16"`` or ``"fp32"``), None when unknown.

    CPUs return None: their peak depends on the core count, clock and vector width actually
    available to this process, which a table cannot know.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in _PEAK_FLOPS:
        if key in name:
            return None if table is None else table.get(precision)
    return None


def precision_key(mixed_precision: Optional[str]) -> str:
    """Map a trainer's ``mixed_precision`` setting to a row of the peak table."""
    return "bf16" if mixed_precision in ("bf16", "fp16") else "fp32"


def _driver_version() -> Optional[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or no driver: the field is informational
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: fall back to what the platform module knows
        pass
    return platform.processor() or platform.machine()


def describe_environment(device: torch.device | str) -> Dict[str, object]:
    """Device name and software versions, recorded with every result."""
    device = torch.device(device)
    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # triton is optional off Linux
        info["triton"] = None
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver_version()
    else:
        info["device_name"] = _cpu_name()
    # Package metadata, not imports: importing Lightning alone takes seconds.
    for dist in ("fasttrain", "pytorch-accelerated", "lightning", "accelerate"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info

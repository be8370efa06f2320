"""What machine a benchmark ran on. The peak FLOP rate MFU is measured against lives in
:mod:`fasttrain.hardware`, which the trainer's monitor uses too; it is re-exported here."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Dict, Optional

import torch

from fasttrain.hardware import peak_flops, precision_key

__all__ = ["describe_environment", "peak_flops", "precision_key"]


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
    for dist in ("fasttrain", "pytorch-accelerated", "lightning", "accelerate", "transformers"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info

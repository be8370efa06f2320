"""The device a run trains on: its peak FLOP rate, which MFU is measured against, and its
utilisation, memory, power and clock, sampled through NVML in a background thread.

Both the trainer's throughput monitor (:mod:`fasttrain.monitor`) and ``fasttrain bench`` use
these, so they live here, below both: this module imports nothing from fasttrain.

The sampler thread spends its time asleep or inside NVML's C calls, which release the GIL, so it
barely perturbs the Python-bound training loop it watches. Without NVML, a driver or a GPU,
:class:`GpuSampler` says "unavailable" and why, and its summaries are empty.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

import torch

__all__ = ["GpuSampler", "peak_flops", "precision_key"]

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


def _nvml_handle(pynvml, device_index: int):
    """The NVML handle of a torch CUDA device. NVML numbers all GPUs and ignores
    CUDA_VISIBLE_DEVICES, so match by UUID and use the index only as a fallback."""
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # older drivers or MIG slices: the index is right when nothing is hidden
        return pynvml.nvmlDeviceGetHandleByIndex(device_index)


class _Accumulator:
    __slots__ = ("n", "util_sum", "util_max", "mem_max", "power_sum", "power_n", "clock_sum")

    def __init__(self):
        self.n = 0
        self.util_sum = self.util_max = self.mem_max = 0.0
        self.power_sum = self.clock_sum = 0.0
        self.power_n = 0

    def summary(self) -> Dict[str, Optional[float]]:
        if self.n == 0:
            return {"samples": 0}
        return {
            "samples": self.n,
            "utilization_mean": self.util_sum / self.n,
            "utilization_max": self.util_max,
            "memory_used_max_mb": self.mem_max,
            "power_mean_w": self.power_sum / self.power_n if self.power_n else None,
            "sm_clock_mean_mhz": self.clock_sum / self.n,
        }


class GpuSampler:
    """Samples one GPU every ``interval_s`` seconds between :meth:`start` and :meth:`stop`.

    ``summary()`` covers everything since ``start``; ``take()`` returns the summary since the
    previous ``take`` and starts a new window (for periodic reports such as the throughput
    monitor's). Both are cheap host-side reads; neither touches the GPU's stream.
    """

    def __init__(self, device: torch.device | str | int | None = None, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.reason: Optional[str] = None
        self._handle = None
        self._pynvml = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._total = _Accumulator()
        self._window = _Accumulator()
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if device.type != "cuda":
            self.reason = f"device {device} is not a CUDA GPU"
            return
        if not torch.cuda.is_available():
            self.reason = "CUDA is not available"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = _nvml_handle(pynvml, index)
            self._pynvml = pynvml
        except Exception as exc:  # no NVML library, no driver, or no such device
            self.reason = f"NVML unavailable: {exc}"

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _sample(self) -> None:
        nv = self._pynvml
        util = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu
        mem = nv.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
        clock = nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)
        try:
            power = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        except nv.NVMLError:  # some boards do not report power
            power = None
        with self._lock:
            for acc in (self._total, self._window):
                acc.n += 1
                acc.util_sum += util
                acc.util_max = max(acc.util_max, util)
                acc.mem_max = max(acc.mem_max, mem)
                acc.clock_sum += clock
                if power is not None:
                    acc.power_sum += power
                    acc.power_n += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as exc:  # a failing sample ends sampling, it must not end training
                self.reason = f"NVML sampling failed: {exc}"
                return
            self._stop.wait(self.interval_s)

    def start(self) -> "GpuSampler":
        if not self.available or self._thread is not None:
            return self
        self._stop.clear()
        with self._lock:
            self._total, self._window = _Accumulator(), _Accumulator()
        self._thread = threading.Thread(target=self._loop, name="fasttrain-gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Dict[str, object]:
        """Stop sampling and return the summary of the whole sampled period."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.summary()

    def summary(self) -> Dict[str, object]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        with self._lock:
            return {"available": True, **self._total.summary()}

    def take(self) -> Dict[str, object]:
        """The summary since the previous ``take`` (or ``start``); starts a new window."""
        if not self.available:
            return {"available": False, "reason": self.reason}
        with self._lock:
            window, self._window = self._window, _Accumulator()
        return {"available": True, **window.summary()}

    def __enter__(self) -> "GpuSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def close(self) -> None:
        self.stop()
        if self._pynvml is not None:
            try:
                self._pynvml.nvmlShutdown()
            except Exception:  # shutting down twice or after a driver reset is harmless
                pass
            self._pynvml = None
            self._handle = None

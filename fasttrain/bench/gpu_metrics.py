"""GPU utilisation, memory, power and clock sampled through NVML: :class:`GpuSampler` lives in
:mod:`fasttrain.hardware`, which the trainer's monitor uses too; it is re-exported here. The bench
runs one sampler for every peer alike."""

from fasttrain.hardware import GpuSampler

__all__ = ["GpuSampler"]

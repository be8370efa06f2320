"""Fused Triton kernels for fasttrain, importable as ``fasttrain.kernels``.

Public entry points are ``torch.library`` custom ops (namespace ``fasttrain``) wrapped in plain
functions: on CUDA they run the Triton kernels, on the CPU (and wherever Triton cannot run) the
PyTorch references. Importing this package needs neither triton nor a GPU and does not
initialise CUDA. The ``*_triton`` launchers run the kernels directly, on CUDA tensors or, with
``TRITON_INTERPRET=1`` set before triton is imported, on CPU tensors (tests).
"""
from ._multi_tensor import hold_chunk_tables, triton_available, triton_interpreted
from .clip_norm import clip_grad_norm_, clip_grad_norm_reference, clip_grad_norm_triton
from .clip_norm_sharded import (
    clip_grad_norm_from_sumsq_,
    clip_grad_norm_from_sumsq_reference,
    clip_grad_norm_from_sumsq_triton,
    grad_sumsq,
    grad_sumsq_reference,
    grad_sumsq_triton,
)
from .clip_value import clip_grad_value_, clip_grad_value_reference, clip_grad_value_triton
from .loss_accum import (
    LossCounters,
    LossSnapshot,
    accumulate_loss_,
    accumulate_loss_reference,
    accumulate_loss_triton,
    reset_counters_,
)

__all__ = [
    "LossCounters",
    "LossSnapshot",
    "accumulate_loss_",
    "accumulate_loss_reference",
    "accumulate_loss_triton",
    "clip_grad_norm_",
    "clip_grad_norm_from_sumsq_",
    "clip_grad_norm_from_sumsq_reference",
    "clip_grad_norm_from_sumsq_triton",
    "clip_grad_norm_reference",
    "clip_grad_norm_triton",
    "clip_grad_value_",
    "clip_grad_value_reference",
    "clip_grad_value_triton",
    "grad_sumsq",
    "grad_sumsq_reference",
    "grad_sumsq_triton",
    "hold_chunk_tables",
    "reset_counters_",
    "triton_available",
    "triton_interpreted",
]

"""Fused Triton kernels for fasttrain, importable as ``fasttrain.kernels``.

Public entry points are ``torch.library`` custom ops (namespace ``fasttrain``) wrapped in plain
functions: on CUDA they run the Triton kernels, on the CPU (and wherever Triton cannot run) the
PyTorch references. Importing this package needs neither triton nor a GPU and does not
initialise CUDA. The ``*_triton`` launchers run the kernels directly, on CUDA tensors or, with
``TRITON_INTERPRET=1`` set before triton is imported, on CPU tensors (tests).
"""
import importlib as _importlib
import sys as _sys

# This directory is installed as ``fasttrain.kernels``. From the root of a source checkout it is
# also importable as a top-level ``kernels`` package, a name others probe by importing it
# (transformers does, looking for the Hugging Face ``kernels`` package). A second copy of these
# modules would register the ``fasttrain::`` custom ops again, and whichever copy is freed first
# unregisters them under the other, whose next call then crashes the process. The top-level name
# is therefore made an alias of the one installed copy; only where fasttrain is not installed does
# the package run under the name it was imported by.
_installed = None
if __name__ != "fasttrain.kernels":
    try:
        _installed = _importlib.import_module("fasttrain.kernels")
    except ImportError:
        _installed = None

if _installed is not None:
    for _name, _module in list(_sys.modules.items()):
        if _name.startswith("fasttrain.kernels."):
            _sys.modules[__name__ + _name[len("fasttrain.kernels"):]] = _module
    _sys.modules[__name__] = _installed
else:
    from ._multi_tensor import hold_chunk_tables, prepare_chunk_tables, triton_available, triton_interpreted
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
    from .masked_restore import (
        prepare_snapshot_table,
        restore_where_,
        restore_where_reference,
        restore_where_triton,
        save_snapshot,
        save_snapshot_reference,
        save_snapshot_triton,
        snapshot_nbytes,
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
        "prepare_chunk_tables",
        "prepare_snapshot_table",
        "reset_counters_",
        "restore_where_",
        "restore_where_reference",
        "restore_where_triton",
        "save_snapshot",
        "save_snapshot_reference",
        "save_snapshot_triton",
        "snapshot_nbytes",
        "triton_available",
        "triton_interpreted",
    ]

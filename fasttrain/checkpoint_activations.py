"""Activation checkpointing: keep only a block's inputs in the forward, recompute the rest in
the backward.

Each chosen module's forward runs under torch's non-reentrant ``torch.utils.checkpoint``: the
activations inside the block are freed after the forward and recomputed when the backward needs
them. Peak memory then holds one block's activations plus every block's input, instead of every
activation of every block, for about one extra forward of compute. The non-reentrant variant is
the one that ``torch.compile`` traces (as a higher-order op) and that supports keyword
arguments and inputs without gradients.

The forward is replaced on each instance, not by wrapping the module in another one, so
parameter names, ``state_dict`` keys and the module tree stay as they were: a checkpoint saved
with activation checkpointing loads without it and the other way round.

Random ops inside a block (dropout) draw the same numbers in the recomputation, since
checkpoint restores the RNG state (``preserve_rng_state=True``), so losses and gradients equal
those without checkpointing. With FSDP2 sharding, apply it before ``fully_shard`` so each block is
recomputed inside its own all-gather.
"""

from __future__ import annotations

import functools
from typing import List

from torch import nn
from torch.utils.checkpoint import checkpoint

from fasttrain.blocks import ModuleTypes, as_module_types, outermost_blocks

__all__ = ["apply_activation_checkpointing", "checkpointed_module_names"]

_MARK = "_fasttrain_activation_checkpointed"


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def apply_activation_checkpointing(model: nn.Module, module_types: ModuleTypes) -> List[str]:
    """Checkpoint the forward of every submodule of ``model`` whose class is in
    ``module_types``, in place; returns their names. A module inside another chosen module is
    left alone (its parent's recomputation covers it), and calling this twice changes nothing."""
    option = "activation_checkpointing"
    blocks = outermost_blocks(
        model,
        as_module_types(module_types, option),
        option,
        "checkpointing the whole model saves nothing (all activations are recomputed at once)",
    )
    for _, module in blocks:
        if getattr(module, _MARK, False):
            continue
        # an instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks)
        # stay outside the checkpoint, as with torch's checkpoint_wrapper
        module.forward = functools.partial(_checkpointed_forward, module.forward)
        setattr(module, _MARK, True)
    return [name for name, _ in blocks]


def checkpointed_module_names(model: nn.Module) -> List[str]:
    """Names of the submodules whose forward runs under activation checkpointing."""
    return [name for name, m in model.named_modules() if getattr(m, _MARK, False)]

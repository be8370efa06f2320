"""Whether a model is sharded by FSDP2, asked in one way everywhere (engines, checkpoints,
the Lightning runner)."""

import torch


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) is sharded by FSDP2's ``fully_shard``.

    Decided from the modules, not from the parameters: a module FSDP2 does not reshard after its
    forward (the root, by default) holds its parameters unsharded, as plain tensors, after a
    forward with no backward (an evaluation) until its next forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())

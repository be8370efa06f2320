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


def reshard_fsdp2(model: torch.nn.Module) -> None:
    """Register the sharded parameters again on every FSDP2 module that holds its unsharded ones
    (the root after an evaluation): what a run sets up from ``model.parameters()`` (accelerate's
    optimizer remapping, the gradient clipper) must see the shards the optimizer steps."""
    if not is_fsdp2(model):
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()

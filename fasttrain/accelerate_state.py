"""Building accelerate's ``Accelerator`` for one Trainer.

accelerate keeps its run settings (mixed precision, plugins) in one process-wide
``AcceleratorState`` and refuses a later ``Accelerator`` that asks for another mixed precision.
fasttrain builds an Accelerator per Trainer, and one process often holds several Trainers with
different precisions (a notebook, a script comparing fp32 with bf16, the documentation's
examples). The distributed state (``PartialState``: process group, device, ranks) is shared and
kept; only the per-run settings are rebuilt, and only when the new Trainer asks for another
precision or another FSDP plugin, so a Trainer that leaves ``mixed_precision`` unset still follows
the environment and an existing state as accelerate does.

FSDP2 on CPU processes: accelerate switches FSDP on only for accelerator devices and silently
keeps DDP (``MULTI_CPU``) when the processes run on the CPU. torch's ``fully_shard`` works on the
CPU with gloo, so an FSDP2 plugin asked for there is honoured: the state is switched to FSDP as
accelerate does on GPUs, and the model is sharded by accelerate's own FSDP2 preparation.
"""

import os

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"


def build_accelerator(mixed_precision=None, **kwargs) -> Accelerator:
    """``Accelerator(mixed_precision=mixed_precision, **kwargs)``, first dropping the per-run
    settings a previous Accelerator left when they name another mixed precision or another FSDP
    plugin."""
    fsdp_plugin = kwargs.get("fsdp_plugin")
    if AcceleratorState._shared_state:
        state = AcceleratorState()
        if state.initialized and state.distributed_type != DistributedType.DEEPSPEED:  # DeepSpeed owns its precision
            other_precision = mixed_precision is not None and state.mixed_precision != mixed_precision
            other_plugin = fsdp_plugin is not None and getattr(state, "fsdp_plugin", None) is not fsdp_plugin
            if other_precision or other_plugin:
                AcceleratorState._reset_state(reset_partial_state=False)
    # accelerate records a given plugin in the process environment, where every later
    # Accelerator of the process would find it and shard its model too: keep the environment
    # as it was, so that the plugin applies to this Trainer only
    env_before = os.environ.get(_ACCELERATE_USE_FSDP)
    try:
        accelerator = Accelerator(mixed_precision=mixed_precision, **kwargs)
    finally:
        if fsdp_plugin is not None:
            if env_before is None:
                os.environ.pop(_ACCELERATE_USE_FSDP, None)
            else:
                os.environ[_ACCELERATE_USE_FSDP] = env_before
    _honour_fsdp2_on_cpu(accelerator, fsdp_plugin)
    return accelerator


def _honour_fsdp2_on_cpu(accelerator: Accelerator, fsdp_plugin) -> None:
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    if fsdp_plugin is None and os.environ.get(_ACCELERATE_USE_FSDP, "false").lower() == "true":
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    if fsdp_plugin is None or fsdp_plugin.fsdp_version != 2:
        return  # FSDP1 is not switched on here (fasttrain supports FSDP2 only)
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin

"""Building accelerate's ``Accelerator`` for one Trainer.

accelerate keeps its run settings (mixed precision, plugins) in one process-wide
``AcceleratorState`` and refuses a later ``Accelerator`` that asks for another mixed precision.
fasttrain builds an Accelerator per Trainer, and one process often holds several Trainers with
different precisions (a notebook, a script comparing fp32 with bf16, the documentation's
examples). The distributed state (``PartialState``: process group, device, ranks) is shared and
kept; only the per-run settings are rebuilt, and only when the new Trainer asks for another
precision, so a Trainer that leaves ``mixed_precision`` unset still follows the environment and
an existing state as accelerate does.
"""

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType


def build_accelerator(mixed_precision=None, **kwargs) -> Accelerator:
    """``Accelerator(mixed_precision=mixed_precision, **kwargs)``, first dropping the per-run
    settings a previous Accelerator left when they name another mixed precision."""
    if mixed_precision is not None and AcceleratorState._shared_state:
        state = AcceleratorState()
        if (
            state.initialized
            and state.distributed_type != DistributedType.DEEPSPEED  # DeepSpeed owns its precision
            and state.mixed_precision != mixed_precision
        ):
            AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(mixed_precision=mixed_precision, **kwargs)

"""When the graphed engine captures a step, and the reasons it gives for not capturing one.

The warm-up counts (how many compiled runs of a shape, and of updates, come before a capture),
the limits after which it stops trying (captures again, shapes off the graph), and the refusals:
:class:`CaptureRefused` where a captured step would not replay correctly, and
:class:`HostStateChanged` where the step's hooks changed Python state a replay would not change
again (:mod:`fasttrain.engine.host_state`).
"""

from __future__ import annotations

from typing import Optional

from fasttrain.engine.compiled import describe_error
from fasttrain.engine.host_state import HostStateWatch

#: compiled runs of one batch shape before it is captured (the first compiles)
WARMUP_STEPS_PER_SHAPE = 2
#: updates run (compiled) before the update graph is captured
WARMUP_UPDATES = 2
#: micro-steps before the first capture; PyTorch's capture guide warms up three iterations
MIN_WARMUP_STEPS = 3
#: captures again after a hook changed what a graph was captured with, before the engine stops
#: capturing (a change made at every step would otherwise re-capture forever)
MAX_RECAPTURES = 3
#: batch shapes other than the captured one (the last, partial batch of the training and of the
#: evaluation epoch, captured as graphs of their own) before shapes count as dynamic
MAX_OFF_GRAPH_SHAPES = 1
#: runs of the partial batch's shape before it is captured: its first run compiles it
WARM_RUNS_OF_THE_LAST_SHAPE = 1


#: why no sharded (FSDP2) step is captured; the compiled engine runs it instead
FSDP2_REASON = (
    "FSDP2 steps are not captured: FSDP2 all-gathers parameters and reduce-scatters gradients "
    "from per-module hooks on streams of its own, with host-side state per step (which modules are "
    "unsharded, the gradient-sync flag of accumulation), none of which a replayed graph would "
    "redo; the compiled engine compiles each sharded block instead"
)


#: why a batch whose tensors' elements overlap is not captured
OVERLAPPING_BATCH_REASON = (
    "a batch tensor's elements overlap in memory (an expand()ed view), a layout the static input "
    "buffers cannot copy into, so the captured step would be traced again for another layout; "
    "make it contiguous (or clone it) in the collate function"
)


class CaptureRefused(RuntimeError):
    """Raised when a captured step would not replay correctly."""


class HostStateChanged(CaptureRefused):
    """The step's hooks changed Python state that a replay would not change (host_state.py)."""


def recaptured_too_often(change: str, times: int) -> str:
    """Why a phase stops capturing after ``change`` made it capture again more than
    :data:`MAX_RECAPTURES` times (for a warning)."""
    return f"{change} between steps, {times} times this run, and each change needs the step captured again"


def refusal_reason(error: BaseException) -> str:
    # a refusal says why in its own words; another error is named with its type
    return str(error) if isinstance(error, CaptureRefused) else describe_error(error)


def failing_hook(error: BaseException, running: Optional[str]) -> Optional[str]:
    # the hook the engine was in, unless the refusal concerns the whole step
    return None if isinstance(error, HostStateChanged) else running


def refuse_changed(host_state: HostStateWatch) -> None:
    changed = host_state.changed()
    if changed is not None:
        raise HostStateChanged(
            f"the step's hooks change {changed} while the step runs, which a replayed graph would "
            "not change again (it runs no Python): keep such state in a callback "
            "(on_train_step_end, on_eval_step_end) or change a tensor in place"
        )

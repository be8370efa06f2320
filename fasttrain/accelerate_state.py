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
accelerate does on GPUs, and the model is sharded by accelerate's own FSDP2 preparation. The
switch is written into the process-wide ``PartialState`` too, as accelerate itself does for FSDP
on GPUs: every ``AcceleratorState()`` made later (accelerate makes them inside ``prepare`` and
its utilities) copies its distributed type from there, and would otherwise turn the run back to
``MULTI_CPU`` while the model stays sharded.

Refused set-ups, each with an error that says what to change: FSDP1 (a plugin with
``fsdp_version=1``, or ``ACCELERATE_USE_FSDP`` from a launcher without ``FSDP_VERSION=2``;
fasttrain supports FSDP2 only), and a launch accelerate did not recognise (``WORLD_SIZE`` > 1 in
the environment, one process in the accelerator: each process would train alone).
"""

import os

from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"
_FSDP_VERSION = "FSDP_VERSION"

USE_FSDP2 = (
    "use FSDP2: Trainer(accelerator_kwargs={'fsdp_plugin': FullyShardedDataParallelPlugin("
    "fsdp_version=2, ...)}), or 'fsdp_version: 2' under fsdp_config in the accelerate config file "
    "(ACCELERATE_USE_FSDP=true with FSDP_VERSION=2 in the environment of a torchrun launch)"
)


def _env_asks_for_fsdp() -> bool:
    return os.environ.get(_ACCELERATE_USE_FSDP, "false").lower() == "true"


def requested_fsdp_version(fsdp_plugin=None):
    """The FSDP version a run asks for: the plugin's, else the launcher's (``ACCELERATE_USE_FSDP``
    with ``FSDP_VERSION``, 1 when unset, as accelerate reads it); ``None`` without FSDP."""
    if fsdp_plugin is not None:
        return fsdp_plugin.fsdp_version
    if _env_asks_for_fsdp():
        return int(os.environ.get(_FSDP_VERSION, "1"))
    return None


def refuse_fsdp1(version, source: str) -> None:
    if version is not None and version != 2:
        raise ValueError(
            f"FSDP version {version} ({source}) is not supported by fasttrain: under FSDP1 each "
            "process holds flat shards that gradient clipping and checkpoints would treat as whole "
            f"tensors (per-shard norms, partial saves); {USE_FSDP2}."
        )


def check_accelerator(accelerator: Accelerator) -> None:
    """Refuse what fasttrain cannot train correctly with ``accelerator``: FSDP1, and a launch of
    several processes that accelerate took for one process."""
    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        refuse_fsdp1(getattr(state.fsdp_plugin, "fsdp_version", 1), "the accelerator's FSDP plugin")
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1 and accelerator.num_processes == 1:
        device = accelerator.device
        hint = (
            "On a machine without GPUs set ACCELERATE_USE_CPU=1 in the launch environment "
            "(ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N script.py) or launch with "
            "'accelerate launch --cpu --num_processes N script.py'"
            if device.type == "cpu"
            else "Check that the launcher's environment (LOCAL_RANK, MASTER_ADDR) reaches the "
            "script, or launch with 'accelerate launch --num_processes N script.py'"
        )
        raise RuntimeError(
            f"WORLD_SIZE={world_size} in the environment, but accelerate set up a single process "
            f"(distributed type {state.distributed_type.value}, device {device}): every process "
            f"would train on its own, on all the data. {hint}."
        )


def build_accelerator(mixed_precision=None, **kwargs) -> Accelerator:
    """``Accelerator(mixed_precision=mixed_precision, **kwargs)``, first dropping the per-run
    settings a previous Accelerator left when they name another mixed precision or another FSDP
    plugin."""
    fsdp_plugin = kwargs.get("fsdp_plugin")
    refuse_fsdp1(
        requested_fsdp_version(fsdp_plugin),
        "accelerator_kwargs['fsdp_plugin']" if fsdp_plugin is not None else f"{_ACCELERATE_USE_FSDP} from the launcher",
    )
    if AcceleratorState._shared_state:
        state = AcceleratorState()
        if state.initialized and state.distributed_type != DistributedType.DEEPSPEED:  # DeepSpeed owns its precision
            other_precision = mixed_precision is not None and state.mixed_precision != mixed_precision
            state_plugin = getattr(state, "fsdp_plugin", None)
            other_plugin = fsdp_plugin is not None and state_plugin is not fsdp_plugin
            # a plugin an earlier Trainer was given applies to that Trainer only; one built
            # from the launcher's environment applies to every Trainer of the process
            stale_plugin = fsdp_plugin is None and state_plugin is not None and not _env_asks_for_fsdp()
            if other_precision or other_plugin or stale_plugin:
                AcceleratorState._reset_state(reset_partial_state=False)
                _undo_fsdp_switch()
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


class GivenAccelerator:
    """An ``Accelerator`` a user built (``Trainer(accelerator=...)``), used for every run as it is.

    accelerate keeps an Accelerator's settings in the process-wide ``AcceleratorState``, which
    another Trainer of the process asking for another precision or FSDP plugin rebuilds: the
    given Accelerator would then silently run with that Trainer's settings. Its settings are
    recorded when it is given, and a run that finds them changed raises instead.
    """

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.settings = self._settings()

    def _settings(self) -> tuple:
        state = self.accelerator.state.__dict__
        return (
            state.get("_mixed_precision"),
            state.get("distributed_type"),
            id(state.get("fsdp_plugin")),
        )

    def get(self) -> Accelerator:
        now = self._settings()
        if now != self.settings:
            raise RuntimeError(
                "The Accelerator given to Trainer(accelerator=...) no longer has the settings it "
                f"was given with (mixed precision, distributed type: {self.settings[:2]} -> {now[:2]}): "
                "accelerate keeps them process-wide, and another Trainer of this process built an "
                "Accelerator with other settings. Give every Trainer of the process the same "
                "Accelerator, or build this Trainer with mixed_precision=/accelerator_kwargs= instead."
            )
        return self.accelerator


def _honour_fsdp2_on_cpu(accelerator: Accelerator, fsdp_plugin) -> None:
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    if fsdp_plugin is None and _env_asks_for_fsdp():
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    if fsdp_plugin is None or fsdp_plugin.fsdp_version != 2:
        return  # FSDP1 is not switched on here (fasttrain supports FSDP2 only)
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    # as accelerate does on GPUs: AcceleratorState() copies its distributed type from here
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _undo_fsdp_switch() -> None:
    """Before a new run's settings are built: the process-wide state goes back from FSDP (which
    the previous run's settings wrote there) to the plain multi-process type of its device, from
    which accelerate decides again."""
    shared = PartialState._shared_state
    if shared.get("distributed_type") != DistributedType.FSDP:
        return
    device_type = getattr(shared.get("device"), "type", "cpu")
    name = "MULTI_GPU" if device_type == "cuda" else f"MULTI_{device_type.upper()}"
    shared["distributed_type"] = getattr(DistributedType, name, DistributedType.MULTI_CPU)

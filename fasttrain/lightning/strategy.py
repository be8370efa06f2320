"""``trainer.strategy`` as LightningModule code and Lightning's callbacks use it, and the
``strategy=`` argument.

``trainer.strategy`` is an instance of Lightning's own class for the run (``SingleDeviceStrategy``
in one process, ``DDPStrategy`` under DDP, ``FSDPStrategy`` with ``strategy="fsdp"``), so
``isinstance`` checks hold, but what it does is fasttrain's: accelerate owns the process group and
the loss scaler, the collectives go through ``torch.distributed``, and the step's hooks run in
Lightning's order through fasttrain's engines.

``LightningOptimizer.step`` (manual optimization, or an overridden ``optimizer_step`` that calls
``optimizer.step(closure=...)``) lands in ``optimizer_step``, which runs Lightning's sequence:
the optimizer's step with a closure that runs the given one, then ``on_before_optimizer_step``
and clipping (automatic optimization only).

``strategy=`` takes the names and objects that map onto what accelerate runs: ``"auto"``,
``"single_device"``, the ``"ddp*"`` names (the processes come from the launch: fasttrain starts
none itself, so a spawning name runs as DDP when launched, or in one process), ``"fsdp"``, and
``SingleDeviceStrategy``/``DDPStrategy``/``FSDPStrategy`` objects with the options accelerate has.
Anything else is refused at ``Trainer(...)`` with what to use instead.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy
from lightning.pytorch.strategies import Strategy as LightningStrategy
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from fasttrain.lightning import ckpt_files


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ---------------------------------------------------------------------------------- strategy=
#: start methods that spawn or fork the processes (Lightning's ddp_spawn, ddp_fork, ddp_notebook)
SPAWNING = ("spawn", "fork", "forkserver")
_DDP_OPTIONS = {f.name for f in dataclasses.fields(DistributedDataParallelKwargs)}
_HOW_TO_LAUNCH = (
    "launch the processes with `torchrun --nproc_per_node N script.py` or `accelerate launch --num_processes N "
    "script.py` (in a notebook: `accelerate.notebook_launcher(train_function, num_processes=N)`)"
)


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """What ``strategy=`` asks accelerate for. ``kind``: ``"auto"`` (DDP when launched with
    several processes, else one device), ``"single"``, ``"ddp"`` or ``"fsdp"``."""

    kind: str = "auto"
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    process_group_kwargs: dict = dataclasses.field(default_factory=dict)
    start_method: str = "popen"
    device: Optional[torch.device] = None

    def accelerator_kwargs(self) -> dict:
        """accelerate's settings for this choice (``Accelerator(**kwargs)``)."""
        kwargs: dict[str, Any] = {}
        handlers = []
        if self.ddp_kwargs:
            handlers.append(DistributedDataParallelKwargs(**self.ddp_kwargs))
        if self.process_group_kwargs:
            handlers.append(InitProcessGroupKwargs(**self.process_group_kwargs))
        if handlers:
            kwargs["kwargs_handlers"] = handlers
        if self.kind == "fsdp":
            from accelerate.utils import FullyShardedDataParallelPlugin

            # FSDP2: fasttrain refuses FSDP1, accelerate's default version
            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
        return kwargs


def parse_strategy(flag) -> StrategyChoice:
    """``strategy=`` (a name or a Lightning strategy object) as a :class:`StrategyChoice`; a
    ``ValueError`` saying what to use when it cannot map."""
    if isinstance(flag, str):
        name = flag.lower()
        if name == "auto":
            return StrategyChoice()
        if name not in StrategyRegistry:
            raise ValueError(_invalid(name))
        if "deepspeed" in name or "xla" in name or "tpu" in name:
            raise ValueError(_refusal(name))
        flag = StrategyRegistry.get(name)
    if isinstance(flag, LightningFSDPStrategy):
        _check_fsdp(flag)
        return StrategyChoice("fsdp")
    if isinstance(flag, LightningDDPStrategy):
        return _ddp_choice(flag)
    if isinstance(flag, LightningSingleDeviceStrategy):
        device = flag.root_device
        if device.type == "cuda" and device.index not in (None, int(os.environ.get("LOCAL_RANK", 0))):
            raise ValueError(
                f"SingleDeviceStrategy(device={str(device)!r}): fasttrain trains on the launch's device "
                f"(cuda:{int(os.environ.get('LOCAL_RANK', 0))} here); run with CUDA_VISIBLE_DEVICES={device.index} to "
                "train on that GPU"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"SingleDeviceStrategy(device={str(device)!r}): fasttrain trains on the CPU or CUDA")
        return StrategyChoice("single", device=device)
    if isinstance(flag, LightningStrategy):
        raise ValueError(_refusal(type(flag).__name__))
    raise ValueError(_invalid(flag))


def _invalid(flag) -> str:  # Lightning's words
    return (
        f"You selected an invalid strategy name: `strategy={flag!r}`."
        " It must be either a string or an instance of `lightning.pytorch.strategies.Strategy`."
        " Example choices: auto, ddp, ddp_spawn, deepspeed, ..."
        " Find a complete list of options in our documentation at https://lightning.ai"
    )


def _refusal(what: str) -> str:
    return (
        f"fasttrain.lightning.Trainer does not support strategy {what!r}: fasttrain distributes through accelerate "
        "(DDP, or FSDP2 with strategy='fsdp'). Use strategy='auto', 'ddp' or 'fsdp' and launch the processes "
        "with `torchrun` or `accelerate launch`, or train this run with lightning.Trainer."
    )


#: FSDPStrategy options accelerate's FSDP2 plugin does not take: only their defaults are accepted
_FSDP_FIXED = (
    "sharding_strategy", "cpu_offload", "mixed_precision", "kwargs", "_activation_checkpointing_kwargs",
    "_state_dict_type", "_process_group_backend", "_timeout", "_layer_sync", "_accelerator", "_parallel_devices",
    "cluster_environment", "_checkpoint_io", "_precision_plugin",
)


def _check_fsdp(given: LightningFSDPStrategy) -> None:
    default = vars(LightningFSDPStrategy())
    for key in _FSDP_FIXED:
        if vars(given).get(key) != default.get(key):
            raise ValueError(
                f"fasttrain.lightning.Trainer cannot honour FSDPStrategy's {key.lstrip('_')!r} "
                f"({vars(given).get(key)!r}): fasttrain shards with accelerate's FSDP2 plugin; use strategy='fsdp'"
            )


def _ddp_choice(given: LightningDDPStrategy) -> StrategyChoice:
    for key, label in (("_ddp_comm_state", "ddp_comm_state"), ("_ddp_comm_hook", "ddp_comm_hook"),
                       ("_ddp_comm_wrapper", "ddp_comm_wrapper"), ("_model_averaging_period", "model_averaging_period"),
                       ("_accelerator", "accelerator"), ("_parallel_devices", "parallel_devices"),
                       ("cluster_environment", "cluster_environment"), ("_checkpoint_io", "checkpoint_io"),
                       ("_precision_plugin", "precision_plugin"), ("_layer_sync", "sync_batchnorm")):
        if vars(given).get(key) is not None:
            raise ValueError(
                f"fasttrain.lightning.Trainer cannot honour DDPStrategy({label}=...): accelerate sets up DDP; "
                "pass DDP's own options (find_unused_parameters, static_graph, gradient_as_bucket_view, "
                "bucket_cap_mb, broadcast_buffers), timeout or process_group_backend"
            )
    unknown = sorted(set(given._ddp_kwargs) - _DDP_OPTIONS)
    if unknown:
        raise ValueError(
            f"fasttrain.lightning.Trainer cannot pass {unknown} to DDP (accelerate's DistributedDataParallelKwargs "
            f"takes {sorted(_DDP_OPTIONS)})"
        )
    group = {}
    if given._timeout is not None and given._timeout != default_pg_timeout:
        group["timeout"] = given._timeout
    if given._process_group_backend is not None:
        group["backend"] = given._process_group_backend
    elif group:
        group["backend"] = None  # accelerate's choice for the device
    if given._start_method not in ("popen",) + SPAWNING:
        raise ValueError(f"DDPStrategy(start_method={given._start_method!r}) is not a start method")
    return StrategyChoice("ddp", dict(given._ddp_kwargs), group, given._start_method)


def check_launch(lt, processes: int) -> None:
    """``devices`` (per node) times ``num_nodes`` must be the launch's process count: fasttrain
    starts no processes itself, torchrun (or accelerate launch) does, on every node."""
    choice = lt._args.strategy
    if choice.kind == "single" and processes > 1:
        raise ValueError(
            f"strategy='single_device' trains in one process, but this run has {processes}: use strategy='ddp' "
            "(or 'auto') under a launch of several processes"
        )
    devices, nodes = lt._args.devices, lt.num_nodes
    if devices in ("auto", -1, "-1"):
        if processes % nodes == 0 and processes >= nodes:
            return
        wanted = None
    else:
        wanted = _count_devices(devices)
        if wanted * nodes == processes:
            return
    per_node = wanted or 1
    spawning = choice.start_method in SPAWNING
    if nodes == 1:
        raise ValueError(
            f"devices={devices!r} but this run has {processes} process(es): fasttrain starts no processes itself"
            + (f" (strategy {choice.start_method!r} start method included)" if spawning else "")
            + f"; {_HOW_TO_LAUNCH.replace('N', str(per_node))}, or leave devices='auto'"
        )
    raise ValueError(
        f"num_nodes={nodes} and devices={devices!r} but this run has {processes} process(es): fasttrain starts no "
        f"processes itself; on each of the {nodes} nodes launch `torchrun --nnodes {nodes} --nproc_per_node "
        f"{per_node} ...` (or `accelerate launch --num_machines {nodes} --num_processes {per_node * nodes}`)"
    )


def check_devices_argument(devices, accelerator: str, choice: StrategyChoice) -> None:
    """``devices`` as Lightning checks it when the Trainer is built: device indices (``[0, 1]``,
    ``"0,1"``) only for GPUs (Lightning's ``TypeError`` on the CPU), and GPU indices the launch
    can use: fasttrain puts each process on ``cuda:LOCAL_RANK``, so indices must be 0 to N-1."""
    indices = device_indices(devices)
    if indices is None:
        return
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()) or (
        choice.device is not None and choice.device.type == "cpu"
    )
    if on_cpu:
        raise TypeError("`devices` selected with `CPUAccelerator` should be an int > 0.")
    if sorted(indices) != list(range(len(indices))):
        visible = ",".join(str(i) for i in indices)
        raise ValueError(
            f"devices={devices!r}: fasttrain puts the process of local rank R on cuda:R, so it cannot pick GPUs "
            f"{indices}; run with CUDA_VISIBLE_DEVICES={visible} and devices={len(indices)}"
        )


def _count_devices(devices) -> int:
    """How many devices per node ``devices`` names, as Lightning reads it: a count, a list of
    indices, or a string of either (``"2"``, ``"0,1"``)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        parts = [p for p in devices.split(",") if p.strip()]
        return len(parts) if len(parts) > 1 or devices.strip().endswith(",") else int(parts[0])
    return int(devices)


def device_indices(devices) -> Optional[list]:
    """The device indices ``devices`` names (``[0, 1]``, ``"0,1"``), else None (a count, "auto")."""
    if isinstance(devices, (list, tuple)):
        return [int(d) for d in devices]
    if isinstance(devices, str) and "," in devices:
        return [int(p) for p in devices.split(",") if p.strip()]
    return None


# ---------------------------------------------------------------------------------- trainer.strategy
class _FasttrainStrategy:
    """fasttrain's behaviour behind Lightning's strategy classes (first in their MRO)."""

    handles_gradient_accumulation = False

    def __init__(self, trainer, accelerator, **kwargs):
        self._trainer = trainer  # fasttrain.lightning.Trainer
        super().__init__(accelerator=accelerator, **kwargs)

    def __getstate__(self) -> dict:
        # the wrappers' classes are built per optimizer class and cannot be pickled by name;
        # the trainer rebuilds them when it is loaded
        return {**self.__dict__, "_lightning_optimizers": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------ what it holds: the trainer's
    @property
    def root_device(self) -> torch.device:
        trainer = self._trainer
        if trainer._runner is None:
            from fasttrain.lightning.trainer import planned_device

            return planned_device(trainer)
        # accelerate may name the CPU of a process group "cpu:0"; Lightning's is "cpu"
        return torch.device("cpu") if trainer._device.type == "cpu" else trainer._device

    @property
    def lightning_module(self):
        return self._trainer.lightning_module

    @property
    def model(self):
        return self._trainer.model

    @model.setter
    def model(self, model) -> None:
        self._model = model

    def connect(self, model) -> None:
        """Lightning's connect: the module the trainer's runs use."""
        self._trainer._module = model

    @property
    def optimizers(self) -> list:
        return self._trainer.optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list) -> None:
        self._trainer.optimizers = list(optimizers)
        self._trainer._wrap_optimizers()

    @property
    def lr_scheduler_configs(self) -> list:
        return self._trainer.lr_scheduler_configs

    @lr_scheduler_configs.setter
    def lr_scheduler_configs(self, configs: list) -> None:
        self._trainer.lr_scheduler_configs = configs

    @property
    def precision_plugin(self):
        return self._trainer.precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None:
            self._trainer.precision_plugin = plugin

    @property
    def is_global_zero(self) -> bool:
        return self._trainer.is_global_zero

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[str] = "mean"):
        if not isinstance(tensor, torch.Tensor) or not _distributed():
            return tensor
        op = str(reduce_op).lower() if reduce_op is not None else "mean"
        ops = {"mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"reduce_op must be one of {sorted(ops)}, got {reduce_op!r}")
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=ops[op], group=group)
        if op in ("mean", "avg"):
            tensor = tensor / dist.get_world_size(group)
        return tensor

    def broadcast(self, obj, src: int = 0):
        if not _distributed():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed():
            dist.barrier()

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if not _distributed():
            return decision
        # a callback's decision (early stopping, saving) must agree across processes
        flag = torch.tensor(int(bool(decision)), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        count = int(flag.item())  # SYNC(callback): once per decision, read after the all-reduce
        return count == dist.get_world_size() if all else count > 0

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if not _distributed():
            return tensor
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return torch.stack(out)

    def remove_checkpoint(self, filepath) -> None:
        if not self.is_global_zero:
            return
        io = self._trainer._checkpoint_io
        if io is not None:  # a CheckpointIO plugin removes its own files
            io.remove_checkpoint(filepath)
        else:
            ckpt_files.remove(filepath)

    @property
    def checkpoint_io(self):
        """The ``CheckpointIO`` plugin given to the Trainer (None: fasttrain's own file writing)."""
        return self._trainer._checkpoint_io

    def teardown(self) -> None:
        """Lightning's end of every run (before ``on_fit_end`` and the teardown hooks, or after an
        error's ``on_exception``): off the CPU, the optimizers' state and the module move to the
        CPU (an FSDP2-sharded module stays where it is); the plugins (a ``CheckpointIO`` one
        included) end."""
        if self.root_device.type != "cpu" and not isinstance(self, LightningFSDPStrategy):
            _optimizers_to_device(self.optimizers, torch.device("cpu"))
            if self.lightning_module is not None:
                self.lightning_module.cpu()  # SYNC(stop): once, as a run ends (Lightning's teardown)
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if self.checkpoint_io is not None:  # a CheckpointIO plugin ends with the run (AsyncCheckpointIO waits)
            self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ the step
    def backward(self, closure_loss, optimizer=None, *args, **kwargs):
        """``on_before_backward`` -> the module's ``backward`` (scaled under fp16) ->
        ``on_after_backward``, as Lightning's strategy runs them."""
        trainer = self._trainer
        hooks = trainer._backward_hooks  # the HookCaller, or the graphed engine's (graphed_hooks.py)
        hooks("on_before_backward", closure_loss)
        scaler = trainer._scaler()
        loss = scaler.scale(closure_loss) if scaler is not None else closure_loss
        trainer._hooks.module_hook("backward", loss, *args, **kwargs)
        hooks("on_after_backward")
        return closure_loss

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's precision plugins' step: the optimizer's ``step`` gets a closure that runs
        ``closure`` and then ``on_before_optimizer_step`` and clipping, so an optimizer that
        evaluates the closure several times (LBFGS) works; returns what the optimizer's ``step``
        returns. Under fp16 the closure runs first and the scaler steps, as in Lightning's
        ``MixedPrecision``."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        scaler = self._trainer._scaler()
        if scaler is None:
            def closure_then_hooks():
                result = closure()
                self._after_closure(optimizer)
                return result

            return optimizer.step(closure=closure_then_hooks, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure()
        scaler.unscale_(optimizer)
        self._after_closure(optimizer)
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    def _after_closure(self, optimizer) -> None:
        trainer = self._trainer
        trainer._hooks("on_before_optimizer_step", optimizer)
        if trainer.lightning_module.automatic_optimization:
            trainer._hooks.module_hook(
                "configure_gradient_clipping", optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            )


class _LaunchedProcesses:
    """The process layout of a parallel strategy: the launch's (torchrun, accelerate launch)."""

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank

    @property
    def node_rank(self) -> int:
        return self._trainer.node_rank

    @property
    def world_size(self) -> int:
        return self._trainer.world_size

    @property
    def num_processes(self) -> int:
        return max(self._trainer.world_size // self._trainer.num_nodes, 1)

    @property
    def parallel_devices(self) -> list:
        device = self.root_device
        if device.type == "cpu":
            return [torch.device("cpu")] * self.num_processes
        return [torch.device(device.type, i) for i in range(self.num_processes)]

    @parallel_devices.setter
    def parallel_devices(self, devices) -> None:
        self._parallel_devices = devices

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class SingleDeviceStrategy(_FasttrainStrategy, LightningSingleDeviceStrategy):
    """One process on one device (Lightning's ``SingleDeviceStrategy``; its ranks are 0 of 1)."""

    def __init__(self, trainer, accelerator):
        super().__init__(trainer, accelerator, device=torch.device("cpu"))  # root_device is the trainer's


class DDPStrategy(_FasttrainStrategy, _LaunchedProcesses, LightningDDPStrategy):
    """DDP through accelerate over the launch's processes (Lightning's ``DDPStrategy``)."""

    def __init__(self, trainer, accelerator, choice: StrategyChoice):
        super().__init__(trainer, accelerator, start_method=choice.start_method, **choice.ddp_kwargs)
        if "timeout" in choice.process_group_kwargs:
            self._timeout = choice.process_group_kwargs["timeout"]
        self._process_group_backend = choice.process_group_kwargs.get("backend")
        self._num_nodes = trainer.num_nodes


class FSDPStrategy(_FasttrainStrategy, _LaunchedProcesses, LightningFSDPStrategy):
    """FSDP2 through accelerate over the launch's processes (Lightning's ``FSDPStrategy``)."""

    def __init__(self, trainer, accelerator):
        super().__init__(trainer, accelerator)
        self.num_nodes = trainer.num_nodes


def build_strategy(trainer, choice: StrategyChoice, accelerator):
    """``trainer.strategy`` for ``choice``: ``"auto"`` is DDP when the launch has several
    processes (read from its environment) or ``devices`` times ``num_nodes`` asks for several,
    as Lightning chooses, else one device."""
    kind = choice.kind
    if kind == "auto":
        devices = trainer._args.devices
        several = devices not in ("auto", -1, "-1") and _count_devices(devices) * trainer.num_nodes > 1
        kind = "ddp" if int(os.environ.get("WORLD_SIZE", 1)) > 1 or several else "single"
    if kind == "fsdp":
        return FSDPStrategy(trainer, accelerator)
    if kind == "ddp":
        return DDPStrategy(trainer, accelerator, choice)
    return SingleDeviceStrategy(trainer, accelerator)


__all__ = ["DDPStrategy", "FSDPStrategy", "SingleDeviceStrategy", "StrategyChoice", "build_strategy",
           "check_devices_argument", "check_launch", "device_ids", "parse_strategy"]


def device_ids(trainer) -> list:
    """``trainer.device_ids``: the device indices of this node, as Lightning lists them (those
    ``devices`` names, ``range(N)`` for a count, else one per process of the launch)."""
    devices = trainer._args.devices
    indices = device_indices(devices)
    if indices is not None:
        return indices
    if devices not in ("auto", -1, "-1"):
        return list(range(_count_devices(devices)))
    per_node = max(trainer.world_size // trainer.num_nodes, 1)
    if per_node == 1:
        return [trainer.strategy.root_device.index or 0]
    return list(range(per_node))

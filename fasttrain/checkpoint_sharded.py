"""Checkpoints of sharded models through ``torch.distributed.checkpoint`` (DCP).

When the prepared model's parameters are ``DTensor`` shards (FSDP2's ``fully_shard``, which
accelerate applies for an ``FullyShardedDataParallelPlugin(fsdp_version=2)``), no process holds
the whole model or optimizer state, so ``model.state_dict()`` on process 0 is one shard of it.
:mod:`fasttrain.checkpointing` then takes the paths here, decided from the model itself:

* :func:`full_state_dicts` / :func:`load_full_state_dicts`: a **checkpoint** holds the
  consolidated model (and optimizer) state, gathered with ``full_state_dict=True`` into process
  0's CPU memory and written in the same format as a single process writes, so that any number of
  processes, one included, loads it; a sharded run loads one with ``broadcast_from_rank0``.
* :func:`save_sharded` / :func:`load_sharded`: a **training state** keeps the model and
  optimizer sharded: every process writes its own shards into the ``dcp`` folder of the state,
  read back by the same number of processes; :func:`window_gradients` /
  :func:`restore_window_gradients` carry the gradients of an open accumulation window.

States that fasttrain cannot save correctly (FSDP1, DeepSpeed's partitioned ZeRO stages) are
refused by :func:`is_sharded` with an error that says what to use instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import DistributedType

from fasttrain.sharding import is_fsdp2
from fasttrain.checkpoint_files import CheckpointError

DCP_DIR = "dcp"
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_PROCESS_FILE = re.compile(r"(?:grads|rng_state)_(\d+)\.pt")
_WINDOW_REFUSED = (
    "Not saving the training state: the save falls inside a gradient accumulation window of a "
    "sharded model whose partial gradients {why}. Save at an optimizer update: "
    "save_every_n_steps a multiple of gradient_accumulation_steps."
)


def is_sharded(trainer) -> bool:
    """Whether ``trainer``'s prepared model is sharded by FSDP2; raises
    :class:`~fasttrain.checkpointing.CheckpointError` for the sharded set-ups whose states
    fasttrain cannot write correctly."""
    if not torch.distributed.is_available():
        return False  # a torch built without torch.distributed shards nothing
    model = trainer.get_model(keep_torch_compile=False)
    _refuse_unsupported(trainer, model)
    return is_fsdp2(model)


def _refuse_unsupported(trainer, model) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise CheckpointError(
            "fasttrain cannot save or load the state of an FSDP1 model correctly (its flat "
            "parameters and optimizer state are sharded across processes). Use FSDP2: "
            "Trainer(..., accelerator_kwargs={'fsdp_plugin': "
            "FullyShardedDataParallelPlugin(fsdp_version=2)}) or fsdp_version: 2 in accelerate's "
            "config; its checkpoints go through torch.distributed.checkpoint."
        )
    accelerator = trainer._accelerator
    if type(model).__name__ == "DeepSpeedEngine" or getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED:
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        stage = getattr(plugin, "zero_stage", None)
        # ZeRO-3 partitions the parameters even in one process, ZeRO-1/2 the optimizer state
        # across processes
        if stage is None or stage == 3 or (stage > 0 and accelerator.num_processes > 1):
            raise CheckpointError(
                f"fasttrain cannot save or load DeepSpeed ZeRO stage {stage} states: the optimizer "
                "state (and with stage 3 the parameters) is partitioned across processes. Use "
                "accelerator.save_state(dir) / accelerator.load_state(dir) "
                "(trainer._accelerator), which call DeepSpeed's own checkpointing, or train with "
                "FSDP2, whose states fasttrain writes through torch.distributed.checkpoint."
            )


def _optimizer(trainer):
    # accelerate's wrapper forwards state_dict() but torch's DCP helpers want the optimizer itself
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


# ------------------------------------------------------------------------------- consolidated
# wrappers whose attribute torch's state-dict helpers leave out of parameter names
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _fqn(name: str) -> str:
    """A parameter's name as torch's state-dict helpers write it (wrappers such as a block
    compiled with ``torch.compile(block)`` left out)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _parameter_ids(model, optimizer) -> dict:
    """Fully qualified parameter name -> the integer id ``optimizer.state_dict()`` gives it (ids
    count the parameters of the parameter groups in order)."""
    names = {id(p): _fqn(name) for name, p in model.named_parameters()}
    ids = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    "The optimizer holds a parameter that is not one of the model's, so its state "
                    "cannot be named in a checkpoint of a sharded model; build the optimizer from "
                    "model.parameters()."
                )
            ids[names[id(p)]] = len(ids)
    return ids


def _to_ids(state: dict, ids: dict) -> dict:
    """A state dict keyed by parameter names (DCP's) in ``optimizer.state_dict()``'s format."""
    try:
        return {
            "state": {ids[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [ids[name] for name in g["params"]]} for g in state["param_groups"]],
        }
    except KeyError as e:
        raise CheckpointError(
            f"torch names an optimizer parameter {e}, which is none of the model's parameter names "
            f"({', '.join(sorted(ids)[:5])}, ...): a wrapper fasttrain does not know renames them. "
            "Save with save_optimizer=False, or save a training state (save_training_state)."
        ) from e


def _to_names(state: dict, ids: dict) -> dict:
    names = {i: name for name, i in ids.items()}
    try:
        return {
            "state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
        }
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"The checkpoint's optimizer state does not fit this optimizer (parameter {e} is not "
            "one of its parameters); build the same optimizer as the saved run, or load with "
            "load_optimizer=False."
        ) from e


def full_state_dicts(trainer, with_optimizer: bool, writers_on_every_node: bool):
    """``(model_state, optimizer_state or None)`` of the sharded model, whole, in the formats
    a single process's ``state_dict()`` gives. Every process must call this (it all-gathers the
    shards); the values are on the CPU of process 0 only, or with ``writers_on_every_node`` on
    every process (each machine's first process then has a copy to write)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = trainer.get_model(keep_torch_compile=False)
    # cpu_offload=True gathers each tensor to process 0's CPU memory, one at a time; a copy on
    # every process comes gathered on the device and is moved to the CPU here
    options = StateDictOptions(full_state_dict=True, cpu_offload=not writers_on_every_node)
    model_state = _to_cpu(get_model_state_dict(model, options=options))
    optimizer_state = None
    if with_optimizer:
        optimizer = _optimizer(trainer)
        ids = _parameter_ids(model, optimizer)  # on every process: a bad optimizer fails on all
        if not optimizer.state:
            # before the first update there is nothing sharded to gather; DCP would initialise the
            # state with a zero-gradient step (a first step count the run never took)
            optimizer_state = optimizer.state_dict()
        else:
            gathered = _to_cpu(get_optimizer_state_dict(model, optimizer, options=options))
            optimizer_state = _to_ids(gathered, ids) if gathered else {}
    return model_state, optimizer_state


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()  # SYNC(save): the gathered state is written from host memory
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def load_full_state_dicts(trainer, model_state: dict, optimizer_state: Optional[dict]) -> None:
    """Load whole (consolidated) states into the sharded model and optimizer: process 0's values
    are broadcast and every process keeps its shards. Every process must call this."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = trainer.get_model(keep_torch_compile=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer_state is None:
        return
    optimizer = _optimizer(trainer)
    if not optimizer_state.get("state"):
        optimizer.load_state_dict(optimizer_state)  # parameter groups only, nothing sharded
        return
    named = _to_names(optimizer_state, _parameter_ids(model, optimizer))
    set_optimizer_state_dict(model, optimizer, named, options=options)


# ------------------------------------------------------------------------------- DCP states
def save_sharded(trainer, staging: Path) -> dict:
    """Write the model and optimizer shards of this process with DCP into ``staging/dcp`` (every
    process must call this; DCP coordinates the writes). Returns what the metadata records."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = trainer.get_model(keep_torch_compile=False)
    optimizer = _optimizer(trainer)
    state = {"model": get_model_state_dict(model)}
    with_optimizer_state = bool(optimizer.state)
    if with_optimizer_state:
        # an empty state (before the first update) is saved as optimizer.pt instead: DCP would
        # initialise it with a zero-gradient step, a step count the run never took
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=staging / DCP_DIR)
    return {"format": "torch.distributed.checkpoint", "dir": DCP_DIR, "optimizer_state": with_optimizer_state}


def shard_files_of(rank: int, directory: Path) -> list:
    """The files of a DCP folder that process ``rank`` hashes: its own shard files, and for
    process 0 also the files no process owns (DCP's ``.metadata``)."""
    names = []
    for path in sorted(directory.iterdir()):
        match = _SHARD_FILE.fullmatch(path.name)
        if (match and int(match.group(1)) == rank) or (match is None and rank == 0):
            names.append(path.name)
    return names


# ------------------------------------------------------------------------------- open windows
def _fsdp_params(model) -> list:
    """``(name, FSDPParam)`` for every parameter FSDP2 manages. Between the micro-steps of an
    accumulation window FSDP2 keeps each process's gradient sums unsharded (not yet
    reduce-scattered) in these objects, which are torch internals: when this torch lays them out
    differently a save inside a window is refused rather than written without them."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): name for name, p in model.named_parameters()}
    found = []
    try:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch releases with one parameter group per module
                group = state._fsdp_param_group
                groups = [] if group is None else [group]
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    fsdp_param.unsharded_accumulated_grad  # noqa: B018  (present in every layout read here)
                    found.append((names[id(fsdp_param.sharded_param)], fsdp_param))
    except (AttributeError, KeyError) as e:
        raise CheckpointError(_WINDOW_REFUSED.format(why=f"this torch's FSDP2 keeps where fasttrain cannot read them ({e})")) from e
    return found


def _leaf_accumulates(params: list) -> bool:
    """Whether this torch's FSDP2 (its ``FSDPParam`` class, which ``params`` from
    :func:`_fsdp_params` are) sums a window's gradients in the unsharded parameter's ``.grad``
    (torch 2.15 on; ``unsharded_accumulated_grad`` is then a read-only view of it) rather than
    in a buffer of its own (torch 2.11 to 2.14)."""
    if not params:
        return False
    attribute = getattr(type(params[0][1]), "unsharded_accumulated_grad", None)
    return isinstance(attribute, property) and attribute.fset is None


def _make_unsharded_params(model) -> None:
    """FSDP2 creates a module's unsharded parameters at its first all-gather: one unshard and
    reshard of every FSDP module (collectives: every process restores a window, so every process
    calls them, in the same order)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def window_gradients(model) -> dict:
    """The gradients this process holds inside an accumulation window: FSDP2's unsharded sums
    (whole-parameter sized, this process's micro-steps only), the gradient shards of parameters
    that have one, and the gradients of parameters FSDP2 does not manage."""
    from torch.distributed.tensor import DTensor

    unsharded = {}
    for name, fsdp_param in _fsdp_params(model):
        grad = fsdp_param.unsharded_accumulated_grad
        if grad is None and hasattr(fsdp_param, "_unsharded_param"):
            grad = fsdp_param._unsharded_param.grad
        if isinstance(grad, DTensor):
            raise CheckpointError(_WINDOW_REFUSED.format(why="are themselves distributed (HSDP or tensor parallel)"))
        if grad is not None:
            unsharded[name] = grad
    sharded, plain = {}, {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            sharded[name] = p.grad.to_local()
        elif p.grad is not None:
            plain[name] = p.grad
    return {"unsharded": unsharded, "sharded": sharded, "plain": plain}


def restore_window_gradients(model, saved: Optional[dict]) -> None:
    """Put back what :func:`window_gradients` returned (``None``: a state saved at an update,
    no window open): FSDP2 adds the next micro-step's gradients to the restored sums, in the
    same order as an uninterrupted run."""
    from torch.distributed.tensor import DTensor

    saved = saved or {}
    unsharded = saved.get("unsharded", {})
    params = _fsdp_params(model)
    leaf_accumulates = _leaf_accumulates(params)
    if unsharded and leaf_accumulates:
        _make_unsharded_params(model)
    for name, fsdp_param in params:
        grad = unsharded.get(name)
        value = None if grad is None else grad.to(fsdp_param.sharded_param.device)
        if leaf_accumulates:
            # this torch sums a window's micro-steps in the unsharded parameter's own .grad
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = value
            continue
        if hasattr(fsdp_param, "_unsharded_param"):
            fsdp_param._unsharded_param.grad = None
        fsdp_param.unsharded_accumulated_grad = value
    held = {**saved.get("sharded", {}), **saved.get("plain", {})}
    for name, p in model.named_parameters():
        value = held.get(name)
        if value is None:
            if p.grad is not None:
                p.grad.zero_()  # engines with static gradient buffers keep them, zeroed
        elif p.grad is not None:
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(value)
        elif isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                value.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = value.to(device=p.device, dtype=p.dtype)


# ------------------------------------------------------------------------------- file owners
def file_owner(name: str) -> Optional[int]:
    """The process that wrote ``name`` (a path in a training state) when one process wrote it
    for itself: a DCP shard file, a gradients or a random state file."""
    folder, _, file_name = name.rpartition("/")
    match = _SHARD_FILE.fullmatch(file_name) if folder == DCP_DIR else _PROCESS_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def load_sharded(trainer, input_dir: Path, saved: dict) -> None:
    """Read this process's shards of the model and optimizer from ``input_dir/dcp`` into the
    sharded model and optimizer (every process must call this)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model = trainer.get_model(keep_torch_compile=False)
    optimizer = _optimizer(trainer)
    checkpoint_id = input_dir / saved.get("dir", DCP_DIR)
    if saved.get("optimizer_state"):
        # the templates DCP fills in place: this run's shards, with the optimizer's state
        # initialised when it has none yet (overwritten by the loaded values)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=checkpoint_id)
        set_model_state_dict(model, state["model"])

"""Optimizer hyperparameters handed to compiled code as device tensors, so schedules never
recompile or re-capture.

A compiled optimizer step guards on every Python float it reads: a scheduler that assigns a new
``group["lr"]`` float each update would recompile the step each update, and a CUDA graph would
keep replaying the learning rate it was captured with. Inside fasttrain's compiled functions (and
their CUDA graphs) the learning rate (and Adam's betas, which ``OneCycleLR`` cycles by default)
are therefore 0-dim tensors on the parameters' device, graph inputs whose values are copied in
before each call.

Everywhere else the parameter groups hold the values the user and the scheduler put there (plain
floats): a callback that appends ``group["lr"]`` to the run history, a scheduler computing the next
rate from the current one, ``json.dumps`` of the groups, a checkpoint, all see what they would see
under the eager engine. :class:`TensorHyperparams` lends the tensors to the groups for the
duration of each compiled call (:meth:`~TensorHyperparams.lend`,
:meth:`~TensorHyperparams.hand_back`) and copies a changed value into its tensor before it
(:meth:`~TensorHyperparams.write`): a host write, never a read.

Fused Adam/AdamW (``fused=True``) is the exception for the betas: its kernel takes them as
floats only, so tensor betas would be read back to the host twice per update. There the betas
stay floats (:func:`tensor_fields` decides, per group) and a scheduler that changes them is
warned about, as for any other setting compiled in as a constant; the learning rate is still a
tensor (the fused kernel has an overload for it).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

#: optimizers whose steps accept a tensor learning rate (and, for the Adam family, tensor betas)
TENSOR_LR_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_TENSOR_BETAS_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
#: optimizers that can be captured in a CUDA graph (``capturable`` state, no host reads)
CAPTURABLE_OPTIMIZERS = TENSOR_LR_OPTIMIZERS


def tensor_fields(optimizer, group: dict) -> Tuple[str, ...]:
    """The settings of ``group`` that :class:`TensorHyperparams` holds as device tensors: the
    learning rate of SGD/Adam/AdamW, and the betas of Adam/AdamW unless the group is fused
    (the fused kernel reads betas as floats; a tensor there is a host read per update)."""
    if not isinstance(optimizer, TENSOR_LR_OPTIMIZERS):
        return ()
    if isinstance(optimizer, _TENSOR_BETAS_OPTIMIZERS) and not group.get("fused"):
        return ("lr", "betas")
    return ("lr",)


def settings_advice(changes: List[str]) -> str:
    """What to do about the settings a scheduler changes that are compiled in as constants."""
    if any("['betas']" in change for change in changes):
        return (
            "fused Adam/AdamW takes betas as floats (a tensor would be read back every update), so "
            "a captured or compiled step holds their value: use cycle_momentum=False in the "
            "scheduler, or fused=False (whose betas are held as tensors and may change freely)"
        )
    return (
        "Keep it constant (e.g. OneCycleLR(cycle_momentum=False) with SGD); the learning rate "
        "and Adam's betas (not fused) are held as tensors and may change freely"
    )


#: optimizer -> the parameter groups an engine switched to ``capturable=True`` (the user did not)
_MADE_CAPTURABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plain(value):
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()  # SYNC(save): a checkpoint is written on the host, once per value
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_plain(v) for v in value)
    return value


def plain_optimizer_state(optimizer, state: Optional[dict] = None) -> dict:
    """``optimizer.state_dict()`` (or ``state``, in its format) as the user's optimizer would
    write it, with floats for any 0-dim tensor learning rate or betas (a user's own; the engines
    lend theirs to the groups only during compiled calls), and ``capturable=False`` where an
    engine switched it on, with those groups' step counters on the host. A checkpoint then loads on a machine without the device, and an eager SGD resumed from
    it steps with a float learning rate instead of reading a tensor every step."""
    opt = inner_optimizer(optimizer)
    state = opt.state_dict() if state is None else state
    made = {id(group) for group in _MADE_CAPTURABLE.get(opt, ())}
    forced = [id(group) in made for group in opt.param_groups]
    if len(forced) != len(state.get("param_groups", ())):
        forced = [False] * len(state.get("param_groups", ()))
    per_param = dict(state.get("state", {}))
    groups = []
    for saved, made_capturable in zip(state.get("param_groups", ()), forced):
        group = {key: value if key == "params" else _plain(value) for key, value in saved.items()}
        if made_capturable:
            group["capturable"] = False
            for index in saved["params"]:
                entry = per_param.get(index)
                step = entry.get("step") if entry else None
                if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                    # a non-capturable Adam keeps its step counter on the host
                    per_param[index] = {**entry, "step": step.to("cpu")}  # SYNC(save): once per parameter
        groups.append(group)
    return {**state, "state": per_param, "param_groups": groups}


def inner_optimizer(optimizer):
    """The torch optimizer under accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def steps_in_fused_kernels(optimizer) -> bool:
    """True for a torch optimizer whose every parameter group steps with its fused kernel
    (``Adam/AdamW/SGD/Adagrad(fused=True)``). Dynamo does not trace those kernels (torch wraps
    them in ``torch.compiler.disable``): a compiled step runs them as it would eagerly, behind a
    graph break."""
    optimizer = inner_optimizer(optimizer)
    groups = getattr(optimizer, "param_groups", None)
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        and bool(groups)
        and all(group.get("fused") for group in groups)
    )


def _group_device(group: dict) -> torch.device:
    for p in group["params"]:
        return p.device
    return torch.device("cpu")


def _host_value(value) -> float:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError("a device tensor is copied in place, not read")
        return float(value)
    return float(value)


def _write(target: torch.Tensor, value) -> None:
    # A device tensor is copied device-to-device; a CPU tensor or a float is written as a
    # scalar. Neither waits for the device (copying a pageable CPU tensor would).
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        target.copy_(value.reshape(()))
    else:
        target.fill_(_host_value(value))


#: optimizer -> the :class:`_Held` of its groups, shared by every engine holding them (a second
#: ``train()``, a fallback, the evaluation's engine): compiled code that saw the tensors needs no
#: new trace, and what was last copied into a tensor is known to all of them
_HELD_TENSORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _copy_in(held: torch.Tensor, value, seen) -> None:
    # The group's value into the tensor held for it, where it may differ from what was copied
    # last: numbers are compared on the host; a tensor is copied every time (it may have been
    # written in place), unless it is the held tensor itself.
    if value is held:
        return
    if isinstance(value, torch.Tensor) or isinstance(seen, torch.Tensor) or value != seen:
        _write(held, value)


def _written_inside(held: torch.Tensor, version: int):
    """The value code inside a compiled call wrote into ``held`` in place, as the group shows it
    from now on: a float on the CPU, a copy on a device (reading it would wait for the device)."""
    if held._version == version:
        return None
    if held.device.type == "cpu":
        return float(held)
    return held.detach().clone()


class _Held:
    """One parameter group's held tensors and the values its group shows outside compiled calls."""

    __slots__ = ("group", "lr", "lr_seen", "lr_version", "betas", "betas_seen", "betas_versions")

    def __init__(self, group: dict, lr: torch.Tensor, betas: Optional[Tuple[torch.Tensor, torch.Tensor]]):
        self.group = group
        self.lr = lr
        self.lr_seen = group["lr"]
        self.lr_version = 0
        self.betas = betas
        self.betas_seen = group.get("betas")
        self.betas_versions = (0, 0)


def _holds(held: Optional[_Held], lr: torch.Tensor, betas) -> bool:
    if held is None or held.lr is not lr or (held.betas is None) != (betas is None):
        return False
    return betas is None or (held.betas[0] is betas[0] and held.betas[1] is betas[1])


class TensorHyperparams:
    """Holds the learning rate (and Adam's betas) of every parameter group as 0-dim tensors for
    the life of an engine, and lends them to the groups while compiled code runs.

    :param capturable: also switch Adam/AdamW to ``capturable=True`` (device-side step counter,
        no host reads), which CUDA graphs need and which a tensor learning rate needs with the
        foreach implementation on CUDA.
    """

    def __init__(self, optimizer, capturable: bool = False):
        self.optimizer = inner_optimizer(optimizer)
        self.capturable = capturable
        self.supported = isinstance(self.optimizer, TENSOR_LR_OPTIMIZERS)
        self._groups: Optional[list] = None
        self._num_groups = 0
        self._state = None
        self._held: List[_Held] = []
        self._watched: List[Dict[str, object]] = []
        self._made_capturable: List[dict] = []

    # ------------------------------------------------------------------ setup
    def apply(self) -> bool:
        """Hold tensors for the groups' values (the groups keep theirs); returns False (and
        changes nothing) when the optimizer does not accept tensors there."""
        if not self.supported:
            return False
        opt = self.optimizer
        earlier = {id(held.group): held for held in _HELD_TENSORS.get(opt, ())}
        self._held = []
        for group in opt.param_groups:
            device = _group_device(group)
            before = earlier.get(id(group))
            if before is not None and before.group is not group:
                before = None
            lr = self._tensor_for(group["lr"], device, before and before.lr)
            betas = None
            tensor_betas = "betas" in tensor_fields(opt, group)
            if tensor_betas:
                b1, b2 = group["betas"]
                old = (before and before.betas) or (None, None)
                betas = (self._tensor_for(b1, device, old[0]), self._tensor_for(b2, device, old[1]))
            self._held.append(before if _holds(before, lr, betas) else _Held(group, lr, betas))
            if self.capturable and tensor_betas and device.type == "cuda":
                self._make_capturable(group)
        _HELD_TENSORS[opt] = list(self._held)
        self.write()
        self._groups = opt.param_groups
        self._num_groups = len(opt.param_groups)
        self._state = opt.state
        self._watched = [self._watched_values(h.group, h.betas) for h in self._held]
        return True

    @classmethod
    def _tensor_for(cls, value, device: torch.device, earlier: Optional[torch.Tensor]) -> torch.Tensor:
        # The user's own 0-dim float32 tensor on the device is used as it is; a tensor held by an
        # earlier engine for this group is kept (compiled code that saw it needs no new trace)
        # and given the current value. Setup time, once per value: a copy from the host (or
        # another device) may wait for the device here, never in the step loop.
        if isinstance(value, torch.Tensor) and value.device == device and value.dim() == 0:
            if value.dtype == torch.float32:
                return value
        if earlier is not None and earlier.device == device:
            _write(earlier, value)
            return earlier
        if isinstance(value, torch.Tensor):
            return value.detach().reshape(()).to(device=device, dtype=torch.float32).clone()
        return torch.tensor(float(value), dtype=torch.float32, device=device)

    def _make_capturable(self, group: dict) -> None:
        if not group.get("capturable"):
            self._made_capturable.append(group)
            _MADE_CAPTURABLE.setdefault(self.optimizer, []).append(group)
        group["capturable"] = True
        # torch warns once when a capturable optimizer steps outside a capture, because the
        # device-side step counter costs a few kernels; compiled steps want it (no host reads)
        self.optimizer._warned_capturable_if_run_uncaptured = True
        # State created by an earlier non-capturable step keeps its step counter on the host;
        # the capturable step expects it on the parameter's device.
        for p in group["params"]:
            state = self.optimizer.state.get(p)
            if state and isinstance(state.get("step"), torch.Tensor) and state["step"].device != p.device:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def _watched_values(self, group: dict, betas) -> Dict[str, object]:
        # The float/bool settings the step reads that are not held as tensors: a change in one of
        # them recompiles a compiled step, and a captured graph would ignore it.
        skip = {"lr", "params", "param_names"}
        if betas is not None:
            skip.add("betas")
        return {k: group.get(k) for k in self.optimizer.defaults if k not in skip}

    # ------------------------------------------------------------------ per call
    @property
    def groups_replaced(self) -> bool:
        """True when ``optimizer.load_state_dict`` (or similar) replaced the parameter groups or
        the state, or ``add_param_group`` added a group (unfreezing), since :meth:`apply`:
        captured graphs hold the old tensors."""
        opt = self.optimizer
        groups = opt.param_groups
        return groups is not self._groups or opt.state is not self._state or len(groups) != self._num_groups

    def write(self) -> None:
        """Copy the values the groups show (a scheduler's new learning rate) into the held
        tensors, before a compiled call or a graph's replay. Host work only: one identity check
        per group and field, and a host write where a value changed. Not inside a capture (the
        write would be recorded)."""
        for held in self._held:
            group = held.group
            value = group["lr"]
            if value is not held.lr_seen or type(value) is not float:
                _copy_in(held.lr, value, held.lr_seen)
                held.lr_seen = value
            if held.betas is not None:
                current = group["betas"]
                seen = held.betas_seen
                if current is not seen or type(current[0]) is not float or type(current[1]) is not float:
                    for target, new, old in zip(held.betas, current, seen):
                        _copy_in(target, new, old)
                    held.betas_seen = current

    def lend(self) -> None:
        """Put the held tensors in the groups, for a compiled call (or a capture) that reads them
        as graph inputs. :meth:`write` first, outside a capture."""
        for held in self._held:
            group = held.group
            group["lr"] = held.lr
            held.lr_version = held.lr._version
            if held.betas is not None:
                group["betas"] = held.betas
                held.betas_versions = (held.betas[0]._version, held.betas[1]._version)

    def lent(self, fn: Callable, *args):
        """``fn(*args)`` with the held tensors lent to the groups (:meth:`lend`), and the groups'
        own values given back after it, also when it raises (:meth:`hand_back`)."""
        self.lend()
        try:
            return fn(*args)
        finally:
            self.hand_back()

    def hand_back(self) -> None:
        """Give the groups their own values back after a compiled call. A value the call
        assigned stays; one it wrote into a held tensor in place (a scheduler stepped inside an
        overridden ``optimizer_step``) becomes the group's value."""
        for held in self._held:
            group = held.group
            if group["lr"] is held.lr:
                inside = _written_inside(held.lr, held.lr_version)
                if inside is not None:
                    held.lr_seen = inside
                group["lr"] = held.lr_seen
            # else the call assigned a value: the group keeps it, and the next write copies it
            if held.betas is not None:
                if group["betas"] is held.betas:
                    written = [_written_inside(b, v) for b, v in zip(held.betas, held.betas_versions)]
                    if any(value is not None for value in written):
                        held.betas_seen = tuple(
                            old if new is None else new for old, new in zip(held.betas_seen, written)
                        )
                    group["betas"] = held.betas_seen

    def changed_settings(self) -> List[str]:
        """The group settings (other than the tensor-held ones) that changed since :meth:`apply`,
        as ``"param_groups[i]['key']: old -> new"``."""
        changes = []
        if self._groups is None:
            return changes
        for i, (held, watched) in enumerate(zip(self._held, self._watched)):
            group = held.group
            for key, old in watched.items():
                new = group.get(key)
                if new is old:
                    continue
                # a tensor is compared by identity: comparing values would read the device
                if isinstance(new, torch.Tensor) or isinstance(old, torch.Tensor) or new != old:
                    changes.append(f"param_groups[{i}][{key!r}]: {old!r} -> {new!r}")
        return changes

    def accept_changes(self) -> None:
        """Take the current settings as the new reference (after a warning was given)."""
        if self._groups is not None:
            self._watched = [self._watched_values(h.group, h.betas) for h in self._held]

    # ------------------------------------------------------------------ teardown
    def release(self) -> None:
        """Stop holding (when an engine falls back to eager): groups this engine switched to
        ``capturable`` are switched back, their step counters moved to the host (eager Adam
        reads a host-side counter for free; a device one would need the capturable code path,
        more kernels, or a host read per step). The groups keep their own values throughout."""
        for group in self._made_capturable:
            group["capturable"] = False
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to("cpu")  # SYNC(fallback): once
        made = _MADE_CAPTURABLE.get(self.optimizer, [])
        made[:] = [g for g in made if not any(g is restored for restored in self._made_capturable)]
        self._made_capturable = []
        self._groups = None
        self._held, self._watched = [], []

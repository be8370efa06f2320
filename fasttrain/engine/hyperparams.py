"""Optimizer hyperparameters held as device tensors, so schedules never recompile or re-capture.

A compiled optimizer step guards on every Python float it reads: a scheduler that assigns a new
``group["lr"]`` float each update would recompile the step each update, and a CUDA graph would
keep replaying the learning rate it was captured with. Holding the learning rate (and Adam's
betas, which ``OneCycleLR`` cycles by default) as 0-dim tensors on the parameters' device turns
them into graph inputs that are overwritten in place.

Fused Adam/AdamW (``fused=True``) is the exception for the betas: its kernel takes them as
floats only, so tensor betas would be read back to the host twice per update. There the betas
stay floats (:func:`tensor_fields` decides, per group) and a scheduler that changes them is
warned about, as for any other setting compiled in as a constant; the learning rate may still be
a tensor (the fused kernel has an overload for it).

Schedulers may still assign floats (torch's own schedulers before 2.2, user code): after each
scheduler step :meth:`TensorHyperparams.sync` copies such a value into the tensor and puts the
tensor back, so the compiled step and the captured graph see the new value. Everything here runs
on the host between steps and never reads a device value.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

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
            "each new value of the betas recompiles the step: use cycle_momentum=False in the "
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
    write it: the learning rates and betas an engine holds as device tensors as floats, and
    ``capturable=False`` where an engine switched it on, with those groups' step counters on the
    host. A checkpoint then loads on a machine without the device, and an eager SGD resumed from
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


class TensorHyperparams:
    """Converts the learning rate (and Adam betas) of every parameter group to 0-dim tensors and
    keeps them in place for the life of an engine.

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
        self._lr: List[torch.Tensor] = []
        self._betas: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = []
        self._watched: List[Dict[str, object]] = []
        self._made_capturable: List[dict] = []

    # ------------------------------------------------------------------ setup
    def apply(self) -> bool:
        """Convert the groups' values; returns False (and changes nothing) when the optimizer
        does not accept tensors there."""
        if not self.supported:
            return False
        opt = self.optimizer
        self._lr, self._betas = [], []
        for group in opt.param_groups:
            device = _group_device(group)
            self._lr.append(self._as_tensor(group, "lr", device))
            tensor_betas = "betas" in tensor_fields(opt, group)
            if tensor_betas:
                b1, b2 = group["betas"]
                betas = (self._held(b1, device), self._held(b2, device))
                group["betas"] = betas
                self._betas.append(betas)
            else:
                self._betas.append(None)
            if self.capturable and tensor_betas and device.type == "cuda":
                self._make_capturable(group)
        self._groups = opt.param_groups
        self._num_groups = len(opt.param_groups)
        self._state = opt.state
        self._watched = [self._watched_values(g, b) for g, b in zip(opt.param_groups, self._betas)]
        return True

    def _as_tensor(self, group: dict, key: str, device: torch.device) -> torch.Tensor:
        tensor = self._held(group[key], device)
        group[key] = tensor
        return tensor

    def _held(self, value, device: torch.device) -> torch.Tensor:
        # A tensor held by an earlier engine (an earlier train(), a fallback) is kept as it is:
        # compiled code that saw it needs no new trace.
        if isinstance(value, torch.Tensor) and value.device == device and value.dim() == 0:
            if value.dtype == torch.float32:
                return value
        return self._scalar_tensor(value, device)

    @staticmethod
    def _scalar_tensor(value, device: torch.device) -> torch.Tensor:
        # Setup time, once per value: a copy from the host (or another device) may wait for the
        # device here, never in the step loop.
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

    # ------------------------------------------------------------------ per update
    @property
    def groups_replaced(self) -> bool:
        """True when ``optimizer.load_state_dict`` (or similar) replaced the parameter groups or
        the state, or ``add_param_group`` added a group (unfreezing), since :meth:`apply`:
        captured graphs hold the old tensors."""
        opt = self.optimizer
        groups = opt.param_groups
        return groups is not self._groups or opt.state is not self._state or len(groups) != self._num_groups

    def sync(self) -> None:
        """Put the tensors back where a scheduler assigned plain values, copying the values in.
        Cheap: one identity check per group and field."""
        if self._groups is None:
            return
        for group, lr, betas in zip(self._groups, self._lr, self._betas):
            value = group["lr"]
            if value is not lr:
                _write(lr, value)
                group["lr"] = lr
            if betas is not None:
                current = group["betas"]
                if current is not betas:
                    for target, new in zip(betas, current):
                        if new is not target:
                            _write(target, new)
                    group["betas"] = betas

    def changed_settings(self) -> List[str]:
        """The group settings (other than the tensor-held ones) that changed since :meth:`apply`,
        as ``"param_groups[i]['key']: old -> new"``."""
        changes = []
        if self._groups is None:
            return changes
        for i, (group, watched) in enumerate(zip(self._groups, self._watched)):
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
            self._watched = [self._watched_values(g, b) for g, b in zip(self._groups, self._betas)]

    # ------------------------------------------------------------------ teardown
    def restore_floats(self) -> None:
        """Turn the tensors back into floats (for an eager step, where a tensor learning rate
        makes SGD read it on the host every step). One host read per value, once."""
        if self._groups is None:
            return
        self.sync()
        for group, lr, betas in zip(self._groups, self._lr, self._betas):
            # SYNC(fallback): once, when an engine falls back to eager; never in the step loop
            group["lr"] = float(lr)
            if betas is not None:
                group["betas"] = (float(betas[0]), float(betas[1]))
        for group in self._made_capturable:
            # eager Adam reads a host-side step counter for free; a device one would need the
            # capturable code path (more kernels) or a host read per step
            group["capturable"] = False
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to("cpu")  # SYNC(fallback): once
        made = _MADE_CAPTURABLE.get(self.optimizer, [])
        made[:] = [g for g in made if not any(g is restored for restored in self._made_capturable)]
        self._made_capturable = []
        self._groups = None
        self._lr, self._betas, self._watched = [], [], []

"""What a captured training step was recorded with, checked on the host before each replay.

A CUDA graph replays kernels on the addresses it saw at capture. A hook or callback that runs
between replays can change what those addresses mean: ``zero_grad(set_to_none=True)`` or a new
``.grad`` tensor leaves the graph accumulating into a tensor nobody reads (or memory already
freed), a parameter frozen or unfrozen changes what backward must compute, parameter groups or
state replaced, or a different optimizer, leave the graph updating tensors the trainer no longer
uses. :class:`CaptureRecord` notices each of these by identity (``is``) and by the structure of
the parameter groups, never by reading a device value, so a check costs a few attribute reads
per parameter and no synchronisation.

Gradient tensors that were only rebound can be put back: the graph's own tensor takes the value
the hook meant (zero for ``None``, a device copy of a new tensor of the same layout), so the
replay sees exactly what an eager step would. Every other change needs a new capture.
"""

from __future__ import annotations

import operator
from typing import FrozenSet, List, Optional

import torch

_grad_of = operator.attrgetter("grad")
_requires_grad_of = operator.attrgetter("requires_grad")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


class CaptureRecord:
    """The optimizer-side tensors and structure a captured step uses.

    :param model: the module the graph's forward ran (its parameters are compared with
        :meth:`model_change`, which walks the module tree and so runs once per epoch).
    :param optimizer: the torch optimizer the graph's update stepped.
    """

    def __init__(self, model: torch.nn.Module, optimizer):
        self.optimizer = optimizer
        self.groups = optimizer.param_groups
        self.group_params = [group["params"] for group in self.groups]
        self.group_sizes = [len(params) for params in self.group_params]
        self.params: List[torch.Tensor] = [p for params in self.group_params for p in params]
        self.grads: List[Optional[torch.Tensor]] = list(map(_grad_of, self.params))
        self.requires_grad: List[bool] = list(map(_requires_grad_of, self.params))
        self.state = optimizer.state
        # the state's mapping as it is, compared by identity before each replay: iterating its
        # keys and values hashes no tensor (Tensor.__hash__ is Python: a lookup per parameter
        # cost 21 microseconds a replay on a model of 150 parameters)
        self.state_keys = list(optimizer.state.keys())
        self.state_values = list(optimizer.state.values())
        self.model_params = list(model.parameters())

    # ------------------------------------------------------------------ checks
    def structure_change(self, optimizer) -> Optional[str]:
        """What changed that a replay cannot absorb (None when nothing did). Host only."""
        if optimizer is not self.optimizer:
            return f"the optimizer was replaced (a {type(optimizer).__name__} now)"
        groups = optimizer.param_groups
        if groups is not self.groups or len(groups) != len(self.group_params):
            return "the optimizer's parameter groups were replaced or added to"
        for group, params, size in zip(groups, self.group_params, self.group_sizes):
            if group["params"] is not params or len(params) != size:
                return "a parameter group's parameter list was replaced or changed"
        if list(map(_requires_grad_of, self.params)) != self.requires_grad:
            return "a parameter's requires_grad changed"
        state = optimizer.state
        if state is not self.state:
            return "the optimizer state was replaced"
        if (
            len(state) != len(self.state_keys)
            or not all(map(operator.is_, state.values(), self.state_values))
            or not all(map(operator.is_, state.keys(), self.state_keys))
        ):
            return "a parameter's optimizer state was replaced, reset or added"
        return None

    def grads_rebound(self) -> bool:
        """True when a gradient attribute no longer holds the tensor the graph writes."""
        return not all(map(operator.is_, map(_grad_of, self.params), self.grads))

    def restore_grads(self, known_zero: FrozenSet[int] = frozenset()) -> Optional[str]:
        """Put the graph's gradient tensors back, carrying what the hook meant: ``None`` becomes
        zeros, a new tensor of the same layout is copied in (device work, queued, no sync).
        ``known_zero``: ids of parameters whose captured gradient is zero already (the update
        graph zeroed it where a hook then set it to None), bound again as they are. Returns why
        that is impossible (a new gradient of another layout), else None."""
        for p, captured in zip(self.params, self.grads):
            current = p.grad
            if current is captured:
                continue
            if captured is None:
                return "a gradient appeared for a parameter that had none when the step was captured"
            if current is not None and not _same_layout(current, captured):
                return "a gradient was replaced by a tensor of another shape, stride, dtype or device"
        zeroed, copied_to, copied_from = [], [], []
        for p, captured in zip(self.params, self.grads):
            current = p.grad
            if current is captured:
                continue
            if current is None:
                if id(p) not in known_zero:
                    zeroed.append(captured)
            else:
                copied_to.append(captured)
                copied_from.append(current)
            p.grad = captured
        # one foreach kernel (per dtype) for what a hook cleared, not one per parameter:
        # a module's own zero_grad(set_to_none=True) leaves every gradient to bind again
        with torch.no_grad():
            if zeroed:
                torch._foreach_zero_(zeroed)
            if copied_to:
                torch._foreach_copy_(copied_to, copied_from)
        return None

    def model_change(self, model: torch.nn.Module) -> Optional[str]:
        """Whether ``model``'s parameters are still the tensors the graph's forward read."""
        current = list(model.parameters())
        if len(current) != len(self.model_params) or not all(map(operator.is_, current, self.model_params)):
            return "the model's parameters were replaced"
        return None

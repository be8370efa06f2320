"""Undo a step that failed half way, so a fallback engine can redo it exactly once.

The first compiled (or captured) step of an engine is an experiment: tracing may stop at a
graph break, inductor may fail to compile, a hook may read a device value during capture. Some of
these fail after part of the step already ran (the clip kernel scaled the gradients, a forward
updated BatchNorm statistics). :class:`StepSnapshot` copies every tensor a step can mutate before
the experiment and writes the copies back, into the same tensor objects, when it fails. It is
taken at most a few times per engine; its cost is one copy of the model, its gradients and the
optimizer state, on the same device (a device-to-device copy, no host sync).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class StepSnapshot:
    """Values of the parameters, buffers, gradients, optimizer state and parameter groups.

    A step is guarded in two parts, so that no copy of the parameters is held while the forward's
    activations are: before the forward, :meth:`before_forward` (the buffers a forward updates,
    and the gradients a backward that may fail half way accumulates into); before the update,
    :meth:`before_update` (parameters, gradients, optimizer state). A gradient that is None costs
    nothing to restore (it is set back to None).

    :param extra: more tensors a step mutates in place (e.g. the clipper's ``found_inf``).
    """

    def __init__(self, model: torch.nn.Module, optimizer, extra=(), parameters: bool = True,
                 buffers: bool = True, gradients: bool = True, optimizer_state: bool = True):
        self.optimizer = optimizer
        self._has_optimizer_state = optimizer_state
        with torch.no_grad():
            params = [p for group in optimizer.param_groups for p in group["params"]]
            mutated = (list(model.parameters()) if parameters else []) + (list(model.buffers()) if buffers else [])
            self._tensors: List[Tuple[torch.Tensor, torch.Tensor]] = [(t, t.detach().clone()) for t in mutated]
            self._tensors += [(t, t.detach().clone()) for t in extra if t is not None]
            if parameters:
                seen = {id(p) for p, _ in self._tensors}
                self._tensors += [(p, p.detach().clone()) for p in params if id(p) not in seen]
            self._grads: List[Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = [
                (p, p.grad, _clone(p.grad)) for p in params
            ] if gradients else []
            # the per-parameter dicts themselves are kept too: a captured graph's replay check
            # compares them by identity, so an undone step must leave the same objects in place
            self._state: Dict[torch.Tensor, Tuple[dict, Dict[str, Tuple[object, object]]]] = {
                p: (s, {k: (v, _clone(v)) for k, v in s.items()}) for p, s in optimizer.state.items()
            } if optimizer_state else {}
            self._state_obj = optimizer.state
            self._groups_obj = optimizer.param_groups
            self._groups = [
                (group, {k: (v, _clone(v)) for k, v in group.items() if k != "params"})
                for group in optimizer.param_groups
            ] if optimizer_state else []

    @classmethod
    def before_forward(cls, model: torch.nn.Module, optimizer, gradients: bool, extra=()) -> "StepSnapshot":
        """What a forward and backward can change: the buffers (BatchNorm statistics) and, where
        ``gradients``, the gradients; nothing else is copied."""
        return cls(model, optimizer, extra, parameters=False, gradients=gradients, optimizer_state=False)

    @classmethod
    def before_update(cls, model: torch.nn.Module, optimizer, extra=()) -> "StepSnapshot":
        """What an update can change: parameters, gradients (clipping scales them), optimizer
        state and groups; taken after the backward, when the activations are freed."""
        return cls(model, optimizer, extra, buffers=False)

    def cloned_bytes(self) -> int:
        """The memory the copies hold."""
        copies = [c for _, c in self._tensors] + [c for _, _, c in self._grads if c is not None]
        copies += [c for _, values in self._state.values() for _, c in values.values() if isinstance(c, torch.Tensor)]
        return sum(c.numel() * c.element_size() for c in copies)

    def restore(self) -> None:
        """Write every saved value back into the tensor objects it came from."""
        opt = self.optimizer
        with torch.no_grad():
            for tensor, copy in self._tensors:
                tensor.copy_(copy)
            for p, grad, copy in self._grads:
                if grad is None:
                    p.grad = None
                else:
                    grad.copy_(copy)
                    p.grad = grad
            if not self._has_optimizer_state:
                return
            opt.state = self._state_obj
            opt.param_groups = self._groups_obj
            # state created lazily by the failed step (first optimizer step) is dropped
            for p in [p for p in opt.state if p not in self._state]:
                del opt.state[p]
            for p, (entry, values) in self._state.items():
                restored = {}
                for k, (original, copy) in values.items():
                    if isinstance(original, torch.Tensor):
                        original.copy_(copy)
                    restored[k] = original
                entry.clear()
                entry.update(restored)
                opt.state[p] = entry
            for group, entries in self._groups:
                for k, (original, copy) in entries.items():
                    if isinstance(original, torch.Tensor):
                        original.copy_(copy)
                    group[k] = original
                for k in [k for k in group if k != "params" and k not in entries]:
                    del group[k]

    def release(self) -> None:
        self._tensors = []
        self._grads = []
        self._state = {}
        self._groups = []


class ReferenceSnapshot:
    """Which tensor objects hold the gradients and the optimizer state, without copying values.

    A CUDA graph capture records kernels without running them, so a failed capture changes no
    values; it can only rebind Python references (a gradient created during capture, optimizer
    state initialised lazily). This puts the references back.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
        self._state_obj = optimizer.state
        self._state = {p: dict(s) for p, s in optimizer.state.items()}
        self._groups_obj = optimizer.param_groups
        self._groups = [(g, dict(g)) for g in optimizer.param_groups]

    def restore(self) -> None:
        opt = self.optimizer
        for p, grad in self._grads:
            p.grad = grad
        opt.state = self._state_obj
        for p in [p for p in opt.state if p not in self._state]:
            del opt.state[p]
        for p, entries in self._state.items():
            opt.state[p] = dict(entries)
        opt.param_groups = self._groups_obj
        for group, entries in self._groups:
            group.clear()
            group.update(entries)

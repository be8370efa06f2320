"""An optimizer step that undoes itself on the device when a flag is raised.

``nonfinite="skip"`` must not apply an update whose gradients are not all finite. Fused torch
optimizers read the flag in their kernel; the others (foreach or single-tensor SGD, Adam, AdamW)
cannot, and reading the flag on the host is a synchronisation per update, which a CUDA graph
cannot even contain. :class:`MaskedStep` wraps their ``step`` with an optimizer step pre-hook
that saves the parameters and their state, and a post-hook that puts the saved bytes back where
the flag is raised::

    snapshot = save_snapshot(tensors)               before the step
    restore_where_(tensors, snapshot, found_inf)    after it: tensors <- snapshot if found_inf > 0

(``fasttrain.kernels.masked_restore``: one launch each on CUDA, whatever the number of tensors,
and the restore moves nothing unless the flag is raised). A skipped update leaves parameters and
state exactly as they were (the step counter included) and an applied one exactly as the step
computed it. The cost is one copy of the parameters and their state per update, device work
without a host read; it traces under ``torch.compile`` and records in a CUDA graph.

The copy needs every parameter's state to exist: state created lazily by the step cannot be
undone to "absent" (SGD's first momentum buffer is the gradient itself, not a function of a
zero buffer). :meth:`ready` says whether it exists; until then the caller checks on the host.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from fasttrain import kernels

#: optimizers whose whole state is per-parameter tensors the masked copy covers
MASKABLE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def maskable(optimizer) -> bool:
    """True for SGD/Adam/AdamW that are not fused (fused ones skip in their kernel) and not
    differentiable (whose step keeps autograd history a copy would cut)."""
    if not isinstance(optimizer, MASKABLE_OPTIMIZERS):
        return False
    return not any(group.get("fused") or group.get("differentiable") for group in optimizer.param_groups)


def keeps_state(optimizer, group: dict) -> bool:
    """Whether the step of ``group`` creates per-parameter state: Adam/AdamW always, SGD only
    with momentum (its buffer); plain SGD has nothing to create, so nothing to wait for."""
    if isinstance(optimizer, torch.optim.SGD):
        return group.get("momentum", 0) != 0
    return True


class MaskedStep:
    """Hooks on ``optimizer`` that mask each step by ``found_inf`` (fp32, one element).

    Active between construction and :meth:`remove`; a step taken while :attr:`armed` is False
    (the host decided instead) is left alone.
    """

    def __init__(self, optimizer, found_inf: torch.Tensor):
        self.optimizer = optimizer
        self.found_inf = found_inf
        self.armed = False
        self._tensors: List[torch.Tensor] = []
        self._snapshot: Optional[torch.Tensor] = None
        self._handles = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        ]

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def ready(self) -> bool:
        """Every parameter with a gradient has the optimizer state its step keeps, if it keeps
        any (host-only dict look-ups): SGD without momentum keeps none, so it is ready at once.
        Checked before every update, so an optimizer that stops qualifying is checked on the host."""
        if not counters_on_device(self.optimizer, self.found_inf.device):
            # an engine fell back to eager and put Adam's step counters back on the host
            # (capturable=False): undoing them would read the flag once per parameter
            return False
        state = self.optimizer.state
        return all(
            state.get(p)
            for group in self.optimizer.param_groups
            if keeps_state(self.optimizer, group)
            for p in group["params"]
            if p.grad is not None
        )

    def _tensors_of_step(self) -> List[torch.Tensor]:
        """The parameters with a gradient, each followed by its state tensors: what a step writes."""
        state = self.optimizer.state
        tensors = []
        for p in self._params():
            tensors.append(p)
            tensors.extend(v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor))
        return tensors

    def prepare_tables(self) -> None:
        """Build the kernels' table for the tensors the next step writes (no host read): a CUDA
        graph that captures the step cannot build it (see ``UpdateClip.before_capture``)."""
        if self.ready():
            kernels.prepare_snapshot_table(self._tensors_of_step())

    def _before(self, optimizer, args, kwargs) -> None:
        if not self.armed:
            return
        tensors = self._tensors_of_step()
        # the op itself, as in _after: these are the step's own tensors, on the flag's device
        with torch.no_grad():
            self._snapshot = torch.ops.fasttrain.save_snapshot(tensors) if tensors else None
        self._tensors = tensors

    # Kept out of dynamo: traced, the frame that runs this hook would guard on the snapshot, which
    # exists only between the two hooks, so a check of its guards between steps (the graphed
    # engine's before each replay, fasttrain/engine/step_guards.py) would fail every time. Run
    # as it is, the restore is one launch (recorded in a CUDA graph like the rest of the step).
    @torch.compiler.disable
    def _after(self, optimizer, args, kwargs) -> None:
        if not self.armed or not self._tensors:
            return
        # every tensor is on the flag's device: masked_step_for() refuses host step counters.
        # The ops themselves, not save_snapshot()/restore_where_(): the tensors and snapshot are
        # the step's own, so the public functions' checks would only add host time to every update
        with torch.no_grad():
            torch.ops.fasttrain.restore_where(self._tensors, self._snapshot, self.found_inf)
        self._tensors, self._snapshot = [], None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.armed = False


def host_read_is_free(device: torch.device) -> bool:
    """On the CPU reading a flag is a memory load, cheaper than copying parameters and state."""
    return device.type == "cpu"


def masked_step_for(optimizer, found_inf: Optional[torch.Tensor]) -> Optional[MaskedStep]:
    """A :class:`MaskedStep` for ``optimizer`` where it saves a host read, else None: a maskable
    optimizer off the CPU whose step counters live on the device (SGD has none; Adam/AdamW with
    ``capturable=True``, which the compiled and graphed engines set on CUDA)."""
    if found_inf is None or not maskable(optimizer) or host_read_is_free(found_inf.device):
        return None
    if not counters_on_device(optimizer, found_inf.device):
        return None  # a host step counter needs the flag on the host anyway: check it there
    return MaskedStep(optimizer, found_inf)


def counters_on_device(optimizer, device: torch.device) -> bool:
    """Whether the optimizer's step counters live on the flag's ``device`` (SGD has none;
    Adam/AdamW keep them there with ``capturable=True``), so the masked copy reads nothing."""
    if device.type == "cpu" or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return True
    return all(group.get("capturable") for group in optimizer.param_groups)

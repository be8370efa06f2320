"""The gradient tensors a CUDA graph writes into, kept across hooks that set gradients to None.

A captured step accumulates into the gradient tensors that existed when it was captured. Hooks
may set ``.grad`` to None between steps: ``optimizer.zero_grad()`` does by default, so do
LightningModule's default ``optimizer_zero_grad`` and callbacks that clear gradients. Eagerly, the
next backward then creates fresh gradients. The graphed engine replays with the same result:

* before a capture, a parameter whose gradient a hook removed gets its last gradient tensor back,
  zeroed (``0 + g`` is ``g``), so that the graph writes into tensors that outlive the hooks;
* between replays the replay guard puts the captured tensors back the same way
  (:meth:`~fasttrain.engine.replay_guard.CaptureRecord.restore_grads`);
* an overridden ``optimizer_zero_grad`` hook that sets gradients to None is not captured (setting
  an attribute records nothing in a graph): the update graph zeroes in place the gradients the
  hook drops, and the hook itself runs eagerly after each update's replay, so that whatever reads
  ``.grad`` between updates sees what eager training shows it. Before the next replay those
  tensors are bound again without another kernel: the graph zeroed them, and while their
  attribute is None nothing else can reach them.

All of it is host bookkeeping (identity checks, attribute assignments) plus one ``foreach`` zero
where a capture needs one; nothing reads a device value.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Sequence, Tuple

import torch


class GradientKeeper:
    """The last gradient tensor of each parameter, and which gradients the zero-grad hook drops."""

    def __init__(self):
        self._last: Dict[torch.Tensor, torch.Tensor] = {}
        #: the parameters whose gradients the (overridden) zero-grad hook sets to None
        self.cleared: Tuple[torch.Tensor, ...] = ()
        #: parameters whose kept gradient the last update graph zeroed and the hook then dropped:
        #: the next replay binds them again as they are (valid for that one replay)
        self.known_zero: FrozenSet[int] = frozenset()

    @property
    def kept(self) -> Dict[torch.Tensor, torch.Tensor]:
        """Parameter -> its last gradient tensor (the dict itself: see long_lived.py)."""
        return self._last

    def remember(self, params: Iterable[torch.Tensor]) -> None:
        """Keep the gradient tensors the parameters hold now (those that have one)."""
        last = self._last
        for p in params:
            grad = p.grad
            if grad is not None:
                last[p] = grad

    def restore(self, params: Iterable[torch.Tensor]) -> None:
        """Give each trainable parameter without a gradient its last one back, zeroed: before a
        capture, so that the graph accumulates into tensors the hooks cannot take away. A frozen
        parameter keeps None, so that the optimizer skips it as it does eagerly."""
        last = self._last
        missing = [p for p in params if p.grad is None and p.requires_grad and p in last]
        if not missing:
            return
        with torch.no_grad():
            grads = [last[p] for p in missing]
            torch._foreach_zero_(grads)
        for p, grad in zip(missing, grads):
            p.grad = grad

    def note_hook(self, before: Sequence[Tuple[torch.Tensor, object]]) -> None:
        """After the zero-grad hook ran eagerly: ``before`` is ``(param, grad)`` as it was; the
        parameters that had a gradient and have none now are the ones the hook drops."""
        self.cleared = tuple(p for p, grad in before if grad is not None and p.grad is None)

    def zero_cleared(self) -> None:
        """Inside the update's capture, in the hook's place: zero the gradients it drops."""
        grads: List[torch.Tensor] = [p.grad for p in self.cleared if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_zero_(grads)

    def after_hook_following_a_replay(self) -> None:
        """The hook just dropped gradients the update graph had zeroed: the next replay may bind
        those tensors again without zeroing them."""
        self.known_zero = frozenset(id(p) for p in self.cleared if p.grad is None)

    def take_known_zero(self) -> FrozenSet[int]:
        known, self.known_zero = self.known_zero, frozenset()
        return known

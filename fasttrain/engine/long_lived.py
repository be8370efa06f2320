"""Moving the tensors that outlive the captures out of the warm-up's activation memory.

The graphed engine's warm-up runs steps the usual way, and the tensors created there that live on
(each parameter's gradient, which the graphs write into, and the optimizer's state, created at the
first update once backward has freed the activations) are carved by the caching allocator from
whatever blocks are free at that moment, typically blocks the warm-up's activations just gave
back. One such tensor keeps a whole segment of the default pool reserved: ``empty_cache`` hands
back only segments with nothing alive in them. The graphs then take their own pool beside the
warm-up's segments, and the run reserves two sets of activations.

The optimizer's state is therefore made in the engine's long-lived pool at the update that creates
it (it cannot be moved afterwards: the compiled update is specialised to the state tensors it was
traced with). The gradients are made by the warm-up's backward, so before a new pool is taken
:meth:`LongLivedTensors.move` copies every gradient larger than the allocator's small-block limit
(smaller ones come from small segments that activations never use) into fresh memory, allocated
where the engine says (its own pool on CUDA), and binds the copy where the original was: ``p.grad``
and the gradient the engine keeps for hooks that drop it. The copies hold the same values, so
training goes on as before; the originals' blocks become free, and their segments go back at the
pool's ``empty_cache``. Nothing captured refers to the originals: a new pool is taken only when no
graph is held.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable

import torch

#: the caching allocator serves requests up to this size from small segments of their own
SMALL_BLOCK_LIMIT = 1 << 20


def _movable(tensor) -> bool:
    # a whole storage of its own: a view or a tensor sharing its storage with another would lose
    # that sharing if copied alone
    return (
        isinstance(tensor, torch.Tensor)
        and tensor._base is None
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() > SMALL_BLOCK_LIMIT
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class LongLivedTensors:
    """Remembers which tensors were moved already, so that each is copied once per run."""

    def __init__(self):
        # by id, with a weak reference to tell a live copy from a new tensor at a reused id (a
        # WeakSet would compare tensors with ==, elementwise)
        self._moved: Dict[int, weakref.ref] = {}

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            copy = tensor.detach().clone()
        self._moved[id(copy)] = weakref.ref(copy)
        return copy

    def _needs_moving(self, tensor) -> bool:
        if tensor is None:
            return False
        ref = self._moved.get(id(tensor))
        return (ref is None or ref() is not tensor) and _movable(tensor)

    def move(self, params: Iterable[torch.Tensor], kept_grads: dict) -> int:
        """Copy the large gradients not moved before (``p.grad`` and the engine's kept ones in
        ``kept_grads``, parameter -> tensor); returns how many were copied. Call it inside the
        allocation context the copies belong to."""
        moved = 0
        for p in params:
            grad = p.grad
            if self._needs_moving(grad):
                copy = self._copy(grad)
                if kept_grads.get(p) is grad:
                    kept_grads[p] = copy
                p.grad = copy
                moved += 1
            kept = kept_grads.get(p)
            if self._needs_moving(kept) and kept is not p.grad:
                kept_grads[p] = self._copy(kept)
                moved += 1
        return moved

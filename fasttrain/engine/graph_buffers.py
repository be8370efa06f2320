"""Device memory that outlives a CUDA graph replay: static inputs and per-step result rings.

A captured graph reads its inputs from fixed addresses and writes its results to fixed
addresses. :class:`StaticBatch` holds the input buffers that each batch is copied into.
:class:`StepRing` holds the per-micro-step values the trainer keeps until a flush (loss, grad
norm, token count): written inside the graph at a slot the device computes from a call counter,
which the host mirrors, so that ``batch_output["loss"]`` can be the view ``ring[slot]`` and the
trainer's :class:`~fasttrain.step_metrics.StepMetricsBuffer` keeps it by reference, with no copy
and no sync, until the flush reads every slot in one transfer.

Both are allocated outside the graphs' private memory pool, so no replay of another graph
sharing that pool can overwrite them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from fasttrain.kernels import LossCounters, accumulate_loss_

#: float32 counts integers exactly up to 2**24; the counter restarts well before that
_COUNTER_RESET = 1 << 23


def _flat_tensors(batch) -> bool:
    # the common batch, a tuple or list of tensors, skips pytree (a few microseconds per step)
    return type(batch) in (tuple, list) and all(type(leaf) is torch.Tensor for leaf in batch)


def batch_signature(batch) -> Tuple:
    """What a captured graph depends on: the batch's structure and each tensor's shape, stride,
    dtype and device; other leaves by value."""
    if _flat_tensors(batch):
        return (type(batch), tuple((t.shape, t.stride(), t.dtype, t.device) for t in batch))
    leaves, spec = pytree.tree_flatten(batch)
    return (spec, tuple(
        (leaf.shape, leaf.stride(), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else ("value", leaf)
        for leaf in leaves
    ))


def _may_overlap(t: torch.Tensor) -> bool:
    # Walking the dimensions from the smallest stride up, each stride must step past every
    # element the smaller dimensions reach; otherwise two indices may share an element.
    reach = 0
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def static_buffer(leaf: torch.Tensor) -> torch.Tensor:
    """A copy of ``leaf`` with its strides: the compiled step the graph captures was traced with
    the batch's layout, and a buffer of another layout (``clone()`` makes a strided view
    contiguous) would trace it again inside the capture. A layout whose elements overlap (an
    ``expand()``ed view) cannot be written into; its buffer is contiguous, and its signature then
    differs from the batch's, which the engine refuses to capture."""
    leaf = leaf.detach()
    if _may_overlap(leaf):
        return leaf.clone(memory_format=torch.contiguous_format)
    buffer = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
    buffer.copy_(leaf)
    return buffer


class StaticBatch:
    """Input buffers laid out like ``batch``; :meth:`load` copies a batch of the same signature in.

    :attr:`signature` is the buffers' own: equal to the batch's unless a tensor's elements
    overlap (see :func:`static_buffer`)."""

    def __init__(self, batch):
        leaves, self._spec = pytree.tree_flatten(batch)
        self._flat = _flat_tensors(batch)
        buffers = [static_buffer(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self._buffers = [buffers[i] for i in self._tensor_index]
        #: the batch the graphs were captured with
        self.tree = pytree.tree_unflatten(buffers, self._spec)
        self.signature = batch_signature(self.tree)

    def load(self, batch) -> None:
        if self._flat:
            for buffer, leaf in zip(self._buffers, batch):
                # same device, queued on the current stream: no host sync
                buffer.copy_(leaf, non_blocking=True)
            return
        leaves = pytree.tree_leaves(batch)
        for buffer, i in zip(self._buffers, self._tensor_index):
            # same device, queued on the current stream: no host sync
            buffer.copy_(leaves[i], non_blocking=True)


class StepRing:
    """Ring buffers of per-micro-step values, written inside graphs.

    ``size`` must be at least the number of micro-steps between two flushes, so that no slot is
    overwritten before the flush has read it.

    Columns of :attr:`aux`: 0 the grad norm of an update, 1 ``num_items_in_batch``, 2 a batch
    size given as a tensor.
    """

    AUX_KEYS = ("grad_norm", "num_items_in_batch", "batch_size")

    def __init__(self, size: int, device: torch.device):
        self.size = int(size)
        self.losses = LossCounters(device, ring_size=self.size)
        self.aux = torch.zeros(self.size, len(self.AUX_KEYS), dtype=torch.float32, device=device)
        # the batch weight of the device counters: the trainer weights losses by batch size on
        # the host at each flush, so the counters keep plain sums
        self._weight = torch.ones(1, dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        # views made once, so a step only indexes a list
        self.loss_views: List[torch.Tensor] = [self.losses.ring[i] for i in range(self.size)]
        self.aux_views: List[List[torch.Tensor]] = [[self.aux[i, j] for j in range(len(self.AUX_KEYS))] for i in range(self.size)]
        self.calls = 0

    def warm_up(self) -> None:
        """Run the accumulation kernel once outside any capture (Triton compiles it on its first
        launch, which a capture cannot record), then clear the counters."""
        accumulate_loss_(self.losses.counters, self._zero.reshape(1), self._weight, self.losses.ring)
        self.losses.reset()
        self.calls = 0

    def record(self, batch_output, norm: Optional[torch.Tensor]) -> None:
        """Inside the graph: write this micro-step's values at the device-side slot. A step
        whose output is no dict with a ``loss`` (an evaluation step of a LightningModule, which
        logs its values itself) has nothing to record."""
        if not has_loss(batch_output):
            return
        counters = self.losses.counters
        values = [norm, batch_output.get("num_items_in_batch"), batch_output.get("batch_size")]
        if any(isinstance(v, torch.Tensor) for v in values):
            slot = counters[3].long().remainder(self.size).reshape(1)
            row = torch.stack([
                v.detach().reshape(()).float() if isinstance(v, torch.Tensor) else self._zero for v in values
            ]).reshape(1, -1)
            self.aux.index_copy_(0, slot, row)
        loss = batch_output["loss"]
        accumulate_loss_(counters, loss.detach().float().mean().reshape(1), self._weight, self.losses.ring)

    def next_slot(self) -> int:
        """On the host, after a replay: the slot that replay wrote."""
        calls = self.calls
        if calls >= _COUNTER_RESET and calls % self.size == 0:
            # restart the device counter at a ring boundary, long before float32 stops counting
            # exactly; queued on the stream, no sync. The replay that just ran wrote slot 0 and
            # advanced the device counter past it, so the restarted counter points at slot 1.
            self.losses.counters[3].fill_(1.0)
            calls = 0
        self.calls = calls + 1
        return calls % self.size


def has_loss(batch_output) -> bool:
    """Whether a step's output is a dict with a ``loss``, the form the trainer's hooks return."""
    return isinstance(batch_output, dict) and "loss" in batch_output


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


class CapturedStep:
    """One captured graph, the outputs it writes, and how to present them per replay.

    A step whose output is no dict with a ``loss`` (a LightningModule's evaluation step returns
    what it likes, often None) hands back a copy of its output after each replay: the graph
    overwrites its outputs at the next replay, and what the step returned may be kept by whoever
    receives it, as an eager step's fresh tensors can be."""

    def __init__(self, graph, batch_output, norm: Optional[torch.Tensor], ring: StepRing, tables=(),
                 keep_model_outputs: bool = True):
        self.graph = graph
        self.ring = ring
        #: device tables the graph's kernels read by address (the clip kernels' chunk tables):
        #: held here so that no cache can free them while the graph may replay
        self.tables = list(tables)
        #: what a training graph was captured with (a :class:`~fasttrain.engine.replay_guard.
        #: CaptureRecord`), checked before each replay; set by the engine
        self.record = None
        #: the :class:`StaticBatch` the graph reads its batch from; set by the engine
        self.static = None
        #: the step's host side effects to redo after each replay (StepContext.host_effects)
        self.effects = None
        #: the guards of the compiled code the capture ran, checked before each replay
        #: (:class:`~fasttrain.engine.step_guards.ReplayGuards`); set by the engine
        self.guards = None
        #: a step output of another form than the trainer's dict, handed back as a copy
        self.plain_output = None if has_loss(batch_output) else pytree.tree_map(_detached, batch_output)
        if self.plain_output is not None or batch_output is None:
            self.batch_output, self.has_norm, self._ring_keys = None, False, []
            return
        # outputs are read by callbacks before the next replay; detach so they do not pin the
        # autograd graph recorded at capture time. The model outputs (logits: often the largest
        # tensor of the step, upcast to fp32 under bf16) are kept only where a callback asks for
        # them: unreferenced, their graph memory goes back to the pool the other graphs share.
        self.batch_output = {
            k: v.detach() if isinstance(v, torch.Tensor) else v
            for k, v in batch_output.items()
            if keep_model_outputs or k != "model_outputs"
        }
        self.has_norm = norm is not None
        self._ring_keys = [
            (key, StepRing.AUX_KEYS.index(key))
            for key in ("num_items_in_batch", "batch_size")
            if isinstance(batch_output.get(key), torch.Tensor)
        ]

    def replay(self) -> Tuple[dict, Optional[torch.Tensor]]:
        self.graph.replay()
        if self.batch_output is None:
            return pytree.tree_map(_copy, self.plain_output), None
        ring = self.ring
        slot = ring.next_slot()
        output = dict(self.batch_output)
        output["loss"] = ring.loss_views[slot]
        aux = ring.aux_views[slot]
        for key, column in self._ring_keys:
            output[key] = aux[column]
        return output, (aux[0] if self.has_norm else None)

"""Per-step values kept on the device between flushes, and the flush that brings them to the host.

Within an epoch each micro-step appends a reference to its (detached) loss tensor; nothing is
computed or copied per step. A flush stacks what was collected and copies it to the host in one
transfer, then hands the host values to the callbacks as a :class:`FlushedMetrics`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from typing import List, Optional

import torch

from fasttrain.metrics import FlushedMetrics


class StepMetricsBuffer:
    """Collects the step values of one epoch of one phase (``"train"`` or ``"eval"``)."""

    def __init__(self, phase: str, epoch: int):
        self.phase = phase
        self.epoch = epoch
        self._losses: List[torch.Tensor] = []
        self._batch_sizes: list = []
        self._num_items: list = []
        self._steps: List[int] = []
        self._grad_norms: List[torch.Tensor] = []
        self.loss_sum = 0.0
        self.sample_count = 0
        self.nonfinite_seen = False
        self._last_flush = time.perf_counter()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, batch_output: dict) -> None:
        """Record one micro-step. Keeps references only: no device work, no host sync."""
        try:
            loss = batch_output["loss"]
        except (KeyError, TypeError):
            raise ValueError(
                "calculate_train_batch_loss/calculate_eval_batch_loss must return a dict with a "
                "'loss' entry (and 'batch_size'); got "
                f"{type(batch_output).__name__}"
                + (f" with keys {sorted(batch_output)}" if isinstance(batch_output, dict) else "")
            ) from None
        # the exact type first (isinstance goes through torch.Tensor's metaclass); ndim is an
        # attribute, cheaper than dim(): this runs every micro-step
        if type(loss) is not torch.Tensor and not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        elif loss.ndim:
            loss = loss.detach().mean()
        # a loss that records no autograd history (a graph replay's, read from its ring) is kept
        # as it is: a detached view of it would be the same values at the cost of a view per step
        self._losses.append(loss.detach() if loss.requires_grad else loss)
        self._batch_sizes.append(batch_output.get("batch_size", 1))
        num_items = batch_output.get("num_items_in_batch")
        if num_items is not None:
            self._num_items.append(num_items)
        self._steps.append(step)

    def add_grad_norm(self, norm: Optional[torch.Tensor]) -> None:
        if norm is not None:
            self._grad_norms.append(norm.detach())

    def flush(
        self,
        *,
        num_updates: int,
        skipped_updates: int,
        is_epoch_end: bool,
        pending_skips: Optional[torch.Tensor] = None,
    ) -> FlushedMetrics:
        """Copy the collected values to the host in one transfer and reset the buffer.

        ``pending_skips`` is a device counter of updates skipped since the previous flush
        (``nonfinite="skip"``); it travels in the same transfer and is added to
        ``skipped_updates``."""
        n = len(self._losses)
        device_parts = []
        if n:
            device_parts.append(torch.stack(self._losses).float())
        if self._grad_norms:
            device_parts.append(torch.stack(self._grad_norms).float())
        # batch sizes are ints but for a hook that returns a tensor: tell the two apart with one
        # pass over the types, not an isinstance per step
        int_sizes = set(map(type, self._batch_sizes)) <= {int}
        tensor_sizes = [] if int_sizes else [b for b in self._batch_sizes if isinstance(b, torch.Tensor)]
        tensor_items = [x for x in self._num_items if isinstance(x, torch.Tensor)]
        if tensor_sizes:
            device_parts.append(torch.stack([b.reshape(()) for b in tensor_sizes]).float())
        if tensor_items:
            device_parts.append(torch.stack([x.reshape(()) for x in tensor_items]).float())
        if pending_skips is not None:
            device_parts.append(pending_skips.reshape(-1)[:1].float())
        host: List[float] = []
        if device_parts:
            if len(device_parts) == 1:
                packed = device_parts[0]
            else:
                device = device_parts[0].device
                packed = torch.cat([p.to(device) for p in device_parts])
            # SYNC(flush): the one batched device->host copy of the step metrics, every
            # log_every_n_steps updates and at epoch end.
            host = packed.tolist()
        losses = host[:n]
        offset = n
        grad_norms = host[offset : offset + len(self._grad_norms)]
        offset += len(self._grad_norms)
        size_values = iter(host[offset : offset + len(tensor_sizes)])
        offset += len(tensor_sizes)
        item_values = iter(host[offset : offset + len(tensor_items)])
        offset += len(tensor_items)
        if pending_skips is not None:
            skipped_updates = skipped_updates + int(host[offset])
        if int_sizes:
            batch_sizes = list(self._batch_sizes)
        else:
            batch_sizes = [
                int(next(size_values)) if isinstance(b, torch.Tensor) else int(b) for b in self._batch_sizes
            ]
        num_items = None
        if self._num_items:
            num_items = int(
                sum(next(item_values) if isinstance(x, torch.Tensor) else x for x in self._num_items)
            )
        # The host values are float32's (the packed copy is float32), whose sum cannot overflow a
        # double: the sum is finite exactly when every loss is (inf - inf and nan give nan).
        nonfinite = not math.isfinite(sum(losses))
        self.nonfinite_seen |= nonfinite
        self.loss_sum += sum(map(operator.mul, losses, batch_sizes))
        self.sample_count += sum(batch_sizes)
        now = time.perf_counter()
        metrics = FlushedMetrics(
            phase=self.phase,
            epoch=self.epoch,
            step_indices=list(self._steps),
            losses=losses,
            batch_sizes=batch_sizes,
            num_updates=num_updates,
            grad_norms=grad_norms,
            skipped_updates=skipped_updates,
            nonfinite=nonfinite,
            epoch_loss_sum=self.loss_sum,
            epoch_sample_count=self.sample_count,
            is_epoch_end=is_epoch_end,
            elapsed_s=now - self._last_flush,
            num_items=num_items,
        )
        self._last_flush = now
        self._losses.clear()
        self._batch_sizes.clear()
        self._num_items.clear()
        self._steps.clear()
        self._grad_norms.clear()
        return metrics


def flush(trainer, buffer: StepMetricsBuffer, is_epoch_end: bool) -> Optional[FlushedMetrics]:
    """Deliver ``buffer``'s step metrics to the callbacks (``on_metrics_flush``) as host values,
    after the non-finite policy has seen them, and return them (None when there was nothing to
    flush); raises the stop the policy asks for."""
    if len(buffer) == 0 and not is_epoch_end:
        return None
    train = buffer.phase == "train"
    guard = trainer._nonfinite
    progress = trainer.progress
    metrics = buffer.flush(
        num_updates=progress.num_updates,
        skipped_updates=progress.skipped_updates,
        is_epoch_end=is_epoch_end,
        pending_skips=guard.take_pending() if train else None,
    )
    if train:
        progress.skipped_updates = metrics.skipped_updates
    # host values only (with several processes, one shared decision about non-finite values
    # and stop signals); records the reason before the event, where TerminateOnNaNCallback
    # may raise first
    stop = guard.check_flush(trainer, metrics)
    if guard.shared_totals is not None:
        loss_sum, count = guard.shared_totals
        metrics = dataclasses.replace(metrics, global_epoch_loss_sum=loss_sum, global_epoch_sample_count=count)
    trainer.callback_handler.call_event("on_metrics_flush", trainer, metrics=metrics)
    if stop is not None:
        raise stop
    return metrics


def add_epoch_loss_to_run_history(trainer, metric_name: str, metrics: FlushedMetrics) -> None:
    """Record the epoch's mean loss from its epoch-end flush: host values only. With several
    processes that flush already carries the totals of all of them (shared together with the
    stop decisions), so nothing more is read or reduced here."""
    loss_sum, count = metrics.global_epoch_loss_sum, metrics.global_epoch_sample_count
    if loss_sum is None:  # no process-wide totals at this flush: this process's own
        loss_sum, count = metrics.epoch_loss_sum, metrics.epoch_sample_count
    trainer.run_history.update_metric(metric_name, loss_sum / count if count else float("nan"))

"""What a training run does when a loss or a gradient is not finite: ``Trainer(nonfinite=...)``.

* ``"stop"`` (default): at the first flush that sees a non-finite training or evaluation loss, or a
  non-finite gradient norm (reported when clipping by norm), training stops:
  ``trainer.stop_reason`` is ``"nonfinite_loss"`` or ``"nonfinite_gradients"``. Nothing is checked
  per step, so the stop comes at most ``log_every_n_steps`` updates after the bad step; the updates
  in between were applied, so no training state is written after that point (the last good one is
  kept).
* ``"skip"``: an update whose gradients are not all finite is not applied and training goes on;
  ``trainer.skipped_updates`` counts them. The gradients are checked on the device once per
  update by the fused clipping kernels (which also clip when clipping is configured). Fused
  ``torch.optim`` optimizers (``Adam/AdamW/SGD/Adagrad(fused=True)``) read the flag in their
  kernel, as with ``torch.amp.GradScaler``: a skip without synchronisation. SGD, Adam and AdamW
  on a GPU (Adam/AdamW with ``capturable=True``, which the compiled and graphed engines set)
  copy their parameters and state before the step and put the copy back where the flag is
  raised (:mod:`fasttrain.engine.masked_step`): no synchronisation either, and the graphed engine
  captures it; the very first update of a run, which creates the optimizer state, is checked on
  the host (SGD without momentum creates none and is masked from its first update). Other optimizers (and everything on the CPU, where reading the flag costs nothing)
  read the flag on the host: one synchronisation per update on a GPU.
* ``"ignore"``: no checks; non-finite values flow into the weights.

With fp16 loss scaling the scaler already skips non-finite updates, in its own way; "skip" then
leaves it to the scaler and does not count them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fasttrain.callbacks import StopTrainingError
from fasttrain.engine.clipping import gradients_of
from fasttrain.engine.hyperparams import steps_in_fused_kernels
from fasttrain.engine.masked_step import masked_step_for
from fasttrain.signals import share_stop_decisions

POLICIES = ("stop", "skip", "ignore")
_REASONS = (None, "nonfinite_loss", "nonfinite_gradients")  # ordered: codes shared between processes


@torch.compiler.disable
def _flag_clear(found_inf: torch.Tensor) -> bool:
    # Left out of a compiled update on purpose: the read splits its graph there (where dynamo
    # would otherwise log the split as a graph break to fix), and the update after it runs
    # compiled as usual.
    # SYNC(update): a non-fused optimizer cannot skip an update on the device, so the host reads the
    # flag once per update; fused optimizers skip inside their kernel instead
    return found_inf.item() == 0.0


class NonFiniteGuard:
    """Applies a non-finite policy for one ``train()`` call.

    ``clip`` replaces the plain gradient clipping of an update; ``allow_update`` says whether the
    optimizer step may run (``True`` without looking at the device, except for "skip" with a
    non-fused optimizer); ``pending_skips`` is a device counter the trainer reads at flushes,
    after which ``check_flush`` applies the policy to the flushed host values.
    """

    def __init__(self, policy: str = "ignore", optimizer=None, has_loss_scaler: bool = False):
        self.policy = policy
        self.checks_gradients = policy == "skip" and not has_loss_scaler
        # the torch optimizer itself: accelerate's wrapper forwards step() to it
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self.device_skip = self.checks_gradients and steps_in_fused_kernels(self._optimizer)
        self.found_inf: Optional[torch.Tensor] = None
        self.pending_skips: Optional[torch.Tensor] = None
        #: the epoch's (loss sum, sample count) over all processes, as of the last flush
        #: (None when that flush shared nothing)
        self.shared_totals = None
        self._last_totals = None
        self._attached = False
        self._seen: Optional[str] = None  # a reason to stop not yet shared with other processes
        #: why training stopped, what state the model is in and what to do (set when it stops)
        self.stop_message: Optional[str] = None
        self._shared_at: Optional[int] = None  # the update count of the last shared decision
        if self.checks_gradients and self._optimizer is not None:
            # the flags exist before the first (compiled or captured) update reads them: a flag
            # created inside the compiled update would recompile it once per run
            params = [p for group in self._optimizer.param_groups for p in group["params"]]
            if params:
                self._buffers(params[0].device)
        #: SGD/Adam/AdamW on a device: the update is undone on the device where the flag is
        #: raised (fasttrain/engine/masked_step.py), so the graphed engine can capture it
        self._masked = (
            masked_step_for(self._optimizer, self.found_inf)
            if self.checks_gradients and not self.device_skip
            else None
        )
        #: whether the last update's check read the flag on the host (no masked skip for it):
        #: such an update cannot be captured in a CUDA graph
        self.last_update_read_host = False
        if self._masked is not None:
            self.allow_update = self._masked_or_host_check
        elif self.checks_gradients and not self.device_skip:
            self.allow_update = self._host_check
        else:
            self.allow_update = self._always
        #: ``allow_update`` is always True: the optimizer-step hook need not call it
        self.always_allows = self.allow_update is self._always

    # ------------------------------------------------------------------ per update
    @staticmethod
    def _always() -> bool:
        return True

    def _masked_or_host_check(self) -> bool:
        masked = self._masked
        # host-only: the state exists after the first applied update; until then the step
        # creates it, which a copy cannot undo
        masked.armed = masked.ready()
        if masked.armed:
            self.last_update_read_host = False
            return True
        return self._host_check()

    def _host_check(self) -> bool:
        if self.found_inf is None:  # no gradients this update
            self.last_update_read_host = False
            return True
        self.last_update_read_host = True
        return _flag_clear(self.found_inf)

    def clip(self, clipper) -> Optional[torch.Tensor]:
        """Clip (when ``clipper`` is enabled) and, for "skip", flag non-finite gradients in
        ``found_inf`` and count them; returns the norm when clipping by norm. Device work only.

        With sharded gradients (FSDP2) the flag is raised on every process when any process's
        shards are not finite (the clipper's one all-reduce carries it), so that all skip the
        same update."""
        enabled = clipper is not None and clipper.enabled
        if not self.checks_gradients:
            return clipper() if enabled else None
        if clipper is not None and clipper.always_communicates:
            # every process takes part in the collective, with gradients or without
            device = clipper.found_inf.device
        else:
            grads = gradients_of(clipper.parameters) if clipper is not None else []
            if not grads:
                if self.found_inf is not None:
                    self.found_inf.zero_()  # nothing to check: the last update's flag must not linger
                return None
            device = grads[0].device
        found_inf = self._buffers(device)
        found_inf.zero_()  # the kernels only ever raise the flag
        if clipper.found_inf is not found_inf:
            clipper.found_inf = found_inf
        norm = clipper(check_finite=True)
        self.pending_skips.add_(found_inf)
        return norm

    def prepare_tables(self) -> None:
        """Before a CUDA graph captures an update: the table of the masked skip's undo (host work
        and one queued copy, no host read), which the capture cannot build."""
        if self._masked is not None:
            self._masked.prepare_tables()

    def _buffers(self, device) -> torch.Tensor:
        if self.found_inf is None or self.found_inf.device != device:
            self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            self.pending_skips = torch.zeros(1, dtype=torch.float32, device=device)
            if getattr(self, "_masked", None) is not None:
                self._masked.found_inf = self.found_inf
            if self.device_skip:
                # read by the fused kernel of every step (torch.amp.GradScaler's contract); the
                # step counter of a skipped update is rolled back there too. 0-d, as the
                # optimizer's step tensors it is subtracted from.
                self._optimizer.found_inf = self.found_inf.view(())
                self._attached = True
        return self.found_inf

    # ------------------------------------------------------------------ per flush
    def take_pending(self) -> Optional[torch.Tensor]:
        """The device counter of skips since the last flush (packed into the flush's single
        transfer by the trainer), or None when nothing is counted."""
        return self.pending_skips

    def check_flush(self, trainer, metrics) -> Optional[StopTrainingError]:
        """After a flush (host values only): start counting skips again and, under "stop",
        record why the run must stop (``trainer.stop_reason``, a ``stopped_<reason>`` metric, no
        more saves in this run: the updates since the previous flush were applied) and return
        the error to raise once the callbacks have seen the metrics.

        With several processes the decision is shared (together with a pending stop signal), so
        that all stop after the same step: at training flushes, which every process makes at
        the same updates (once per update count), and at the end of an evaluation epoch (its
        intermediate flushes are not aligned across processes, so what they see waits)."""
        train = metrics.phase == "train"
        if train and self.pending_skips is not None:
            self.pending_skips.zero_()  # read by this flush; an asynchronous device op
        if self.policy == "stop":
            self._seen = self._seen or self._stop_reason(metrics)
        config = trainer.run_config
        local_totals = (metrics.epoch_loss_sum, metrics.epoch_sample_count)
        if config is not None and config.is_distributed:
            self.shared_totals = None
            if not (train or metrics.is_epoch_end):
                return None
            if train and trainer.progress.num_updates == self._shared_at:
                # an epoch-end flush right after a periodic one: nothing new, the totals stand
                self.shared_totals = self._last_totals
                return None
            self._shared_at = trainer.progress.num_updates if train else None
            code, self.shared_totals = share_stop_decisions(
                trainer._accelerator, trainer._interrupt, _REASONS.index(self._seen), local_totals
            )
            self._last_totals = self.shared_totals
            reason = _REASONS[code]
        else:
            self.shared_totals = local_totals
            reason = self._seen
        self._seen = None
        if reason is None:
            return None
        trainer.stop_reason = reason
        progress = trainer.progress
        progress.nonfinite_applied = progress.nonfinite_applied or train
        trainer.run_history.update_metric(f"stopped_{reason}", progress.num_updates)
        self.stop_message = stop_message(trainer, metrics, reason)
        return StopTrainingError(self.stop_message)

    def _stop_reason(self, metrics) -> Optional[str]:
        if self.policy != "stop":
            return None
        if metrics.nonfinite:
            return "nonfinite_loss"
        if any(not math.isfinite(norm) for norm in metrics.grad_norms):
            return "nonfinite_gradients"
        return None

    def close(self) -> None:
        """Detach the flag from the optimizer, so that steps taken outside ``train()`` are not
        skipped by a stale value."""
        if self._masked is not None:
            self._masked.remove()
        if self._attached:
            try:
                del self._optimizer.found_inf
            except AttributeError:
                pass
            self._attached = False


def first_nonfinite_update(metrics, accumulation_steps: int) -> Optional[int]:
    """The optimizer update (1-based, counted over the run) whose micro-step first produced a
    non-finite loss in this flush, or whose gradient norm was first non-finite; None if none.

    Derived from the flushed host values: a training flush follows the update of its last
    micro-step, and the micro-steps of an epoch form windows of ``accumulation_steps``, so the
    update of micro-step ``s`` lies ``last // k - s // k`` updates before ``num_updates``."""
    if metrics.phase != "train":
        return None
    k = max(1, accumulation_steps)
    if metrics.step_indices:
        last = metrics.step_indices[-1] // k
        for step, loss in zip(metrics.step_indices, metrics.losses):
            if not math.isfinite(loss):
                return metrics.num_updates - (last - step // k)
    norms = metrics.grad_norms
    for i, norm in enumerate(norms):
        if not math.isfinite(norm):
            return metrics.num_updates - (len(norms) - 1 - i)
    return None


def _weights_finite(trainer) -> Optional[bool]:
    model = getattr(trainer, "model", None)
    # sharded parameters (FSDP's DTensors): this process's shards say enough
    params = [getattr(p, "_local_tensor", p).detach() for p in model.parameters()] if model is not None else []
    if not params:
        return None
    flags = [torch.isfinite(p).all() for p in params if p.numel()]
    if not flags:
        return None
    # SYNC(stop): once, when training stops, to say whether the model in memory is still usable
    return bool(torch.stack(flags).all().item())


def stop_message(trainer, metrics, reason: str) -> str:
    """The message printed when ``nonfinite="stop"`` ends training: where the value first became
    non-finite, whether the weights in memory are now non-finite, and what to do about it."""
    train = metrics.phase == "train"
    what = "loss" if reason == "nonfinite_loss" else "gradient norm"
    phase = "training" if train else "validation"
    k = getattr(trainer.run_config, "gradient_accumulation_steps", 1)
    update = first_nonfinite_update(metrics, k)
    if update is not None:
        where = f"first at optimizer update {update} (epoch {metrics.epoch})"
    elif not train:
        bad = next((s for s, l in zip(metrics.step_indices, metrics.losses) if not math.isfinite(l)), None)
        where = f"at evaluation batch {bad} of epoch {metrics.epoch}" if bad is not None else f"in epoch {metrics.epoch}"
    elif metrics.nonfinite or metrics.grad_norms:
        where = f"in epoch {metrics.epoch}"
    else:  # another process saw it; the decision is shared so that all stop together
        where = f"on another process, in epoch {metrics.epoch}"
    lines = [f"Stopping training: non-finite {phase} {what} {where} (nonfinite='stop')."]
    finite = _weights_finite(trainer)
    if finite is False:
        lines.append(
            "The model's weights in memory are now non-finite (NaN/inf): do not save or use them."
        )
    elif finite:
        lines.append(
            f"The model's weights in memory are finite, but hold all {trainer.progress.num_updates} updates "
            "applied so far, including any after the non-finite value."
        )
    remedies = [
        "lower the learning rate",
        "clip gradients (train(gradient_clip_norm=1.0))",
        "Trainer(nonfinite='skip') to drop updates whose gradients are not finite",
    ]
    saved = getattr(trainer, "_last_good_save", None)
    if saved is not None:
        remedies.append(f"go back to the last training state written before it: {saved}")
    else:
        remedies.append("save training states (SaveTrainingStateCallback) to resume from the last good one")
    lines.append("Remedies: " + "; ".join(remedies) + ".")
    return "\n".join(lines)

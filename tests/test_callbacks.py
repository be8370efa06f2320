"""The callback system: event order, hooks before events, per-step dispatch, error handling,
TerminateOnNaN, and the batched on_metrics_flush event."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from fasttrain import Trainer
from fasttrain.callbacks import (
    CallbackHandler,
    CallbackMethodNotImplementedError,
    LogMetricsCallback,
    PrintProgressCallback,
    StopTrainingError,
    TerminateOnNaNCallback,
    TrainerCallback,
)

from tiny_regression import NO_WORKERS, sum_data, tanh_mlp, train_on

EVENTS = (
    "on_init_end",
    "on_training_run_start",
    "on_train_epoch_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_metrics_flush",
    "on_train_epoch_end",
    "on_eval_epoch_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_epoch_end",
    "on_training_run_epoch_end",
    "on_training_run_end",
    "on_evaluation_run_start",
    "on_evaluation_run_end",
    "on_stop_training_error",
)


class Recorder(TrainerCallback):
    """Appends every event (and the flushes' contents) to ``log``."""

    def __init__(self, log=None):
        self.log = [] if log is None else log
        self.flushes = []


def _record(event):
    def method(self, trainer, *args, **kwargs):
        self.log.append(event)
        if event == "on_metrics_flush":
            self.flushes.append(kwargs["metrics"])

    return method


for _event in EVENTS:
    setattr(Recorder, _event, _record(_event))


def make_trainer(callbacks=(), trainer_cls=Trainer, **kwargs):
    m = tanh_mlp()
    kwargs.setdefault("seed", 0)
    return trainer_cls(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.05), callbacks=callbacks, **kwargs)


def train(trainer, n_train=28, n_eval=12, bs=4, **kwargs):
    train_on(trainer, sum_data(n_train), sum_data(n_eval, seed=1) if n_eval else None, bs, **kwargs)


def expected_training_events(epochs, train_batches, eval_batches, log_every, accumulation=1):
    """The event sequence of a training run, from the documented rules: a flush after every
    ``log_every``-th update of the run and at every epoch end (train and eval)."""
    events = ["on_training_run_start"]
    updates = 0
    for _ in range(epochs):
        events.append("on_train_epoch_start")
        for step in range(train_batches):
            events += ["on_train_step_start", "on_train_step_end"]
            if (step + 1) % accumulation == 0 or step + 1 == train_batches:
                updates += 1
                if updates % log_every == 0:
                    events.append("on_metrics_flush")
        events += ["on_metrics_flush", "on_train_epoch_end"]
        if eval_batches:
            events.append("on_eval_epoch_start")
            for step in range(eval_batches):
                events += ["on_eval_step_start", "on_eval_step_end"]
                if (step + 1) % log_every == 0:
                    events.append("on_metrics_flush")
            events += ["on_metrics_flush", "on_eval_epoch_end"]
        events.append("on_training_run_epoch_end")
    return events + ["on_training_run_end"]


# ----------------------------------------------------------------------------- event order
@pytest.mark.parametrize("log_every, accumulation", [(3, 1), (2, 3), (50, 1)])
def test_full_event_order_of_a_run_with_eval(log_every, accumulation):
    recorder = Recorder()
    trainer = make_trainer([recorder], log_every_n_steps=log_every)
    assert recorder.log == ["on_init_end"]
    train(trainer, gradient_accumulation_steps=accumulation)
    # 28 samples / 4 = 7 train batches; 12 / 4 = 3 eval batches
    assert recorder.log[1:] == expected_training_events(2, 7, 3, log_every, accumulation)


def test_event_order_of_evaluate():
    recorder = Recorder()
    trainer = make_trainer([recorder], log_every_n_steps=2)
    recorder.log.clear()
    trainer.evaluate(sum_data(20), per_device_batch_size=4, dataloader_kwargs=NO_WORKERS)
    assert recorder.log == (
        ["on_evaluation_run_start", "on_eval_epoch_start"]
        + ["on_eval_step_start", "on_eval_step_end"] * 2
        + ["on_metrics_flush"]
        + ["on_eval_step_start", "on_eval_step_end"] * 2
        + ["on_metrics_flush"]
        + ["on_eval_step_start", "on_eval_step_end", "on_metrics_flush"]  # epoch end
        + ["on_eval_epoch_end", "on_evaluation_run_end"]
    )
    assert [f.is_epoch_end for f in recorder.flushes] == [False, False, True]
    assert [f.phase for f in recorder.flushes] == ["eval"] * 3


class HookLoggingTrainer(Trainer):
    HOOKS = (
        "training_run_start",
        "train_epoch_start",
        "calculate_train_batch_loss",
        "backward_step",
        "optimizer_step",
        "scheduler_step",
        "optimizer_zero_grad",
        "train_epoch_end",
        "eval_epoch_start",
        "calculate_eval_batch_loss",
        "eval_epoch_end",
        "training_run_epoch_end",
        "training_run_end",
        "evaluation_run_start",
        "evaluation_run_end",
    )


def _logged_hook(name):
    def hook(self, *args, **kwargs):
        self.shared_log.append("hook:" + name)
        return getattr(Trainer, name)(self, *args, **kwargs)

    return hook


for _hook in HookLoggingTrainer.HOOKS:
    setattr(HookLoggingTrainer, _hook, _logged_hook(_hook))


def test_callback_events_fire_after_the_trainer_hook_of_the_same_moment():
    log = []
    recorder = Recorder(log)
    HookLoggingTrainer.shared_log = log
    trainer = make_trainer([recorder], trainer_cls=HookLoggingTrainer, log_every_n_steps=100)
    log.clear()
    scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # noqa: E731
    # 5 batches, 2 micro-steps per update: updates after steps 1, 3 and 4
    train(trainer, n_train=20, n_eval=8, num_epochs=1, gradient_accumulation_steps=2, create_scheduler_fn=scheduler)
    update = ["hook:optimizer_step", "hook:scheduler_step", "hook:optimizer_zero_grad"]

    def step(is_update):
        return (
            ["on_train_step_start", "hook:calculate_train_batch_loss", "hook:backward_step"]
            + (update if is_update else [])
            + ["on_train_step_end"]
        )

    eval_step = ["on_eval_step_start", "hook:calculate_eval_batch_loss", "on_eval_step_end"]
    expected = (
        ["hook:training_run_start", "on_training_run_start", "hook:train_epoch_start", "on_train_epoch_start"]
        + step(False) + step(True) + step(False) + step(True) + step(True)
        + ["hook:train_epoch_end", "on_metrics_flush", "on_train_epoch_end"]
        + ["hook:eval_epoch_start", "on_eval_epoch_start"] + eval_step * 2
        + ["hook:eval_epoch_end", "on_metrics_flush", "on_eval_epoch_end"]
        + ["hook:training_run_epoch_end", "on_training_run_epoch_end"]
        + ["hook:training_run_end", "on_training_run_end"]
    )
    assert log == expected

    log.clear()
    trainer.evaluate(sum_data(8), per_device_batch_size=4, dataloader_kwargs=NO_WORKERS)
    assert log == (
        ["hook:evaluation_run_start", "on_evaluation_run_start", "hook:eval_epoch_start", "on_eval_epoch_start"]
        + eval_step * 2
        + ["hook:eval_epoch_end", "on_metrics_flush", "on_eval_epoch_end"]
        + ["hook:evaluation_run_end", "on_evaluation_run_end"]
    )


def test_callbacks_run_in_list_order():
    log = []

    class First(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            log.append("first")

    class Second(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            log.append("second")

    train(make_trainer([Second, First]), n_eval=0, num_epochs=2)
    assert log == ["second", "first", "second", "first"]


# ----------------------------------------------------------------------------- dispatch
class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.steps += 1


class EpochOnly(TrainerCallback):
    def on_train_epoch_end(self, trainer, **kwargs):
        pass


def test_per_step_events_go_only_to_callbacks_that_override_them():
    epoch_only, counter = EpochOnly(), StepCounter()
    handler = CallbackHandler([epoch_only, counter])
    step_end = handler.handlers("on_train_step_end")
    assert [m.__self__ for m in step_end] == [counter]
    assert [m.__self__ for m in handler.handlers("on_train_epoch_end")] == [epoch_only]
    assert handler.handlers("on_eval_step_end") == []
    # a callback added later joins the (live) list the trainer holds
    late = type("LateCounter", (StepCounter,), {})()
    handler.add_callback(late)
    assert [m.__self__ for m in step_end] == [counter, late]
    handler.clear_callbacks()
    assert step_end == []


def test_callback_added_during_a_run_receives_the_following_steps():
    late = StepCounter()

    class AddsOne(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            if trainer.run_history.current_epoch == 2:
                trainer.callback_handler.add_callback(late)

    train(make_trainer([AddsOne]), n_eval=0, num_epochs=2)
    assert late.steps == 7  # the second epoch's steps


def test_misspelled_event_warns_when_the_callback_is_added():
    class Misspelled(TrainerCallback):
        def on_train_stepend(self, trainer, **kwargs):
            pass

    with pytest.warns(UserWarning, match="on_train_step_end"):
        CallbackHandler([Misspelled])
    with pytest.warns(UserWarning, match="on_train_stepend"):
        make_trainer([Misspelled])


def test_correctly_spelled_custom_event_does_not_warn_and_can_be_fired():
    class Custom(TrainerCallback):
        def __init__(self):
            self.received = []

        def on_custom_metric_ready(self, trainer, value, **kwargs):
            self.received.append(value)

    custom = Custom()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handler = CallbackHandler([custom, EpochOnly()])
    handler.call_event("on_custom_metric_ready", None, value=3)  # EpochOnly lacks it: skipped
    assert custom.received == [3]


def test_adding_the_same_callback_class_twice_raises():
    with pytest.raises(ValueError, match="PrintProgressCallback"):
        CallbackHandler([PrintProgressCallback, PrintProgressCallback()])
    with pytest.raises(ValueError):
        make_trainer([StepCounter(), StepCounter()])
    handler = CallbackHandler([StepCounter])
    with pytest.raises(ValueError):
        handler.add_callback(StepCounter)
    assert len(handler.callbacks) == 1
    # a subclass is another class
    sub = type("SubCounter", (StepCounter,), {})
    assert len(CallbackHandler([StepCounter, sub]).callbacks) == 2


def test_callback_classes_are_instantiated_and_instances_kept():
    instance = StepCounter()
    trainer = make_trainer([LogMetricsCallback, instance])
    first, second = trainer.callback_handler.callbacks
    assert type(first) is LogMetricsCallback
    assert second is instance
    assert [type(cb) for cb in trainer.callback_handler] == [LogMetricsCallback, StepCounter]
    assert trainer.callback_handler.callback_list == ["LogMetricsCallback", "StepCounter"]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("event", ["on_train_step_end", "on_train_step_start", "on_eval_step_end", "on_train_epoch_end"])
def test_callback_method_not_implemented_error_skips_that_callback(event):
    def not_implemented(self, trainer, **kwargs):
        raise CallbackMethodNotImplementedError

    Skipping = type("Skipping", (TrainerCallback,), {event: not_implemented})
    recorder = Recorder()
    trainer = make_trainer([Skipping, recorder])
    train(trainer, num_epochs=1)
    assert recorder.log.count(event) == {"on_train_epoch_end": 1, "on_eval_step_end": 3}.get(event, 7)
    assert recorder.log[-1] == "on_training_run_end"
    assert "on_stop_training_error" not in recorder.log


def test_a_disabled_handler_delivers_no_event_per_step_or_otherwise():
    # pytorch-accelerated's switch (CallbackHandler._enabled), which the step loop's own
    # dispatch of on_train_step_end honours as call_methods does
    recorder = Recorder()
    trainer = make_trainer([recorder])
    assert recorder.log == ["on_init_end"]
    trainer.callback_handler._enabled = False
    train(trainer, num_epochs=1)
    assert recorder.log == ["on_init_end"]
    trainer.callback_handler._enabled = True
    train(trainer, num_epochs=1)
    assert recorder.log.count("on_train_step_end") == 7


def test_stop_training_error_ends_the_run_cleanly():
    class StopAtStep(TrainerCallback):
        def on_train_step_end(self, trainer, step, **kwargs):
            if trainer.run_history.current_epoch == 2 and step == 3:
                raise StopTrainingError("enough")

    recorder = Recorder()
    trainer = make_trainer([StopAtStep, recorder])
    train(trainer, num_epochs=5)  # returns
    log = recorder.log
    assert log.count("on_train_epoch_start") == 2
    assert log.count("on_train_epoch_end") == 1
    # StopAtStep comes first, so the recorder never sees the step that stopped the run
    assert log[-3:] == ["on_train_step_start", "on_stop_training_error", "on_training_run_end"]
    assert log.count("on_train_step_end") == 7 + 3
    # on_train_step_end fires after the whole micro-step, so that step's update happened
    assert trainer.num_updates == 7 + 4
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 1


class NaNAfter(Trainer):
    """Reports a NaN loss from the ``nan_from``-th training micro-step of the run on."""

    nan_from = 5

    def calculate_train_batch_loss(self, batch):
        out = super().calculate_train_batch_loss(batch)
        self.micro_steps = getattr(self, "micro_steps", 0) + 1
        if self.micro_steps > self.nan_from:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_terminate_on_nan_stops_at_the_first_flush_that_sees_it_without_exiting():
    recorder = Recorder()
    trainer = make_trainer(
        [recorder, TerminateOnNaNCallback], trainer_cls=NaNAfter, log_every_n_steps=4
    )
    nan_callback = trainer.callback_handler.callbacks[1]
    assert nan_callback.triggered is False
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    train(trainer, n_train=80, num_epochs=3)  # would raise SystemExit in the original
    assert nan_callback.triggered is True
    # step 6 is the first NaN; the flushes come at updates 4 and 8: stop after update 8
    assert trainer.num_updates == 8
    assert [f.nonfinite for f in recorder.flushes] == [False, True]
    assert recorder.log[-2:] == ["on_stop_training_error", "on_training_run_end"]
    assert "on_train_epoch_end" not in recorder.log
    assert not torch.isfinite(trainer.model[0].weight).all()
    # a new run (from finite weights) starts untriggered and stays so
    trainer.model.load_state_dict(initial)
    NaNAfter.nan_from, trainer.micro_steps = 10**9, 0
    try:
        train(trainer, num_epochs=1, n_train=8)
    finally:
        NaNAfter.nan_from = 5
    assert nan_callback.triggered is False


def test_terminate_on_nan_lets_training_go_on_when_non_finite_values_are_ignored():
    recorder = Recorder()
    trainer = make_trainer(
        [recorder, TerminateOnNaNCallback], trainer_cls=NaNAfter, log_every_n_steps=4, nonfinite="ignore"
    )
    train(trainer, n_train=80, num_epochs=3)
    assert trainer.callback_handler.callbacks[1].triggered is False
    assert trainer.num_updates == 3 * 20
    assert "on_stop_training_error" not in recorder.log
    assert [f.nonfinite for f in recorder.flushes if f.phase == "train"][:2] == [False, True]


def test_user_callback_reading_the_loss_every_step_still_works():
    class ItemPerStep(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
            self.losses.append(batch_output["loss"].item())

    item, recorder = ItemPerStep(), Recorder()
    train(make_trainer([item, recorder], log_every_n_steps=3), num_epochs=2)
    flushed = [loss for f in recorder.flushes if f.phase == "train" for loss in f.losses]
    assert len(item.losses) == 14
    assert item.losses == pytest.approx(flushed, rel=1e-6)


# ----------------------------------------------------------------------------- on_metrics_flush
def reference_run(n=28, bs=4, epochs=2, clip_norm=None, lr=0.05, accumulation=1):
    """Per-micro-step losses, batch sizes and per-update gradient norms of the same run written
    as a plain PyTorch loop (no shuffling, SGD)."""
    m = tanh_mlp()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    x, y = sum_data(n).tensors
    losses, sizes, norms = [], [], []
    batches = [(x[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]
    for _ in range(epochs):
        for step, (xb, yb) in enumerate(batches):
            loss = nn.functional.mse_loss(m(xb), yb)
            (loss / accumulation).backward()
            losses.append(loss.item())
            sizes.append(len(yb))
            if (step + 1) % accumulation == 0 or step + 1 == len(batches):
                if clip_norm is not None:
                    norms.append(float(nn.utils.clip_grad_norm_(m.parameters(), clip_norm)))
                opt.step()
                opt.zero_grad()
    return losses, sizes, norms


@pytest.mark.parametrize("accumulation", [1, 2])
def test_metrics_flush_delivers_the_step_losses_and_grad_norms(accumulation):
    recorder = Recorder()
    trainer = make_trainer([recorder], log_every_n_steps=2)
    # 30 samples in batches of 4: 7 full batches and one of 2
    train(trainer, n_train=30, n_eval=0, gradient_clip_norm=0.5, gradient_accumulation_steps=accumulation)
    losses, sizes, norms = reference_run(n=30, clip_norm=0.5, accumulation=accumulation)
    flushes = recorder.flushes
    assert all(f.phase == "train" for f in flushes)
    assert [loss for f in flushes for loss in f.losses] == pytest.approx(losses, rel=1e-5)
    assert [b for f in flushes for b in f.batch_sizes] == sizes
    assert [g for f in flushes for g in f.grad_norms] == pytest.approx(norms, rel=1e-5)
    assert max(norms) > 0.5  # the clip was active
    assert [s for f in flushes for s in f.step_indices] == list(range(8)) * 2
    # every 2 updates and at each epoch end, with the run's update count
    updates_per_epoch = math.ceil(8 / accumulation)
    expected_counts = []
    for epoch in range(2):
        done = epoch * updates_per_epoch
        expected_counts += [u for u in range(done + 1, done + updates_per_epoch + 1) if u % 2 == 0]
        expected_counts.append(done + updates_per_epoch)
    assert [f.num_updates for f in flushes] == expected_counts
    assert [f.is_epoch_end for f in flushes].count(True) == 2
    # running epoch totals and the run history agree with the reference
    for epoch in (1, 2):
        end = [f for f in flushes if f.epoch == epoch and f.is_epoch_end][0]
        epoch_losses, epoch_sizes = losses[(epoch - 1) * 8 : epoch * 8], sizes[(epoch - 1) * 8 : epoch * 8]
        mean = sum(l * b for l, b in zip(epoch_losses, epoch_sizes)) / sum(epoch_sizes)
        assert end.epoch_sample_count == 30
        assert end.epoch_mean_loss == pytest.approx(mean, rel=1e-5)
        assert trainer.run_history.get_metric_values("train_loss_epoch")[epoch - 1] == pytest.approx(mean, rel=1e-5)


def test_metrics_flush_has_no_grad_norms_without_norm_clipping():
    recorder = Recorder()
    train(make_trainer([recorder], log_every_n_steps=2), n_eval=0, gradient_clip_value=0.1, num_epochs=1)
    assert recorder.flushes and all(f.grad_norms == [] for f in recorder.flushes)
    assert not any(f.nonfinite for f in recorder.flushes)

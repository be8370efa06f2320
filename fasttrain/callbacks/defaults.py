"""The callbacks a trainer uses unless told otherwise."""

from __future__ import annotations

import time

from torch import nn
from tqdm import tqdm

from fasttrain.callbacks.events import StopTrainingError, TrainerCallback
from fasttrain.callbacks.nan_check import PerStepNaNCheck


class MoveModulesToDeviceCallback(TrainerCallback):
    """Moves every ``nn.Module`` attribute of the trainer other than the model (for example a
    loss function with weights) to the trainer's device."""

    def _get_modules(self, trainer):
        """``(name, module)`` for every ``nn.Module`` attribute of the trainer; a subclass may
        override it to choose the modules moved."""
        return [(name, value) for name, value in vars(trainer).items() if isinstance(value, nn.Module)]

    def _move_modules_to_device(self, trainer):
        for name, module in self._get_modules(trainer):
            if name != "model":  # the trainer places the model itself
                module.to(trainer.device)

    def on_training_run_start(self, trainer, **kwargs):
        self._move_modules_to_device(trainer)

    def on_evaluation_run_start(self, trainer, **kwargs):
        self._move_modules_to_device(trainer)


class TerminateOnNaNCallback(PerStepNaNCheck, TrainerCallback):
    """Stops the run at the first flush that sees a non-finite loss.

    The check uses the batched host values, so it costs no per-step synchronisation; the stop
    happens at most ``log_every_n_steps`` updates after the bad step. The process is not exited:
    ``train()`` returns and ``triggered`` tells what happened. It acts only under the trainer's
    default ``nonfinite="stop"``: with ``"skip"`` or ``"ignore"`` training goes on.
    """

    def __init__(self):
        self.triggered = False

    def on_training_run_start(self, trainer, **kwargs):
        self.triggered = False

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if metrics.nonfinite and getattr(trainer, "nonfinite", "stop") == "stop":
            self.triggered = True
            bad = next(
                (i for i, loss in zip(metrics.step_indices, metrics.losses) if loss != loss or loss in (float("inf"), float("-inf"))),
                None,
            )
            # the trainer's guard has already described the stop in full (update, weights,
            # remedies); its message is used when it has one
            message = getattr(getattr(trainer, "_nonfinite", None), "stop_message", None)
            if message is None:
                phase = "training" if metrics.phase == "train" else "validation"
                message = (
                    f"Stopping training due to a non-finite {phase} loss at step {bad} of epoch "
                    f"{metrics.epoch}"
                )
            raise StopTrainingError(message)


class PrintProgressCallback(TrainerCallback):
    """Prints the start and end of runs and epochs."""

    def on_training_run_start(self, trainer, **kwargs):
        trainer.print("\nStarting training run")

    def on_train_epoch_start(self, trainer, **kwargs):
        trainer.print(f"\nStarting epoch {trainer.run_history.current_epoch}")

    def on_training_run_end(self, trainer, **kwargs):
        trainer.print("Finishing training run")

    def on_eval_epoch_start(self, trainer, **kwargs):
        trainer.print("\nStarting eval epoch")

    def on_evaluation_run_start(self, trainer, **kwargs):
        trainer.print("\nStarting evaluation run")

    def on_evaluation_run_end(self, trainer, **kwargs):
        trainer.print("Finishing evaluation run")


class ProgressBarCallback(TrainerCallback):
    """A tqdm bar per epoch showing steps, the running loss and samples per second.

    The step count is a host counter; the loss and throughput come from the batched flushes. At
    the end of an epoch the bar shows the epoch's totals: every step it ran (also when a resumed
    run started mid-epoch), the epoch's mean loss and its samples per second over the epoch.
    """

    #: reads no ``model_outputs`` at step ends (the graphed engine need not keep them)
    model_outputs_phases = ()

    def __init__(self, *, file=None):
        """
        :param file: the stream the bars are written to (``sys.stderr`` when None)
        """
        self.pbar = None
        self.eval_pbar = None
        self._file = file
        self._started = {}

    def _new_bar(self, trainer, dataloader, desc):
        self._started[desc] = time.perf_counter()
        return tqdm(
            total=len(dataloader),
            desc=desc,
            file=self._file,
            disable=not trainer._accelerator.is_local_main_process,
            leave=True,
        )

    def on_train_epoch_start(self, trainer, **kwargs):
        self.pbar = self._new_bar(trainer, trainer._train_dataloader, "train")
        config = trainer.run_config
        if config is not None and config.max_num_train_steps is not None:
            # a run that reaches max_num_train_steps in this epoch ends before the loader does
            left = (config.max_num_train_steps - trainer.progress.num_updates) * config.gradient_accumulation_steps
            self.pbar.total = max(0, min(self.pbar.total, left))

    def on_train_step_end(self, trainer, *, step=None, **kwargs):
        bar = self.pbar
        n = bar.n
        # The step index, not a count of calls: a run resumed mid-epoch starts past 0. The
        # trainer always passes it; a call without it advances the bar by one.
        if step is None:
            step = n
        if step >= n:
            if step >= bar.total:  # resumed mid-epoch: the steps before count too
                bar.total = min(step + 1 + bar.total, len(trainer._train_dataloader))
            bar.update(step + 1 - n)

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        train = metrics.phase == "train"
        bar = self.pbar if train else self.eval_pbar
        if bar is None or bar.disable:
            return
        postfix = f"loss={metrics.global_epoch_mean_loss:.4g}"
        if metrics.is_epoch_end:
            # the whole epoch's rate: the last flush may hold few steps, or none at all
            elapsed = time.perf_counter() - self._started["train" if train else "eval"]
            samples = metrics.epoch_sample_count
        else:
            elapsed, samples = metrics.elapsed_s, metrics.num_samples
        if elapsed > 0 and samples > 0:
            postfix += f", samples/s={samples / elapsed:.4g}"
        # the text set_postfix({"loss": ..., "samples/s": ...}) makes, without its per-value
        # type checks and conversions: the values are formatted strings already
        bar.set_postfix_str(postfix, refresh=False)
        if metrics.is_epoch_end:
            bar.refresh()

    def on_train_epoch_end(self, trainer, **kwargs):
        if self.pbar is not None:
            self.pbar.close()

    def on_stop_training_error(self, trainer, **kwargs):
        # the epoch will not end: close its bars where they stand, so that what is printed next
        # starts on a line of its own
        for bar in (self.pbar, self.eval_pbar):
            if bar is not None:
                bar.close()

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.eval_pbar = self._new_bar(trainer, trainer._eval_dataloader, "eval")

    def on_eval_step_end(self, trainer, **kwargs):
        self.eval_pbar.update(1)

    def on_eval_epoch_end(self, trainer, **kwargs):
        if self.eval_pbar is not None:
            self.eval_pbar.close()


class LogMetricsCallback(TrainerCallback):
    """Prints the latest value of each metric at the end of every epoch. Subclass it and
    override :meth:`log_metrics` to send metrics elsewhere."""

    def on_train_epoch_end(self, trainer, **kwargs):
        names = [m for m in trainer.run_history.get_metric_names() if "train" in m]
        self._log_latest_metrics(trainer, names)

    def on_eval_epoch_end(self, trainer, **kwargs):
        names = [m for m in trainer.run_history.get_metric_names() if "train" not in m]
        self._log_latest_metrics(trainer, names)

    def _log_latest_metrics(self, trainer, metric_names):
        self.log_metrics(trainer, self._get_latest_metrics(trainer, sorted(metric_names)))

    def _get_latest_metrics(self, trainer, metric_names):
        """``{name: latest value}`` from the run history for ``metric_names``, in their order."""
        return {name: trainer.run_history.get_latest_metric(name) for name in metric_names}

    def log_metrics(self, trainer, metrics: dict):
        for name, value in metrics.items():
            trainer.print(f"\n{name}: {value}")


def get_default_callbacks(progress_bar: bool = True):
    """The callbacks a trainer uses unless told otherwise, in order."""
    if progress_bar:
        return (
            MoveModulesToDeviceCallback,
            TerminateOnNaNCallback,
            PrintProgressCallback,
            ProgressBarCallback,
            LogMetricsCallback,
        )
    return (
        MoveModulesToDeviceCallback,
        TerminateOnNaNCallback,
        PrintProgressCallback,
        LogMetricsCallback,
    )

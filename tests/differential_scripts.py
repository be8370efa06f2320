"""Training scripts written once and run under pytorch-accelerated 0.1.61 and under fasttrain.

Each ``script_*`` function takes a :class:`Lib` (the modules of one library) and returns a
:class:`Outcome`: final weights, run history, the recorded events and hook calls, and anything
else the script observed. ``tests/test_differential*.py`` runs a script under both libraries and
compares the outcomes.

Seeding: pytorch-accelerated calls ``set_seed(42, device_specific=True)`` in every ``train()``
and ``evaluate()``; fasttrain does so at the same point only when asked with ``Trainer(seed=42)``,
which is what :attr:`Lib.trainer_kwargs` adds for fasttrain. Models start from a deep copy of one
set of initial weights.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

ORIGINAL = "pytorch_accelerated"
FASTTRAIN = "fasttrain"

#: the events of API.md, in firing order of a training run with evaluation
API_EVENTS = (
    "on_init_end",
    "on_training_run_start",
    "on_train_epoch_start",
    "on_train_step_start",
    "on_train_step_end",
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

NO_WORKERS = {"num_workers": 0}


@dataclass
class Lib:
    name: str
    trainer: ModuleType
    callbacks: ModuleType
    finetuning: ModuleType
    schedulers: ModuleType
    trainer_kwargs: dict
    #: the recording trainer counts its optimizer_step calls (a Python counter changed inside the
    #: step, which the graphed engine refuses to capture: the graphed tests leave it out)
    counts_optimizer_steps: bool = True

    @property
    def Trainer(self):
        return self.trainer.Trainer

    @property
    def TrainerPlaceholderValues(self):
        return self.trainer.TrainerPlaceholderValues

    @property
    def is_original(self) -> bool:
        return self.name == ORIGINAL


def load_lib(name: str) -> Lib:
    def mod(sub):
        return importlib.import_module(f"{name}.{sub}")

    return Lib(
        name=name,
        trainer=mod("trainer"),
        callbacks=mod("callbacks"),
        finetuning=mod("finetuning"),
        schedulers=mod("schedulers"),
        trainer_kwargs={} if name == ORIGINAL else {"seed": 42},
    )


@dataclass
class Outcome:
    weights: Dict[str, torch.Tensor]
    history: Dict[str, list]
    events: List[str]
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- model and data
class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


_INITIAL: Dict[float, MLP] = {}


def make_model(dropout: float = 0.0) -> MLP:
    """A deep copy of one fixed set of initial weights."""
    if dropout not in _INITIAL:
        state = torch.random.get_rng_state()
        torch.manual_seed(1234)
        _INITIAL[dropout] = MLP(dropout)
        torch.random.set_rng_state(state)
    return copy.deepcopy(_INITIAL[dropout])


def make_data(n: int, seed: int, shift: float = 0.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.5], [-2.0], [0.5], [1.0]])
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g) + shift
    return TensorDataset(x, y)


TRAIN_DATA = make_data(52, seed=0)  # 52 = 6 full batches of 8 and one of 4
EVAL_DATA = make_data(20, seed=1)


# ----------------------------------------------------------------------------- recording
def make_recorder(lib: Lib, extra_events=()):
    """A callback of ``lib`` that appends the name of every API event (and ``extra_events``) it
    receives to ``self.events``."""
    base = lib.callbacks.TrainerCallback

    def make_method(event):
        def method(self, trainer, *args, **kwargs):
            self.events.append(event)
            self.payloads.append((event, kwargs))

        method.__name__ = event
        return method

    namespace = {name: make_method(name) for name in tuple(API_EVENTS) + tuple(extra_events)}

    def __init__(self):
        self.events = []
        self.payloads = []

    namespace["__init__"] = __init__
    return type("Recorder", (base,), namespace)()


def recording_trainer_class(lib: Lib, custom_event: Optional[str] = None):
    """A Trainer subclass of ``lib`` that logs its hook calls, the learning rate after every
    scheduler step, and fires ``custom_event`` from ``train_epoch_end`` when given."""

    class RecordingTrainer(lib.Trainer):
        def __init__(self, *args, **kwargs):
            self.hook_calls = []
            self.lrs = []
            self.num_optimizer_steps = 0 if lib.counts_optimizer_steps else None
            super().__init__(*args, **kwargs)

        if lib.counts_optimizer_steps:

            def optimizer_step(self):
                self.num_optimizer_steps += 1
                super().optimizer_step()

        def scheduler_step(self):
            super().scheduler_step()
            # the group's value as it is: a tensor written in place would show its last value
            # at every entry when the outcome is made
            self.lrs.append(self.optimizer.param_groups[0]["lr"])

        def train_epoch_end(self):
            super().train_epoch_end()
            if custom_event is not None:
                self.callback_handler.call_event(
                    custom_event, self, epoch=self.run_history.current_epoch
                )

    return RecordingTrainer


def build_trainer(lib: Lib, model, optimizer, callbacks=(), custom_event=None, **kwargs):
    """A recording trainer with the default callbacks (without the progress bar), then the
    given ones, then a recorder (``trainer.recorder``)."""
    recorder = make_recorder(lib, extra_events=(custom_event,) if custom_event else ())
    default = lib.callbacks.get_default_callbacks(progress_bar=False)
    cls = recording_trainer_class(lib, custom_event)
    trainer = cls(
        model=model,
        loss_func=nn.MSELoss(),
        optimizer=optimizer,
        callbacks=(*default, *callbacks, recorder),
        **lib.trainer_kwargs,
        **kwargs,
    )
    trainer.recorder = recorder
    return trainer


def history_of(trainer) -> Dict[str, list]:
    rh = trainer.run_history
    return {name: list(rh.get_metric_values(name)) for name in sorted(rh.get_metric_names())}


def outcome(trainer, **extra) -> Outcome:
    model = trainer.get_model() if hasattr(trainer, "get_model") else trainer.model
    return Outcome(
        weights={k: v.detach().clone() for k, v in model.state_dict().items()},
        history=history_of(trainer),
        events=list(trainer.recorder.events),
        extra={"lrs": [float(lr) for lr in trainer.lrs], "num_optimizer_steps": trainer.num_optimizer_steps, **extra},
    )


def train_kwargs(**overrides) -> dict:
    kwargs = dict(
        train_dataset=TRAIN_DATA,
        eval_dataset=EVAL_DATA,
        num_epochs=3,
        per_device_batch_size=8,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
    )
    kwargs.update(overrides)
    return kwargs


# ----------------------------------------------------------------------------- the scripts
def script_plain(lib: Lib, shuffle: bool = True, dropout: float = 0.1) -> Outcome:
    """Training with evaluation after each epoch, AdamW, shuffled batches and dropout (both
    consume the seeded random streams)."""
    model = make_model(dropout)
    trainer = build_trainer(lib, model, torch.optim.AdamW(model.parameters(), lr=0.01))
    trainer.train(
        **train_kwargs(train_dataloader_kwargs={"num_workers": 0, "shuffle": shuffle})
    )
    return outcome(trainer)


def script_accumulation(lib: Lib, steps: int = 3) -> Outcome:
    """Gradient accumulation (7 batches per epoch, so the last window is short), no clipping."""
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    trainer.train(**train_kwargs(gradient_accumulation_steps=steps))
    return outcome(trainer)


def script_clip_value(lib: Lib, clip: Optional[float] = 0.05) -> Outcome:
    """Value clipping without accumulation, at a value that clips most gradient entries."""
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.05))
    trainer.train(**train_kwargs(gradient_clip_value=clip))
    return outcome(trainer)


def script_one_cycle(lib: Lib, **trainer_kwargs) -> Outcome:
    """OneCycleLR built from placeholders, with accumulation so that updates per epoch differ
    from the dataloader length."""
    P = lib.TrainerPlaceholderValues
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), **trainer_kwargs)
    factory = functools.partial(
        torch.optim.lr_scheduler.OneCycleLR,
        max_lr=0.1,
        epochs=P.NUM_EPOCHS,
        steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH,
    )
    trainer.train(**train_kwargs(gradient_accumulation_steps=2, create_scheduler_fn=factory))
    return outcome(
        trainer,
        total_steps=trainer.scheduler.total_steps,
        num_epochs=trainer.run_config.num_epochs,
        updates_per_epoch=trainer.run_config.num_update_steps_per_epoch,
    )


def script_max_steps(lib: Lib, max_steps: int = 10, accumulation: int = 1) -> Outcome:
    """``max_num_train_steps`` overrides ``num_epochs`` and stops mid-epoch."""
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.05))
    trainer.train(
        **train_kwargs(
            num_epochs=50, max_num_train_steps=max_steps, gradient_accumulation_steps=accumulation
        )
    )
    return outcome(trainer, num_epochs=trainer.run_config.num_epochs)


def script_evaluate(lib: Lib) -> Outcome:
    """``evaluate()`` after a short training run: the run history holds only evaluation_loss."""
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.05))
    trainer.train(**train_kwargs(num_epochs=1, eval_dataset=None))
    trainer.recorder.events.clear()
    trainer.evaluate(
        dataset=EVAL_DATA, per_device_batch_size=6, dataloader_kwargs=dict(NO_WORKERS)
    )
    return outcome(trainer)


def script_save_best_and_early_stopping(lib: Lib, save_path: str) -> Outcome:
    """SaveBestModelCallback and EarlyStoppingCallback on an eval set whose targets are shifted,
    so that the eval loss stops improving while the training loss still falls."""
    cb = lib.callbacks
    model = make_model()
    save_best = cb.SaveBestModelCallback(save_path=save_path)
    early = cb.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.01)
    trainer = build_trainer(
        lib, model, torch.optim.SGD(model.parameters(), lr=0.02), callbacks=(save_best, early)
    )
    trainer.train(**train_kwargs(num_epochs=30, eval_dataset=make_data(20, seed=1, shift=3.0)))
    saved = torch.load(save_path, weights_only=True)
    return outcome(
        trainer,
        best_metric=save_best.best_metric,
        best_metric_epoch=save_best.best_metric_epoch,
        patience_counter=early.early_stopping_patience_counter,
        saved_weights=saved["model_state_dict"],
        saved_metric=saved.get("eval_loss_epoch", saved.get("loss")),
    )


def script_custom_event(lib: Lib) -> Outcome:
    """A trainer subclass fires ``my_event`` from its ``train_epoch_end`` hook."""
    model = make_model()
    trainer = build_trainer(
        lib, model, torch.optim.SGD(model.parameters(), lr=0.05), custom_event="my_event"
    )
    trainer.train(**train_kwargs(num_epochs=2))
    payloads = [kw for event, kw in trainer.recorder.payloads if event == "my_event"]
    return outcome(trainer, my_event_payloads=payloads)


def script_finetuning(lib: Lib, fresh_trainer_for_second_phase: bool = False) -> Outcome:
    """Freeze the body, train the head, unfreeze, add the body to the optimizer, train again
    with ``reset_run_history=False``.

    ``fresh_trainer_for_second_phase`` runs the second phase in a new trainer on the same model
    and optimizer instead (the reference for the original, whose second ``train()`` on the same
    trainer stops early, see the test)."""
    model = make_model()
    freezer = lib.finetuning.ModelFreezer(model)
    freezer.freeze()
    trainable_first = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(freezer.get_trainable_parameters(), lr=0.01)
    trainer = build_trainer(lib, model, optimizer)
    trainer.train(**train_kwargs(num_epochs=2))
    first = outcome(trainer)
    unfrozen = freezer.unfreeze()
    for group in unfrozen.values():
        trainer.optimizer.add_param_group(group)
    if fresh_trainer_for_second_phase:
        trainer = build_trainer(lib, trainer.model, trainer.optimizer)
    trainer.train(**train_kwargs(num_epochs=2, reset_run_history=False))
    return outcome(
        trainer,
        first_phase=first,
        trainable_first=trainable_first,
        unfrozen_groups=sorted(unfrozen),
        unfrozen_names=sorted(
            n for n, p in model.named_parameters() for g in unfrozen.values() for q in g["params"] if p is q
        ),
    )


class TimmLikeScheduler:
    """Records the calls a timm scheduler receives from ``TrainerWithTimmScheduler``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.calls = []

    def step(self, epoch):
        self.calls.append(("step", epoch))

    def step_update(self, num_updates):
        self.calls.append(("step_update", num_updates))


def timm_trainer_class(lib: Lib):
    """The library's ``TrainerWithTimmScheduler``: a subclass that keeps its own
    ``self.num_updates``."""
    return lib.trainer.TrainerWithTimmScheduler


def script_timm_subclass(lib: Lib, max_steps: Optional[int] = None) -> Outcome:
    """A trainer subclass that assigns ``self.num_updates`` and drives a timm-style scheduler."""
    model = make_model()
    recorder = make_recorder(lib)
    trainer = timm_trainer_class(lib)(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=(*lib.callbacks.get_default_callbacks(progress_bar=False), recorder),
        **lib.trainer_kwargs,
    )
    trainer.train(**train_kwargs(create_scheduler_fn=TimmLikeScheduler, max_num_train_steps=max_steps))
    model = trainer.get_model()
    return Outcome(
        weights={k: v.detach().clone() for k, v in model.state_dict().items()},
        history=history_of(trainer),
        events=list(recorder.events),
        extra={"calls": list(trainer.scheduler.calls), "num_updates": trainer.num_updates},
    )


def run_scheduler_script(lib: Lib, factory_builder, num_epochs: int = 4, accumulation: int = 1) -> Outcome:
    """Train with the scheduler made by ``factory_builder(lib)``; ``lrs`` holds the learning
    rate after every scheduler step."""
    model = make_model()
    trainer = build_trainer(lib, model, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train(
        **train_kwargs(
            num_epochs=num_epochs,
            eval_dataset=None,
            create_scheduler_fn=factory_builder(lib),
            gradient_accumulation_steps=accumulation,
        )
    )
    return outcome(trainer, updates_per_epoch=trainer.run_config.num_update_steps_per_epoch)


def cosine_factory(num_warmup_epochs=0, **kwargs):
    def build(lib: Lib):
        return lib.schedulers.CosineLrScheduler.create_scheduler_fn(
            num_warmup_epochs=num_warmup_epochs, lr_min=1e-3, warmup_starting_lr=1e-3, **kwargs
        )

    return build


def wsd_factory(**kwargs):
    def build(lib: Lib):
        return lib.schedulers.WSDLrScheduler.create_scheduler_fn(**kwargs)

    return build


def expected_cosine_lrs(lr_max, lr_min, warmup_start, total, warmup, cooldown=0, k=1.0) -> list:
    """The corrected cosine schedule, from its definition: linear warmup over ``warmup`` updates,
    a cosine over the ``total - warmup - cooldown`` updates after it, then ``lr_min``. Entry ``i``
    is what a stateful scheduler writes at its ``i + 1``-th ``step()`` (the value for ``i``
    completed updates)."""
    length = total - warmup - cooldown
    values = []
    for n in range(total):
        if n < warmup:
            values.append(warmup_start + n * (lr_max - warmup_start) / warmup)
        elif n - warmup < length:
            t = n - warmup
            values.append(lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * t**k / length**k)))
        else:
            values.append(lr_min)
    return values


def weights_close(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], rtol=1e-5, atol=1e-7) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")



def script_own_clipping(lib: Lib, max_norm: float = 0.05, **trainer_kwargs) -> Outcome:
    """A subclass's ``_clip_gradients`` clipping by norm instead of the default by value (the
    original calls it wherever ``gradient_clip_value`` is set); no accumulation, so the original's
    call per micro-step is one per update."""
    base = recording_trainer_class(lib)

    class ClipsByNorm(base):
        def __init__(self, *args, **kwargs):
            self.clip_calls = 0
            super().__init__(*args, **kwargs)

        def _clip_gradients(self):
            self.clip_calls += 1
            self._accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    model = make_model()
    recorder = make_recorder(lib)
    trainer = ClipsByNorm(
        model=model,
        loss_func=nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=(*lib.callbacks.get_default_callbacks(progress_bar=False), recorder),
        **lib.trainer_kwargs,
        **trainer_kwargs,
    )
    trainer.recorder = recorder
    trainer.train(**train_kwargs(gradient_clip_value=1.0))
    return outcome(trainer, clip_calls=trainer.clip_calls)

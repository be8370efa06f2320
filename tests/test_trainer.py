"""The Trainer: checkpoints, run history, placeholders, dataloader defaults, seeding, step limits,
and the migration promise (every public name of the original API imports from fasttrain)."""

from __future__ import annotations

import builtins
import copy
import functools
import importlib
import inspect
import math
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fasttrain
from fasttrain import Trainer, TrainerPlaceholderValues as P
from fasttrain.callbacks import SaveTrainingStateCallback, TrainerCallback

from tiny_regression import NO_WORKERS, train_on



def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-1.0], [2.0]]) + 0.1 * torch.randn(n, 1, generator=g))


def model(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))


def make_trainer(m=None, optimizer_cls=torch.optim.AdamW, lr=0.01, callbacks=(), **kwargs):
    m = model() if m is None else m
    return Trainer(m, nn.MSELoss(), optimizer_cls(m.parameters(), lr=lr), callbacks=callbacks, **kwargs)


def fit(trainer, n=30, n_eval=0, bs=4, dl=NO_WORKERS, **kwargs):
    return train_on(trainer, data(n), data(n_eval, seed=1) if n_eval else None, bs, dl, **kwargs)


def state_equal(a, b):
    """Exact equality of nested state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


def weights(trainer):
    return {k: v.clone() for k, v in trainer.get_model().state_dict().items()}


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_restores_weights_optimizer_and_kwargs(tmp_path):
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    trainer = fit(make_trainer(), create_scheduler_fn=sched)
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path, checkpoint_kwargs={"epoch": 2, "note": "best", "values": [1.5, 2]})
    # deep copies: the optimizer updates its state tensors in place
    saved_weights, saved_opt = weights(trainer), copy.deepcopy(trainer.optimizer.state_dict())
    saved_sched = copy.deepcopy(trainer.scheduler.state_dict())

    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"model_state_dict", "optimizer_state_dict", "scheduler_state_dict", "epoch", "note", "values"}

    # a fresh trainer with other initial weights and an empty optimizer state
    other = make_trainer(model(seed=5))
    assert not state_equal(weights(other), saved_weights)
    returned = other.load_checkpoint(path, load_scheduler=False)
    assert (returned["epoch"], returned["note"], returned["values"]) == (2, "best", [1.5, 2])
    assert state_equal(weights(other), saved_weights)
    assert state_equal(other.optimizer.state_dict(), saved_opt)
    assert other.optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0  # a real state

    # the same trainer, after more training, goes back to the saved state (scheduler included)
    fit(trainer, num_epochs=1, create_scheduler_fn=sched)
    assert not state_equal(weights(trainer), saved_weights)
    trainer.load_checkpoint(path)
    assert state_equal(weights(trainer), saved_weights)
    assert state_equal(trainer.optimizer.state_dict(), saved_opt)
    assert trainer.scheduler.state_dict()["last_epoch"] == saved_sched["last_epoch"]


def test_checkpoint_without_optimizer(tmp_path):
    trainer = fit(make_trainer(), num_epochs=1)
    trainer.save_checkpoint(tmp_path / "w.pt", save_optimizer=False)
    assert set(torch.load(tmp_path / "w.pt", weights_only=True)) == {"model_state_dict"}
    other = make_trainer(model(seed=3))
    other.load_checkpoint(tmp_path / "w.pt")
    assert state_equal(weights(other), weights(trainer))
    assert other.optimizer.state_dict()["state"] == {}


def test_checkpoint_written_by_pytorch_accelerated_loads(tmp_path):
    """Existing checkpoints survive the migration."""
    pa = pytest.importorskip("pytorch_accelerated")
    m = model()
    original = pa.Trainer(m, nn.MSELoss(), torch.optim.AdamW(m.parameters(), lr=0.01), callbacks=())
    original.train(data(16), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=NO_WORKERS)
    original.save_checkpoint(tmp_path / "pa.pt", checkpoint_kwargs={"epoch": 1})
    ours = make_trainer(model(seed=9))
    assert ours.load_checkpoint(tmp_path / "pa.pt")["epoch"] == 1
    assert state_equal(weights(ours), {k: v for k, v in m.state_dict().items()})
    assert state_equal(ours.optimizer.state_dict(), original.optimizer.state_dict())


def test_training_state_round_trip(tmp_path):
    trainer = fit(make_trainer(), n_eval=8)
    trainer.save_training_state(tmp_path / "state", checkpoint_kwargs={"tag": "after-2", "global_step": 16})
    other = make_trainer(model(seed=4))
    metadata = other.load_training_state(tmp_path / "state")
    assert metadata["tag"] == "after-2" and metadata["global_step"] == 16
    assert metadata["current_epoch"] == trainer.run_history.current_epoch == 3
    assert state_equal(weights(other), weights(trainer))
    assert state_equal(other.optimizer.state_dict(), trainer.optimizer.state_dict())
    assert other.run_history.current_epoch == 3
    for name in ("train_loss_epoch", "eval_loss_epoch"):
        assert other.run_history.get_metric_values(name) == trainer.run_history.get_metric_values(name)


def test_resume_from_continues_the_run(tmp_path):
    """A basic round trip: resuming from the state saved after epoch 1 ends where an
    uninterrupted run ends (step-exact resume is tested in depth elsewhere)."""
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_epochs=1, save_at_end=False)
    shuffled = {"num_workers": 0, "shuffle": True}
    full = fit(make_trainer(model(dropout=0.2), callbacks=[saver], seed=3), n_eval=8, num_epochs=3, dl=shuffled)
    assert (tmp_path / "epoch_1").is_dir()
    resumed = make_trainer(model(dropout=0.2, seed=11), seed=3)
    fit(resumed, n_eval=8, num_epochs=3, dl=shuffled, resume_from=str(tmp_path / "epoch_1"))
    assert state_equal(weights(resumed), weights(full))
    for name in ("train_loss_epoch", "eval_loss_epoch"):
        assert resumed.run_history.get_metric_values(name) == pytest.approx(
            full.run_history.get_metric_values(name), rel=1e-6
        )
    assert resumed.num_updates == full.num_updates == 3 * 8


# ----------------------------------------------------------------------------- run history
class LossRecorder(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.steps.append((batch_output["loss"].item(), batch_output["batch_size"]))


@pytest.mark.parametrize("accumulation", [1, 3])
def test_train_loss_epoch_is_the_batch_size_weighted_mean(accumulation):
    recorder = LossRecorder()
    # 30 samples in batches of 4: seven of 4 and one of 2, so weighting matters
    trainer = fit(make_trainer(callbacks=[recorder]), n_eval=10, gradient_accumulation_steps=accumulation)
    history = trainer.run_history.get_metric_values("train_loss_epoch")
    assert len(history) == 2 and len(recorder.steps) == 16
    for epoch in range(2):
        steps = recorder.steps[epoch * 8 : (epoch + 1) * 8]
        mean = sum(l * b for l, b in steps) / sum(b for _, b in steps)
        unweighted = sum(l for l, _ in steps) / len(steps)
        assert history[epoch] == pytest.approx(mean, rel=1e-6)
        assert abs(mean - unweighted) > 1e-4 * abs(mean)  # the test tells them apart
    # the eval loss, recomputed with the final model, is the last eval_loss_epoch
    x, y = data(10, seed=1).tensors
    m = trainer.get_model().eval()
    with torch.no_grad():
        expected = sum(nn.functional.mse_loss(m(x[i : i + 4]), y[i : i + 4]).item() * len(y[i : i + 4]) for i in range(0, 10, 4)) / 10
    assert trainer.run_history.get_latest_metric("eval_loss_epoch") == pytest.approx(expected, rel=1e-6)
    assert trainer.run_history.current_epoch == 3


def test_evaluate_resets_the_run_history():
    trainer = fit(make_trainer(), n_eval=8)
    assert trainer.run_history.get_metric_names() == {"train_loss_epoch", "eval_loss_epoch"}
    x, y = data(9, seed=2).tensors
    trainer.evaluate(TensorDataset(x, y), per_device_batch_size=4, dataloader_kwargs={"num_workers": 0})
    assert trainer.run_history.get_metric_names() == {"evaluation_loss"}
    m = trainer.get_model().eval()
    with torch.no_grad():
        expected = nn.functional.mse_loss(m(x), y).item()
    assert trainer.run_history.get_metric_values("evaluation_loss") == [pytest.approx(expected, rel=1e-6)]
    assert trainer.run_history.current_epoch == 1


# ----------------------------------------------------------------------------- placeholders
class RecordingScheduler:
    """A 'scheduler' that keeps the keyword arguments it was built with."""

    def __init__(self, optimizer, **kwargs):
        self.optimizer = optimizer
        self.kwargs = kwargs
        self.steps = 0

    def step(self):
        self.steps += 1


@pytest.mark.parametrize(
    "n_train, n_eval, bs, accumulation, max_steps, expected",
    [
        # 30 samples / 4 -> 8 batches; 10 eval / 4 -> 3 batches
        (30, 10, 4, 1, None, dict(epochs=2, updates=8, train_len=8, eval_len=3)),
        (30, 10, 4, 3, None, dict(epochs=2, updates=3, train_len=8, eval_len=3)),
        (30, 0, 4, 3, 7, dict(epochs=3, updates=3, train_len=8, eval_len=None)),
    ],
)
def test_placeholders_are_resolved_with_the_run_numbers(monkeypatch, n_train, n_eval, bs, accumulation, max_steps, expected):
    def no_eval(*args, **kwargs):
        raise AssertionError("placeholders must be resolved without eval")

    monkeypatch.setattr(builtins, "eval", no_eval)
    factory = functools.partial(
        RecordingScheduler,
        epochs=P.NUM_EPOCHS,
        updates=P.NUM_UPDATE_STEPS_PER_EPOCH,
        local_updates=P.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH,
        train_len=P.TRAIN_DATALOADER_LEN,
        doubled=P.NUM_EPOCHS * 2,
        shifted=P.TRAIN_DATALOADER_LEN + 1,
        constant=0.5,
        **({"eval_len": P.EVAL_DATALOADER_LEN} if n_eval else {}),
    )
    trainer = fit(
        make_trainer(), n=n_train, n_eval=n_eval, bs=bs, gradient_accumulation_steps=accumulation,
        max_num_train_steps=max_steps, create_scheduler_fn=factory,
    )
    kw = trainer.scheduler.kwargs
    assert kw["epochs"] == expected["epochs"] == trainer.run_config.num_epochs
    assert kw["updates"] == kw["local_updates"] == expected["updates"]
    assert kw["train_len"] == expected["train_len"]
    assert kw["doubled"] == 2 * expected["epochs"] and kw["shifted"] == expected["train_len"] + 1
    assert kw["constant"] == 0.5
    if n_eval:
        assert kw["eval_len"] == expected["eval_len"]
    assert trainer.scheduler.optimizer is trainer.optimizer
    # stepped once per optimizer update
    total = max_steps if max_steps is not None else expected["epochs"] * expected["updates"]
    assert trainer.scheduler.steps == total == trainer.num_updates


# ----------------------------------------------------------------------------- dataloaders
def test_default_dataloader_kwargs_match_the_original():
    trainer = make_trainer()
    train_kwargs = trainer.get_default_train_dl_kwargs(16)
    eval_kwargs = trainer.get_default_eval_dl_kwargs(16)
    workers = max(os.cpu_count() // torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count(), 1)
    common = {"pin_memory": torch.cuda.is_available(), "batch_size": 16, "num_workers": workers}
    assert {k: v for k, v in train_kwargs.items() if k != "worker_init_fn"} == {"shuffle": True, **common}
    assert {k: v for k, v in eval_kwargs.items() if k != "worker_init_fn"} == {"shuffle": False, **common}
    assert train_kwargs["worker_init_fn"] is fasttrain.utils.worker_init_fn
    pa_trainer = pytest.importorskip("pytorch_accelerated.trainer")
    m = model()
    original = pa_trainer.Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), callbacks=())
    for ours, theirs in ((train_kwargs, original.get_default_train_dl_kwargs(16)), (eval_kwargs, original.get_default_eval_dl_kwargs(16))):
        assert ours.keys() == theirs.keys()
        assert {k: v for k, v in ours.items() if k != "worker_init_fn"} == {k: v for k, v in theirs.items() if k != "worker_init_fn"}


def test_a_sampler_in_the_dataloader_kwargs_replaces_shuffle():
    order = list(reversed(range(12)))
    seen = []

    class Batches(TrainerCallback):
        def on_train_step_end(self, trainer, batch, **kwargs):
            seen.append(batch[0].clone())

    x, y = data(12).tensors
    trainer = make_trainer(callbacks=[Batches])
    trainer.train(TensorDataset(x, y), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs={"sampler": order, "num_workers": 0})
    assert torch.equal(torch.cat(seen), x[order])
    assert "shuffle" not in trainer.run_config.train_dl_kwargs


# ----------------------------------------------------------------------------- seeding
def test_seed_makes_runs_reproducible():
    shuffled = {"num_workers": 0, "shuffle": True}

    def run(seed):
        torch.manual_seed(1000 + seed)  # the global state differs before every run
        return weights(fit(make_trainer(model(dropout=0.3), seed=seed), dl=shuffled))

    a, b, c = run(7), run(7), run(8)
    assert state_equal(a, b)
    assert not state_equal(a, c)


IMPORT_CHECK = textwrap.dedent(
    """
    import random, numpy as np, torch
    random.seed(5); np.random.seed(5); torch.manual_seed(123)
    before = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    import {module}
    {extra}
    after = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    print(torch.initial_seed(), before[0] == after[0], before[1] == after[1], torch.equal(before[2], after[2]))
    """
)


@pytest.mark.parametrize("module, expected", [("fasttrain", "123 True True True"), ("pytorch_accelerated", "42 False False False")])
def test_import_does_not_seed(module, expected):
    """fasttrain leaves every random state alone on import, also when a script imports every
    public name of the API; the original (the control, which shows the check works) seeds
    everything with 42."""
    if module == "pytorch_accelerated":
        pytest.importorskip("pytorch_accelerated")
    # for fasttrain, a script importing every public name of the API (the migration promise)
    extra = (
        "\n".join(f"from {m} import {', '.join(names)}" for m, names in API_NAMES.items())
        if module == "fasttrain" else ""
    )
    script = IMPORT_CHECK.format(module=module, extra=extra)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected


def random_states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def assert_states_equal(a, b):
    assert a[0] == b[0]
    assert np.array_equal(a[1], b[1])
    assert torch.equal(a[2], b[2])


def test_trainer_construction_does_not_touch_the_random_state():
    m = model()
    random.seed(1), np.random.seed(1), torch.manual_seed(123)
    before = random_states()
    Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1))
    Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), seed=5)  # seeds in train()
    assert_states_equal(before, random_states())
    assert torch.initial_seed() == 123


def test_train_without_seed_draws_only_what_the_dataloaders_draw():
    """Without ``seed``, train() changes the global random state exactly as iterating the same
    dataloaders does (each iterator draws a base seed, a shuffling sampler a permutation seed)."""
    train_set, eval_set = data(20), data(8, seed=1)
    shuffled = {"num_workers": 0, "shuffle": True}
    m = model()
    random.seed(1), np.random.seed(1), torch.manual_seed(123)
    train_dl = DataLoader(train_set, batch_size=4, shuffle=True)
    eval_dl = DataLoader(eval_set, batch_size=4, shuffle=False)
    for _ in range(2):
        list(train_dl), list(eval_dl)
    expected = random_states()

    random.seed(1), np.random.seed(1), torch.manual_seed(123)
    trainer = Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), callbacks=())
    trainer.train(train_set, num_epochs=2, eval_dataset=eval_set, per_device_batch_size=4,
                  train_dataloader_kwargs=shuffled, eval_dataloader_kwargs={"num_workers": 0})
    assert_states_equal(expected, random_states())
    # and with a seed the state after the run is another one
    random.seed(1), np.random.seed(1), torch.manual_seed(123)
    seeded = Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), callbacks=(), seed=0)
    seeded.train(train_set, num_epochs=2, eval_dataset=eval_set, per_device_batch_size=4,
                 train_dataloader_kwargs=shuffled, eval_dataloader_kwargs={"num_workers": 0})
    assert not torch.equal(expected[2], torch.get_rng_state())


# ----------------------------------------------------------------------------- step limits
class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_train_step_end(self, trainer, **kwargs):
        self.steps += 1


@pytest.mark.parametrize(
    "max_steps, accumulation, epochs",
    [(1, 1, 1), (8, 1, 1), (17, 1, 3), (3, 3, 1), (4, 3, 2), (7, 2, 2)],
)
def test_max_num_train_steps_stops_at_exactly_that_many_updates(max_steps, accumulation, epochs):
    counter = StepCounter()
    trainer = make_trainer(callbacks=[counter])
    optimizer_steps = []
    inner = trainer.optimizer_step
    trainer.optimizer_step = lambda: (optimizer_steps.append(1), inner())
    # 30 samples / 4: 8 batches, ceil(8 / accumulation) updates per epoch
    fit(trainer, num_epochs=100, max_num_train_steps=max_steps, gradient_accumulation_steps=accumulation)
    per_epoch = math.ceil(8 / accumulation)
    assert trainer.num_updates == len(optimizer_steps) == max_steps
    assert trainer.run_config.num_epochs == epochs == math.ceil(max_steps / per_epoch)
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == epochs
    full_epochs, rest = divmod(max_steps, per_epoch)
    micro_steps = full_epochs * 8 + min(rest * accumulation, 8)
    assert counter.steps == micro_steps


# ----------------------------------------------------------------------------- migration
API_NAMES = {
    "fasttrain": ["Trainer", "TrainerPlaceholderValues", "notebook_launcher", "__version__"],
    "fasttrain.trainer": ["Trainer", "TrainerPlaceholderValues", "DEFAULT_CALLBACKS"],
    "fasttrain.callbacks": [
        "TrainerCallback", "CallbackHandler", "StopTrainingError", "CallbackMethodNotImplementedError",
        "get_default_callbacks", "MoveModulesToDeviceCallback", "TerminateOnNaNCallback",
        "PrintProgressCallback", "ProgressBarCallback", "LogMetricsCallback", "SaveBestModelCallback",
        "EarlyStoppingCallback", "ModelEmaCallback", "ConvertSyncBatchNormCallback",
        "StepBasedEvaluationCallback", "LimitEvalStepsCallback", "LimitBatchesCallback",
        "SaveTrainingStateCallback", "WSDCheckpointCallback",
    ],
    "fasttrain.tracking": ["RunHistory", "InMemoryRunHistory", "LossTracker"],
    "fasttrain.run_config": ["TrainerRunConfig"],
    "fasttrain.finetuning": ["ModelFreezer"],
    "fasttrain.schedulers": [
        "CosineLrScheduler", "WSDLrScheduler", "SchedulerBase", "StatefulSchedulerBase", "estimate_checkpoint_steps",
    ],
    "fasttrain.utils": [
        "LimitBatches", "DataLoaderSlice", "local_process_zero_only", "local_process_zero_first",
        "world_process_zero_only", "ModelEma", "worker_init_fn", "remove_padding", "LIMIT_BATCHES_ENV_VAR",
    ],
}


@pytest.mark.parametrize("module", sorted(API_NAMES))
def test_every_public_name_of_the_api_is_in_fasttrain(module):
    mod = importlib.import_module(module)
    assert [name for name in API_NAMES[module] if not hasattr(mod, name)] == []


@pytest.mark.parametrize("module", ["", ".trainer", ".callbacks", ".tracking", ".run_config", ".finetuning", ".schedulers", ".utils"])
def test_names_the_original_defines_exist_in_fasttrain(module):
    original = pytest.importorskip("pytorch_accelerated" + module)
    ours = importlib.import_module("fasttrain" + module)
    defined = [
        name for name, value in vars(original).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("pytorch_accelerated" + module)
        and (inspect.isclass(value) or inspect.isfunction(value))
    ]
    assert defined  # the check looks at something
    assert [n for n in defined if not hasattr(ours, n)] == []


def _params(func):
    return [(p.name, p.default) for p in inspect.signature(func).parameters.values() if p.kind is not p.VAR_KEYWORD]


def test_original_signatures_are_a_prefix_of_fasttrain_signatures():
    pa = pytest.importorskip("pytorch_accelerated.trainer")
    pa_callbacks = importlib.import_module("pytorch_accelerated.callbacks")
    from fasttrain import callbacks

    pairs = [(getattr(pa.Trainer, name), getattr(Trainer, name)) for name in (
        "__init__", "train", "evaluate", "save_checkpoint", "load_checkpoint", "save_training_state",
        "load_training_state", "gather", "get_model", "create_train_dataloader", "create_eval_dataloader",
        "get_default_train_dl_kwargs", "get_default_eval_dl_kwargs",
    )]
    pairs += [(getattr(pa_callbacks, name).__init__, getattr(callbacks, name).__init__) for name in (
        "SaveBestModelCallback", "EarlyStoppingCallback", "ModelEmaCallback", "StepBasedEvaluationCallback",
        "LimitEvalStepsCallback", "LimitBatchesCallback", "SaveTrainingStateCallback", "WSDCheckpointCallback",
    )]
    for theirs, ours in pairs:
        p_theirs, p_ours = _params(theirs), _params(ours)
        where = theirs.__qualname__
        assert [n for n, _ in p_ours[: len(p_theirs)]] == [n for n, _ in p_theirs], where
        for (name, d_theirs), (_, d_ours) in zip(p_theirs, p_ours):
            if isinstance(d_theirs, tuple):  # DEFAULT_CALLBACKS: the library's own classes
                assert [c.__name__ for c in d_theirs] == [c.__name__ for c in d_ours], (where, name)
            elif inspect.isclass(d_theirs):  # ModelEma
                assert d_theirs.__name__ == d_ours.__name__, (where, name)
            elif hasattr(d_theirs, "name") and hasattr(d_theirs, "value"):  # placeholders
                assert d_theirs.name == d_ours.name, (where, name)
            else:
                assert d_theirs == d_ours, (where, name)

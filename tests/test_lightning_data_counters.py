"""Skipped batches (``training_step`` returning None, a None batch) and several loaders (combined
training loaders, evaluation over a CombinedLoader or a list of loaders) under the loop objects'
counters, Lightning's progress bars, its profiler and the engine choice: recorded at every hook
under lightning.Trainer and fasttrain.lightning.Trainer and compared."""

import collections
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import DATA, QUIET, VAL, Classifier, assert_same_weights, loader  # noqa: E402
from side_by_side import run_both  # noqa: E402
from test_engine_graph_logic import HostGraphEngine, host_graphs  # noqa: E402,F401
from test_lightning_args_profiler import Recording  # noqa: E402
from test_lightning_args_progress_bars import RecordingTQDM  # noqa: E402
from test_lightning_loop_objects import OUTER_HOOKS, STEP_HOOKS, _Recorder, _assert_same_records, _counters  # noqa: E402


def _data_counters(trainer) -> dict:
    """The loop counters, and what the loops and the progress bars count of the loaders."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    return {
        **_counters(trainer),
        "val_max_batches": (list(val_loop._max_batches), list(val_loop.max_batches)),
        "sanity_batches": list(trainer.num_sanity_val_batches),
    }


def _record(module_factory, make_train, make_val=None, hooks=OUTER_HOOKS, **trainer_kwargs):
    modules = {}

    def action(trainer):
        recorder = _Recorder(hooks, read=_data_counters)
        trainer.callbacks.insert(0, recorder)
        module = modules[type(trainer).__module__.split(".")[0]] = module_factory()
        trainer.fit(module, make_train(), make_val() if make_val else None)
        return recorder.seen

    out = run_both(action, **{"max_epochs": 2, **trainer_kwargs})
    for name, result in out.items():
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
    _assert_same_records(out["lightning"], out["fasttrain"])
    return out, modules


class SkipsSteps(Classifier):
    """``training_step`` returns None at batches 1, 2 and 5 of each epoch; a scheduler per step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in (1, 2, 5):
            return None
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), "interval": "step"}]


class SkipsInItsClosure(SkipsSteps):
    """Steps through its own ``optimizer_step``, whose closure meets the None."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("module_cls", [SkipsSteps, SkipsInItsClosure])
@pytest.mark.parametrize("hooks", ["outer", "all"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_none_steps_advance_the_loop_counters_like_lightning(module_cls, hooks, accumulate):
    # "all" overrides the callbacks' step hooks: the zero-grad hooks then run in Lightning's place
    names = OUTER_HOOKS + (STEP_HOOKS if hooks == "all" else ())
    out, modules = _record(module_cls, lambda: loader(DATA, batch_size=8), lambda: loader(VAL, batch_size=5),
                           hooks=names, accumulate_grad_batches=accumulate, val_check_interval=0.5)
    last = out["fasttrain"][-1][1]
    assert last["global_step"][0] == 12 // accumulate  # the skipped steps count
    assert last["batch_progress"]["total"]["started"] == 12
    assert_same_weights(modules["lightning"], modules["fasttrain"])


def _none_batches(positions, per_epoch=6):
    counter = {"n": 0}

    def collate(items):
        index = counter["n"] % per_epoch
        counter["n"] += 1
        return None if index in positions else torch.utils.data.default_collate(items)

    return collate


@pytest.mark.parametrize("accumulate, positions", [(1, (1, 4)), (2, (0, 3)), (3, (1, 5))])
def test_none_batches_advance_the_loop_counters_like_lightning(accumulate, positions):
    # a None batch opening a window too: it leaves the last update's gradients to the window's
    # update, as Lightning's closure does, so the weights agree as well as the counters
    out, modules = _record(Classifier, lambda: DataLoader(DATA, batch_size=8, collate_fn=_none_batches(positions)),
                     lambda: loader(VAL, batch_size=5), hooks=OUTER_HOOKS + STEP_HOOKS,
                     accumulate_grad_batches=accumulate)
    batches = out["fasttrain"][-1][1]["batch_progress"]["total"]
    # a None batch is ready, processed and completed, never started
    assert (batches["ready"], batches["started"], batches["completed"]) == (12, 12 - 2 * len(positions), 12)
    assert_same_weights(modules["lightning"], modules["fasttrain"])


class Multi(Classifier):
    """Trains and validates on every loader batch of a combined batch."""

    def training_step(self, batch, batch_idx):
        loss = sum(F.cross_entropy(self(x), y) for x, y in _pairs(batch))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", sum(F.cross_entropy(self(x), y) for x, y in _pairs(batch)))


def _pairs(batch):
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch[0], torch.Tensor):
        return [batch]
    return [pair for value in batch if value is not None for pair in _pairs(value)]


def _two(batch_sizes=(8, 12)):
    return {"a": loader(DATA, batch_size=batch_sizes[0]), "b": loader(VAL, batch_size=batch_sizes[1])}


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
@pytest.mark.parametrize("val", ["combined", "list"])
def test_several_loaders_advance_the_loop_counters_like_lightning(mode, val):
    def make_val():
        loaders = [loader(VAL, batch_size=3), loader(VAL, batch_size=8)]
        return CombinedLoader(loaders, "max_size_cycle") if val == "combined" else loaders

    out, modules = _record(Multi, lambda: CombinedLoader(_two(), mode), make_val,
                           hooks=OUTER_HOOKS + STEP_HOOKS, accumulate_grad_batches=2,
                           num_sanity_val_steps=3, limit_val_batches=5)
    sanity = [record for name, record in out["fasttrain"] if name == "on_validation_start"][0]
    assert sanity["stage"] == "sanity_check" and sanity["sanity_batches"] == [3, 3]  # per loader, also combined
    assert sanity["val_max_batches"] == ([5, 3], [3, 3])
    assert_same_weights(modules["lightning"], modules["fasttrain"])


def _bar_run(trainer_cls, bar):
    torch.manual_seed(0)
    trainer = trainer_cls(**{**QUIET, "enable_progress_bar": True, "max_epochs": 2, "callbacks": [bar]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Multi(), CombinedLoader(_two(), "max_size_cycle"),
                    [loader(VAL, batch_size=3), loader(VAL, batch_size=8)])
        trainer.validate(Multi(), CombinedLoader([loader(VAL, batch_size=6), loader(VAL, batch_size=4)], "min_size"),
                         verbose=False)
    return bar.seen


def test_progress_bars_over_several_loaders_like_lightning():
    theirs, ours = (_bar_run(cls, RecordingTQDM(refresh_rate=1)) for cls in (L.Trainer, Trainer))
    assert ours == theirs
    assert ("train_batch_end", (6, 6, "Epoch 1")) in ours


def _profiled(trainer_cls, module_cls, make_train):
    torch.manual_seed(0)
    profiler = Recording()
    trainer = trainer_cls(**{**QUIET, "max_epochs": 2, "profiler": profiler, "accumulate_grad_batches": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module_cls(), make_train())
    return [event for event in profiler.events if "configure_callbacks" not in event[1]]


@pytest.mark.parametrize("case", ["none steps", "none batches", "several loaders"])
def test_the_profiler_times_skipped_batches_and_several_loaders_like_lightning(case):
    module_cls, make_train = {
        "none steps": (SkipsSteps, lambda: loader(DATA, batch_size=8)),
        "none batches": (Classifier, lambda: DataLoader(DATA, batch_size=8, collate_fn=_none_batches((1, 4)))),
        "several loaders": (Multi, lambda: _two()),
    }[case]
    theirs, ours = (_profiled(cls, module_cls, make_train) for cls in (L.Trainer, Trainer))
    starts = [collections.Counter(a for kind, a in events if kind == "start") for events in (theirs, ours)]
    assert starts[1] == starts[0]
    # the skipped batches' optimization is timed as one run_training_batch each, as in Lightning
    assert starts[1]["run_training_batch"] == (8 if case == "none batches" else 12)


@pytest.mark.parametrize("engine", ["cudagraph", "auto"])
def test_a_step_that_can_return_none_is_never_captured_in_a_cuda_graph(engine, host_graphs, monkeypatch):
    # "auto" picks the graphed engine on CUDA: the stand-in's device decides it here
    monkeypatch.setattr("fasttrain.lightning.fit.auto_engine_name", lambda device: "cudagraph")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        ours = SkipsSteps()
        trainer = Trainer(**{**QUIET, "max_epochs": 2, "engine": engine})
        trainer.fit(ours, loader(DATA, batch_size=8))
    moved = [str(w.message) for w in caught if "training_step can return None" in str(w.message)]
    assert len(moved) == 1 and "'cudagraph'" in moved[0]
    assert trainer.engine == "eager" and HostGraphEngine.graphs == []
    torch.manual_seed(0)
    reference = SkipsSteps()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(**{**QUIET, "max_epochs": 2}).fit(reference, loader(DATA, batch_size=8))
    assert_same_weights(reference, ours)

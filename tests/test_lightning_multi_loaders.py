"""Several training loaders (a dict or list of loaders, Lightning's ``CombinedLoader`` in each of
its modes, from ``fit`` or a DataModule), evaluation over a ``CombinedLoader`` or a dict of
loaders, and loaders whose ``len()`` raises: fasttrain.lightning.Trainer gives each step the
batches, indices and epoch lengths lightning.Trainer gives, and trains to the same weights."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_modules import Classifier, assert_same_results, assert_same_weights  # noqa: E402
from side_by_side import run_both  # noqa: E402


def _samples(source: int, n: int) -> TensorDataset:
    """``n`` samples whose first feature numbers them and second names the loader ``source``."""
    g = torch.Generator().manual_seed(source)
    x = torch.randn(n, 6, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float)
    x[:, 1] = source
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def _loader(source: int, n: int, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    return DataLoader(_samples(source, n), batch_size=batch_size, shuffle=shuffle)


def _describe(batch):
    """What a batch holds, as comparable plain values: per loader batch, (loader, first sample, size)."""
    if batch is None:
        return None
    if isinstance(batch, dict):
        return {key: _describe(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        x = batch[0]
        return (int(x[0, 1]), int(x[0, 0]), len(x))
    return [_describe(value) for value in batch]


def _pairs(batch):
    if batch is None:
        return []
    if isinstance(batch, dict):
        return [pair for value in batch.values() for pair in _pairs(value)]
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return [batch]
    return [pair for value in batch for pair in _pairs(value)]


class Multi(Classifier):
    """Trains on every loader batch of a combined batch; records what each hook is given."""

    def __init__(self):
        super().__init__()
        self.events = []

    def training_step(self, batch, batch_idx, *rest):
        self.events.append(("step", batch_idx, _describe(batch), rest))
        loss = sum(F.cross_entropy(self(x), y) for x, y in _pairs(batch))
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx, *rest):
        self.events.append(("val", batch_idx, _describe(batch), rest))
        loss = sum(F.cross_entropy(self(x), y) for x, y in _pairs(batch))
        self.log("val_loss", loss)

    test_step = validation_step

    def on_train_batch_start(self, batch, batch_idx, *rest):
        self.events.append(("batch_start", batch_idx, rest, self.trainer.is_last_batch))

    def on_train_batch_end(self, outputs, batch, batch_idx, *rest):
        self.events.append(("batch_end", batch_idx, rest))

    def on_train_epoch_start(self):
        self.events.append(("epoch", self.current_epoch, self.trainer.num_training_batches))

    def configure_optimizers(self):
        self.events.append(("estimate", self.trainer.estimated_stepping_batches, self.trainer.num_training_batches))
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_both(make_data, val=None, **trainer_kwargs):
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = Multi()
        trainer.fit(module, make_data(), val() if val else None)
        return module.events, trainer.global_step, trainer.num_training_batches

    trainer_kwargs.setdefault("max_epochs", 2)
    out = run_both(action, **trainer_kwargs)
    assert not isinstance(out["lightning"], BaseException), out["lightning"]
    assert out["fasttrain"] == out["lightning"]
    assert_same_weights(modules["lightning"], modules["fasttrain"])
    return out["lightning"]


def _a_b():
    return {"a": _loader(0, 20), "b": _loader(1, 12)}  # 5 and 3 batches


@pytest.mark.parametrize(
    "make_data",
    [
        _a_b,
        lambda: [_loader(0, 20), _loader(1, 12)],
        lambda: (_loader(0, 20), _loader(1, 12), _loader(2, 6, batch_size=3)),
        lambda: {"a": _loader(0, 20), "rest": [_loader(1, 12), _loader(2, 8)]},
    ],
    ids=["dict", "list", "tuple", "nested"],
)
def test_a_collection_of_training_loaders_cycles_the_shorter_ones_like_lightning(make_data):
    events, global_step, batches = _fit_both(make_data)
    assert batches == 5 and global_step == 10  # max_size_cycle: the longest loader's length


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_a_combined_loader_trains_in_its_mode_like_lightning(mode):
    events, global_step, batches = _fit_both(lambda: CombinedLoader(_a_b(), mode))
    assert batches == {"max_size_cycle": 5, "min_size": 3, "max_size": 5}[mode]
    if mode == "max_size":  # the shorter loader's place holds None once it is exhausted
        assert ("step", 4, {"a": (0, 16, 4), "b": None}, ()) in events


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
@pytest.mark.parametrize("limit", [2, 4, 0.5])
def test_limits_apply_to_each_loader_of_a_combined_loader_like_lightning(mode, limit):
    _fit_both(lambda: CombinedLoader(_a_b(), mode), limit_train_batches=limit)


def test_a_sequential_combined_loader_is_lightnings_error_in_a_fit():
    def action(trainer):
        trainer.fit(Multi(), CombinedLoader(_a_b(), "sequential"))

    out = run_both(action, max_epochs=1)
    assert isinstance(out["lightning"], ValueError)
    assert type(out["fasttrain"]) is ValueError and str(out["fasttrain"]) == str(out["lightning"])
    assert "does not support the `CombinedLoader(mode=\"sequential\")` mode" in str(out["fasttrain"])


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
def test_several_loaders_with_accumulation_and_shuffling_like_lightning(mode):
    def data():
        return CombinedLoader({"a": _loader(0, 20, shuffle=True), "b": _loader(1, 12, shuffle=True)}, mode)

    _fit_both(data, accumulate_grad_batches=2, max_epochs=3)


class FromDataModule(L.LightningDataModule):
    def train_dataloader(self):
        return CombinedLoader(_a_b(), "min_size")

    def val_dataloader(self):
        return [_loader(3, 8), _loader(4, 4)]


def test_a_datamodule_returning_a_combined_loader_trains_like_lightning():
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = Multi()
        trainer.fit(module, datamodule=FromDataModule())
        return module.events, trainer.global_step, {k: float(v) for k, v in trainer.callback_metrics.items()}

    out = run_both(action, max_epochs=2)
    assert out["fasttrain"] == out["lightning"]
    assert_same_weights(modules["lightning"], modules["fasttrain"])


def test_validation_over_several_loaders_next_to_several_training_loaders_like_lightning():
    _fit_both(_a_b, val=lambda: {"x": _loader(3, 8), "y": _loader(4, 4)})


# ---------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize(
    "make_data",
    [
        lambda: {"x": _loader(3, 8), "y": _loader(4, 4)},
        lambda: CombinedLoader({"x": _loader(3, 8), "y": _loader(4, 4)}, "sequential"),
        lambda: CombinedLoader({"x": _loader(3, 8), "y": _loader(4, 4)}, "max_size_cycle"),
        lambda: CombinedLoader([_loader(3, 8), _loader(4, 12)], "min_size"),
    ],
    ids=["dict", "sequential", "max_size_cycle", "min_size"],
)
@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_over_a_combined_loader_like_lightning(make_data, stage):
    def action(trainer):
        module = Multi()
        results = getattr(trainer, stage)(module, make_data(), verbose=False)
        counts = trainer.num_val_batches if stage == "validate" else trainer.num_test_batches
        return module.events, results, list(counts)

    out = run_both(action, limit_val_batches=3)
    assert not isinstance(out["lightning"], BaseException), out["lightning"]
    reference, ours = out["lightning"], out["fasttrain"]
    assert ours[0] == reference[0] and ours[2] == reference[2]
    assert_same_results(reference[1], ours[1])


def test_validation_in_a_fit_over_a_combined_loader_like_lightning():
    _fit_both(_a_b, val=lambda: CombinedLoader({"x": _loader(3, 8), "y": _loader(4, 12)}, "max_size_cycle"))


# ---------------------------------------------------------------------------------- lengths
class NoLength(DataLoader):
    """A loader whose ``len()`` raises NotImplementedError (a sampler of unknown length does)."""

    def __len__(self):
        raise NotImplementedError("unknown length")


def test_a_loader_whose_len_raises_trains_as_unsized_like_lightning():
    _fit_both(lambda: NoLength(_samples(0, 20), batch_size=4), max_steps=7)


def test_a_loader_whose_len_raises_inside_a_combined_loader_like_lightning():
    _fit_both(lambda: {"a": NoLength(_samples(0, 20), batch_size=4), "b": _loader(1, 12)}, max_steps=7)


# ---------------------------------------------------------------------------------- processes
@pytest.mark.multiprocess
def test_several_loaders_in_two_processes_match_one_lightning_process(tmp_path):
    """Each loader combined is sharded on its own: two processes of batches of 4 train as one
    Lightning process of batches of 8, cycling the shorter loader at the same steps."""
    import time

    from launching import finish, launch_env, start, torchrun_two

    here = Path(__file__).resolve().parent / "lightning"
    launch = start(torchrun_two(here / "combined_ddp_worker.py", tmp_path), tmp_path / "launch.log",
                   launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, time.monotonic() + 300, "the two processes", retry_s=300)
    from combined_ddp_worker import TwoSources, train_data, val_data

    torch.manual_seed(0)
    reference = TwoSources()
    trainer = L.Trainer(max_epochs=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
                        enable_checkpointing=False)
    trainer.fit(reference, train_data(8), val_data(8))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["num_training_batches"] == trainer.num_training_batches == 4
        assert result["global_step"] == trainer.global_step == 8
        assert result["batches"] == reference.batches
        ours = TwoSources()
        ours.load_state_dict(result["state_dict"])
        assert_same_weights(reference, ours, atol=1e-6)
        assert result["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]), abs=1e-6)


@pytest.mark.parametrize("flags", [dict(overfit_batches=2), dict(fast_dev_run=3), dict(reload_dataloaders_every_n_epochs=1)],
                         ids=["overfit_batches", "fast_dev_run", "reload"])
def test_several_shuffled_loaders_under_the_debugging_flags_like_lightning(flags):
    def data():
        return {"a": _loader(0, 20, shuffle=True), "b": _loader(1, 12, shuffle=True)}

    _fit_both(data, max_epochs=3, **flags)


@pytest.mark.parametrize("limit", [1.0, 3])
def test_evaluation_over_a_loader_whose_len_raises_like_lightning(limit):
    def action(trainer):
        module = Multi()
        results = trainer.validate(module, [NoLength(_samples(3, 20), batch_size=4), _loader(4, 8)], verbose=False)
        return module.events, results, list(trainer.num_val_batches)

    out = run_both(action, limit_val_batches=limit)
    assert not isinstance(out["lightning"], BaseException), out["lightning"]
    reference, ours = out["lightning"], out["fasttrain"]
    assert ours[0] == reference[0] and ours[2] == reference[2]
    assert_same_results(reference[1], ours[1])

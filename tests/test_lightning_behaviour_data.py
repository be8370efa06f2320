"""Seeded data order: fasttrain.lightning.Trainer draws from the random state and from a
loader's generator in lightning.Trainer's pattern, so a seeded fit sees the same batches in
every epoch, with or without a sanity check, and after a mid-epoch resume (a loader that keeps
its position continuing from it, as in Lightning)."""

import os
import warnings
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_modules import QUIET, Classifier, assert_same_weights  # noqa: E402
from side_by_side import run_both, trainers  # noqa: E402

#: 16 samples whose features name them, so the batches say which samples they hold
INDEXED = TensorDataset(torch.arange(16.0).unsqueeze(1).repeat(1, 6), torch.arange(16) % 3)


class Seen(Classifier):
    """Records the samples of every training batch; its val_dataloader draws from the global
    random state, as one that builds random data does."""

    def __init__(self, val_draws=False):
        super().__init__()
        self.seen = []
        self.val_draws = val_draws

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, batch[0][:, 0].int().tolist()))
        return super().training_step(batch, batch_idx)

    def val_dataloader(self):
        x = torch.randn(8, 6) if self.val_draws else torch.zeros(8, 6)
        return DataLoader(TensorDataset(x, torch.zeros(8, dtype=torch.long)), batch_size=4)


def _shuffled(generator_seed):
    generator = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    return DataLoader(INDEXED, batch_size=4, shuffle=True, generator=generator)


@pytest.mark.parametrize("generator_seed", [42, None], ids=["loader_generator", "global_generator"])
@pytest.mark.parametrize("limit", [1.0, 3])
def test_the_shuffled_order_equals_lightnings_in_every_epoch(generator_seed, limit):
    def action(trainer):
        module = Seen()
        trainer.fit(module, _shuffled(generator_seed))
        return module

    out = run_both(action, max_epochs=3, limit_train_batches=limit, num_sanity_val_steps=0, limit_val_batches=0)
    reference, ours = out["lightning"], out["fasttrain"]
    assert len(reference.seen) == 3 * (4 if limit == 1.0 else 3)
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)


@pytest.mark.parametrize("sanity", [0, 2])
def test_a_val_dataloader_that_draws_random_numbers_leaves_the_order_as_lightning(sanity):
    def action(trainer):
        module = Seen(val_draws=True)
        trainer.fit(module, _shuffled(None))
        return module

    out = run_both(action, max_epochs=2, num_sanity_val_steps=sanity)
    reference, ours = out["lightning"], out["fasttrain"]
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)


def _resumed_both(path, batches):
    """Lightning and fasttrain.lightning fitting a fresh module for 3 epochs from the checkpoint at
    ``path``, over the shuffled loader of ``batches`` batches; the two modules."""

    def action(trainer):
        module = Seen()
        trainer.fit(module, _shuffled(batches), ckpt_path=path)
        return module

    out = run_both(action, max_epochs=3)
    return out["lightning"], out["fasttrain"]


def test_a_mid_epoch_resume_sees_lightnings_batches(tmp_path):
    kwargs = dict(QUIET, enable_checkpointing=True)
    torch.manual_seed(0)
    writer = trainers()[0][1](max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2,
                                                                       save_top_k=-1, filename="{step}")],
                              **{k: v for k, v in kwargs.items() if k != "enable_checkpointing"})
    writer.fit(Seen(), _shuffled(7))
    reference, ours = _resumed_both(os.path.join(tmp_path, "step=2.ckpt"), 7)
    # Lightning counts on from batch 2 on a fresh iterator of the loader
    assert [s[:2] for s in reference.seen[:2]] == [(0, 2), (0, 3)]
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)


def test_a_resume_after_an_epoch_sees_lightnings_batches(tmp_path):
    torch.manual_seed(0)
    writer = trainers()[0][1](max_epochs=1, **QUIET)
    writer.fit(Seen(), _shuffled(5))
    path = tmp_path / "epoch.ckpt"
    writer.save_checkpoint(path)
    reference, ours = _resumed_both(path, 5)
    assert [s[:2] for s in reference.seen[:1]] == [(1, 0)] and len(reference.seen) == 8
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)


class SeenInValidation(Seen):
    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", self.current_epoch, batch_idx, batch[0][:, 0].int().tolist()))


@pytest.mark.parametrize("limit", [1.0, 2])
def test_a_shuffled_validation_loader_sees_lightnings_batches(limit):
    def action(trainer):
        module = SeenInValidation()
        trainer.fit(module, _shuffled(3), DataLoader(INDEXED, batch_size=4, shuffle=True,
                                                     generator=torch.Generator().manual_seed(9)))
        return module

    out = run_both(action, max_epochs=3, limit_val_batches=limit, num_sanity_val_steps=1)
    reference, ours = out["lightning"], out["fasttrain"]
    assert sum(1 for s in reference.seen if s[0] == "val") == 1 + 3 * (4 if limit == 1.0 else 2)
    assert ours.seen == reference.seen


class ResumableLoader(DataLoader):
    """A loader that keeps its position in the epoch (``state_dict``/``load_state_dict``, as
    torchdata's StatefulDataLoader does): after a load, its next epoch skips the batches given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given = self.skip = 0

    def __iter__(self):
        skip, self.skip, self.given = self.skip, 0, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.given = index + 1
                yield batch

    def state_dict(self):
        return {"given": self.given}

    def load_state_dict(self, state):
        self.skip = state["given"]


def _resume_mid_epoch(tmp_path, trainer_cls, make_loader):
    """A fit of 2 epochs of 4 batches by ``trainer_cls`` writing a checkpoint every 3 steps, then
    a fresh module fitted from the one at step 3; the checkpoint's fit-loop state, the resumed
    module and the warnings of the resumed fit."""
    directory = tmp_path / trainer_cls.__module__.split(".")[0]
    every = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    kwargs = {k: v for k, v in QUIET.items() if k != "enable_checkpointing"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_cls(max_epochs=2, callbacks=[every], **kwargs).fit(Seen(), make_loader())
    path = directory / "step=3.ckpt"
    saved = torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]
    torch.manual_seed(1)
    module = Seen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_cls(max_epochs=2, **QUIET).fit(module, make_loader(), ckpt_path=path)
    return saved, module, [str(w.message) for w in caught if "resuming from a checkpoint" in str(w.message)]


def test_a_resumable_loader_continues_a_mid_epoch_resume_like_lightning(tmp_path):
    # each trainer writes the loader's state into its checkpoint and loads it when it resumes:
    # the resumed epoch takes the loader's fourth batch, not its first
    (lightning_cls, fasttrain_cls) = (cls for _, cls in trainers())
    reference_state, reference, reference_warnings = _resume_mid_epoch(
        tmp_path, lightning_cls, lambda: ResumableLoader(INDEXED, batch_size=4))
    state, ours, our_warnings = _resume_mid_epoch(tmp_path, fasttrain_cls, lambda: ResumableLoader(INDEXED, batch_size=4))
    assert reference_state == {"combined_loader": [{"given": 3}]}
    assert state == reference_state
    assert reference.seen[0] == (0, 3, [12, 13, 14, 15])
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)
    assert reference_warnings == our_warnings == []


def test_a_mid_epoch_resume_of_a_loader_without_state_warns_like_lightning(tmp_path):
    (lightning_cls, fasttrain_cls) = (cls for _, cls in trainers())
    reference_state, reference, reference_warnings = _resume_mid_epoch(
        tmp_path, lightning_cls, lambda: DataLoader(INDEXED, batch_size=4))
    state, ours, our_warnings = _resume_mid_epoch(tmp_path, fasttrain_cls, lambda: DataLoader(INDEXED, batch_size=4))
    assert reference_state == state == {}
    assert len(reference_warnings) == 1 and "your dataloader is not resumable" in reference_warnings[0]
    assert our_warnings == reference_warnings
    assert ours.seen == reference.seen
    assert_same_weights(reference, ours)

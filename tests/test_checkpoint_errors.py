"""Every failure to read a checkpoint or training state is a CheckpointError naming the file."""

import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.checkpointing import CheckpointError, verify_training_state


def _trainer(width=None):
    torch.manual_seed(0)
    # ~50 kB with its optimizer state: the size at which torch's zip reader fails on most cut
    # points with OSError rather than RuntimeError
    m = nn.Linear(3, 1) if width is None else nn.Sequential(nn.Linear(3, width), nn.Linear(width, width), nn.Linear(width, 1))
    return Trainer(m, nn.MSELoss(), torch.optim.AdamW(m.parameters(), lr=0.01), callbacks=())


def _data():
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


TRAIN = dict(num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0})


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
    root = tmp_path_factory.mktemp("states")
    trainer = _trainer()
    trainer.train(_data(), max_num_train_steps=5, **TRAIN)
    trainer.save_training_state(root / "state")
    return root / "state"


def _killed_before_last_file(state, target):
    """What a save killed while writing its last per-process file leaves: everything but the
    RNG file and the manifest."""
    shutil.copytree(state, target)
    (target / "manifest.json").unlink()
    (target / "rng_state_0.pt").unlink()
    return target


@pytest.mark.parametrize("name", [".state.staging", "state_copy"])
def test_unfinished_state_is_refused(saved_state, tmp_path, name):
    partial = _killed_before_last_file(saved_state, tmp_path / name)
    with pytest.raises(CheckpointError, match="no manifest.json, so the save that wrote it did not finish"):
        verify_training_state(partial)
    trainer = _trainer()
    with pytest.raises(CheckpointError, match=str(partial.name).replace(".", r"\.")):
        trainer.train(_data(), resume_from=str(partial), **TRAIN)
    assert trainer.num_updates == 0  # nothing trained from it


def _as_version_1(state, target):
    shutil.copytree(state, target)
    (target / "manifest.json").unlink()
    metadata = torch.load(target / "trainer_state.pt", weights_only=True)
    metadata["fasttrain_state_version"] = 1
    torch.save(metadata, target / "trainer_state.pt")
    return target


def test_complete_version_1_state_is_accepted(saved_state, tmp_path):
    old = _as_version_1(saved_state, tmp_path / "v1")
    assert verify_training_state(old) == {"files": {}}
    (old / "rng_state_0.pt").unlink()
    with pytest.raises(CheckpointError, match="version 1 training state .* incomplete: rng_state_0.pt missing"):
        verify_training_state(old)


def test_truncated_checkpoint_always_raises_checkpoint_error(tmp_path):
    trainer = _trainer(width=64)
    trainer.train(_data(), **TRAIN)
    path = tmp_path / "model.pt"
    trainer.save_checkpoint(path)
    data = path.read_bytes()
    cut_path = tmp_path / "cut.pt"
    cuts = sorted({*range(0, len(data), max(1, len(data) // 150)), *range(len(data) - 64, len(data))})
    assert len(cuts) > 150
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as exc:
            trainer.load_checkpoint(cut_path)
        assert str(cut_path) in str(exc.value), (cut, exc.value)


def test_missing_checkpoint_is_both_errors(tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        _trainer().load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError):
        _trainer().load_checkpoint(tmp_path / "nope.pt")

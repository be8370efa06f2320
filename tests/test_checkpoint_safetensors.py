"""A checkpoint path ending in .safetensors holds the model's weights, and nothing that could
not be written there is left out silently."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.checkpointing import CheckpointError, CheckpointNotFoundError

safetensors_torch = pytest.importorskip("safetensors.torch")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight  # tied: two names, one tensor

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.embed(x))))


def _trainer(seed):
    torch.manual_seed(seed)
    model = Tied()
    return Trainer(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.05), callbacks=())


def _train(trainer):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (16,), generator=g)
    trainer.train(TensorDataset(x, (x + 1) % 5), num_epochs=1, per_device_batch_size=4)


def test_weights_round_trip_exactly_through_safetensors(tmp_path):
    trainer = _trainer(0)
    _train(trainer)
    path = tmp_path / "model.safetensors"
    trainer.save_checkpoint(path, save_optimizer=False, save_scheduler=False)
    expected = trainer.get_model().state_dict()
    on_disk = safetensors_torch.load_file(path)  # a plain safetensors file, no pickle
    assert on_disk.keys() == expected.keys()
    other = _trainer(1)
    loaded = other.load_checkpoint(path)
    assert loaded.keys() == {"model_state_dict"}
    for name, value in expected.items():
        assert torch.equal(other.model.state_dict()[name], value), name
    # the tie survives loading into a model that ties the same weights
    assert other.model.out.weight is other.model.embed.weight


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({}, "save_optimizer=False"),
        ({"save_optimizer": False, "checkpoint_kwargs": {"epoch": 3}}, "checkpoint_kwargs ['epoch']"),
    ],
)
def test_what_safetensors_cannot_hold_is_an_error_not_a_silent_omission(tmp_path, kwargs, named):
    trainer = _trainer(0)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        trainer.save_checkpoint(tmp_path / "model.safetensors", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_or_missing_safetensors_file_is_a_checkpoint_error(tmp_path):
    trainer = _trainer(0)
    path = tmp_path / "model.safetensors"
    trainer.save_checkpoint(path, save_optimizer=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable .safetensors checkpoint"):
        trainer.load_checkpoint(path)
    with pytest.raises(CheckpointNotFoundError):
        trainer.load_checkpoint(tmp_path / "absent.safetensors")

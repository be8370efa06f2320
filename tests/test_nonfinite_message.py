"""What a run stopped by a non-finite loss tells its user: where, the state of the weights, what to do."""

import io
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from fasttrain import Trainer
from fasttrain.callbacks import ProgressBarCallback, SaveTrainingStateCallback, TerminateOnNaNCallback
from fasttrain.metrics import FlushedMetrics
from fasttrain.nonfinite import first_nonfinite_update


class PoisonedAt(Dataset):
    """Finite regression samples, except sample ``bad``, whose input is inf."""

    def __init__(self, n, bad):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        if bad is not None:
            self.x[bad] = float("inf")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _train(tmp_path, bad, callbacks, k=2, **train_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
                      callbacks=callbacks, log_every_n_steps=3)
    trainer.train(PoisonedAt(64, bad), num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=k,
                  train_dataloader_kwargs={"shuffle": False, "num_workers": 0}, **train_kwargs)
    return trainer


def test_message_names_the_update_the_weights_and_the_remedies(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    # sample 25 is in micro-step 12 (batch 2), whose accumulation window (k=2) is update 7
    trainer = _train(tmp_path, 25, [TerminateOnNaNCallback, ProgressBarCallback(file=out)])
    assert trainer.stop_reason == "nonfinite_loss"
    text = out.getvalue()
    assert "non-finite training loss first at optimizer update 7 (epoch 1)" in text
    assert "weights in memory are now non-finite" in text
    assert "lower the learning rate" in text and "gradient_clip_norm" in text and "nonfinite='skip'" in text
    assert "SaveTrainingStateCallback" in text  # nothing was saved, so it says how to have a state
    # on a line of its own: nothing of the progress bar before it on its terminal line
    lines = [line.split("\r")[-1] for line in text.split("\n") if "Stopping training" in line]
    assert lines and all(line.startswith("Stopping training") for line in lines), lines


def test_message_names_the_last_training_state(tmp_path, capsys):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path / "states"), save_every_n_steps=3)
    trainer = _train(tmp_path, 25, [TerminateOnNaNCallback, saver])
    assert trainer.stop_reason == "nonfinite_loss"
    out = capsys.readouterr().out
    assert "go back to the last training state written before it: train(..., resume_from=" in out
    assert "step_6" in out or "states" in out


@pytest.mark.parametrize(
    "steps, losses, k, num_updates, expected",
    [
        ([0, 1, 2, 3], [1.0, 1.0, float("nan"), 1.0], 1, 10, 9),
        ([4, 5, 6, 7], [1.0, float("inf"), 1.0, 1.0], 2, 4, 3),
        ([8, 9, 10], [float("nan")] * 3, 4, 3, 3),  # epoch-end flush of a partial window
        ([0, 1], [1.0, 1.0], 1, 2, None),
    ],
)
def test_first_nonfinite_update(steps, losses, k, num_updates, expected):
    metrics = FlushedMetrics(phase="train", epoch=1, step_indices=steps, losses=losses,
                             batch_sizes=[1] * len(steps), num_updates=num_updates)
    assert first_nonfinite_update(metrics, k) == expected

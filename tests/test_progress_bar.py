"""The progress bar's totals and rates at the end of every epoch."""

import io
import re

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import ProgressBarCallback, StopTrainingError, TrainerCallback


def _data(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _final_bars(text):
    """The last state of each bar: tqdm ends a closed bar's line with a newline."""
    return [line.split("\r")[-1] for line in text.split("\n") if line.strip()]


def _trainer(out, extra=()):
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    return Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.01),
                   callbacks=[ProgressBarCallback(file=out), *extra], log_every_n_steps=4)


KW = dict(per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
          eval_dataloader_kwargs={"num_workers": 0})


def test_totals_and_rates_at_epoch_end():
    out = io.StringIO()
    # 190 samples: 47 batches of 4 and a partial one of 2; k=3: 16 updates, the 16th of 3 steps.
    # log_every_n_steps=4 flushes at update 16 too, so the epoch-end flush has no new steps.
    _trainer(out).train(_data(190), num_epochs=2, eval_dataset=_data(30), gradient_accumulation_steps=3, **KW)
    bars = _final_bars(out.getvalue())
    assert len(bars) == 4, bars
    for bar in bars[0::2]:
        assert bar.startswith("train: 100%") and "48/48" in bar
    for bar in bars[1::2]:
        assert bar.startswith("eval: 100%") and "8/8" in bar
    for bar in bars:
        rate = re.search(r"samples/s=([0-9.e+]+)", bar)
        assert rate is not None and float(rate.group(1)) > 0, bar


class StopAt(TrainerCallback):
    def __init__(self, step, save_dir):
        self.step, self.save_dir = step, save_dir

    def on_train_step_end(self, trainer, step, **kwargs):
        if step == self.step:
            trainer.save_training_state(self.save_dir)
            raise StopTrainingError("stop for the test")


def test_resumed_epoch_ends_at_its_total(tmp_path):
    state = tmp_path / "state"
    _trainer(io.StringIO(), [StopAt(20, state)]).train(_data(96), num_epochs=1, **KW)
    out = io.StringIO()
    _trainer(out).train(_data(96), num_epochs=1, resume_from=str(state), **KW)
    bars = _final_bars(out.getvalue())
    assert bars[-1].startswith("train: 100%") and "24/24" in bars[-1], bars


def test_bar_total_is_the_steps_max_num_train_steps_leaves():
    out = io.StringIO()
    _trainer(out).train(_data(96), num_epochs=1, max_num_train_steps=5, gradient_accumulation_steps=2, **KW)
    bars = _final_bars(out.getvalue())
    assert bars[-1].startswith("train: 100%") and "10/10" in bars[-1], bars

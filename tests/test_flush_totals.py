"""With one process, the flushed all-process epoch totals are this process's totals."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback


class Flushes(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        self.seen.append(metrics)


def test_single_process_global_totals_equal_local_ones():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    model = nn.Linear(3, 1)
    flushes = Flushes()
    trainer = Trainer(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[flushes], log_every_n_steps=2
    )
    trainer.train(
        data, num_epochs=2, eval_dataset=data, per_device_batch_size=4,
        train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0},
    )
    # 10 train batches per epoch at 2 per flush, plus the epoch end; eval every 2 steps too
    assert [m.phase for m in flushes.seen].count("train") == 2 * 6
    for m in flushes.seen:
        assert m.global_epoch_loss_sum == m.epoch_loss_sum
        assert m.global_epoch_sample_count == m.epoch_sample_count
        assert m.global_epoch_mean_loss == m.epoch_mean_loss
    ends = {(m.phase, m.epoch): m.global_epoch_mean_loss for m in flushes.seen if m.is_epoch_end}
    history = trainer.run_history
    assert [ends[("train", e)] for e in (1, 2)] == history.get_metric_values("train_loss_epoch")
    assert [ends[("eval", e)] for e in (1, 2)] == history.get_metric_values("eval_loss_epoch")

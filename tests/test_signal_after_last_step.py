"""A stop signal that arrives after training's last check still reaches the previous handler."""

import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback


class SignalAtRunEnd(TrainerCallback):
    def on_training_run_end(self, trainer, **kwargs):
        signal.raise_signal(signal.SIGTERM)


def test_signal_during_run_end_is_delivered_after_train_returns():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        model = nn.Linear(2, 1)
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[SignalAtRunEnd()])
        data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
        trainer.train(data, num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0})
        # training completed normally, and the signal was passed on exactly once
        assert trainer.num_updates == 2
        assert trainer.stop_reason is None
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)

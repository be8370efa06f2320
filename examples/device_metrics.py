"""Metrics without per-step syncs: torchmetrics updated on the device, computed at epoch ends.

    python examples/device_metrics.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/device_metrics.py   # over all processes

Instead of ``.item()`` per batch, each metric's state (counts, sums) stays on the device; the host
reads it once per epoch, when the callback computes the metric and records
``eval_accuracy_epoch`` / ``train_accuracy_epoch`` in the run history.
"""

import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from fasttrain import Trainer
from fasttrain.callbacks import DeviceMetricsCallback, get_default_callbacks

from _tiny import Classifier, datasets


def main(argv=None):
    metrics = DeviceMetricsCallback(
        {
            # validate_args=False: the argument checks read the targets on the host every step
            "accuracy": MulticlassAccuracy(num_classes=4, average="micro", validate_args=False),
            "f1": MulticlassF1Score(num_classes=4, average="macro", validate_args=False),
        },
        phases=("train", "eval"),
    )
    torch.manual_seed(0)
    model = Classifier()
    train, valid = datasets()
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[*get_default_callbacks(progress_bar=False), metrics])
    trainer.train(train, num_epochs=2, eval_dataset=valid, per_device_batch_size=32,
                  train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0})
    for name in ("train_accuracy_epoch", "eval_accuracy_epoch", "eval_f1_epoch"):
        trainer.print(f"{name}: {trainer.run_history.get_metric_values(name)}")
    return trainer


if __name__ == "__main__":
    main()

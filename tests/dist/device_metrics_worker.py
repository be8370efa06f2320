"""Two gloo processes train with DeviceMetricsCallback; each saves its run history and, on rank
zero, the metric recomputed over the whole evaluation set with the final model.

    ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 device_metrics_worker.py OUT
"""

import os
import sys

import torch
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks.device_metrics import DeviceMetricsCallback

N_EVAL = 13  # odd: the processes hold different numbers of evaluation samples


def main(out_dir):
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.aggregation import SumMetric

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    ex, ey = torch.randn(N_EVAL, 4), torch.randint(0, 3, (N_EVAL,))
    seen = {"local": 0}

    def inputs(batch, batch_output):
        seen["local"] += len(batch[1])  # host count of this process's samples (a Python int)
        return batch_output["model_outputs"], batch[1]

    metrics = DeviceMetricsCallback(
        {"accuracy": MulticlassAccuracy(num_classes=3, average="micro", validate_args=False)},
        inputs=inputs,
    )
    # a second instance needs its own class: a Trainer refuses two callbacks of one class
    class SampleCount(DeviceMetricsCallback):
        pass

    count = SampleCount({"samples": SumMetric(nan_strategy="disable")}, inputs=lambda b, o: (torch.ones_like(b[1]),))
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[metrics, count], engine="eager")
    trainer.train(TensorDataset(x, y), num_epochs=2, eval_dataset=TensorDataset(ex, ey), per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
                  eval_dataloader_kwargs={"num_workers": 0})
    result = {
        "history": {name: trainer.run_history.get_metric_values(name) for name in trainer.run_history.get_metric_names()},
        "local_eval_samples": seen["local"],
        "num_processes": trainer.run_config.num_processes,
    }
    with torch.no_grad():
        preds = trainer.get_model()(ex).argmax(-1)
    result["expected_accuracy"] = (preds == ey).float().mean().item()
    rank = int(os.environ.get("RANK", "0"))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])

    from worker_common import finish_worker

    finish_worker()

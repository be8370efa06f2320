"""Experiment tracking through accelerate: TensorBoard and MLflow's local file store at once.

    python examples/tracking.py --out runs            # then: tensorboard --logdir runs/tensorboard
    python examples/tracking.py --log-with wandb      # any tracker accelerate supports

Losses arrive by micro-step, epoch values by epoch, all from the batched flushes: tracking adds
no per-step sync. Only process zero writes.
"""

import argparse
import importlib.util
import os

import torch

from fasttrain import Trainer
from fasttrain.callbacks import AccelerateTrackerCallback, get_default_callbacks

from _tiny import Classifier, datasets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs")
    parser.add_argument("--log-with", nargs="*", default=None, help="default: tensorboard, and mlflow when installed")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    log_with = args.log_with or ["tensorboard"] + (["mlflow"] if importlib.util.find_spec("mlflow") else [])
    if "mlflow" in log_with:
        os.environ.setdefault("MLFLOW_TRACKING_URI", "file://" + os.path.abspath(os.path.join(args.out, "mlruns")))
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the offline, local store
    tracker = AccelerateTrackerCallback(
        log_with, project_name="tracking-example", logging_dir=os.path.join(args.out, "tensorboard"),
        config={"lr": 0.01, "batch_size": 32}, finish_at_run_end=True,
    )
    torch.manual_seed(0)
    model = Classifier()
    train, valid = datasets()
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[*get_default_callbacks(progress_bar=False), tracker], log_every_n_steps=4)
    trainer.train(train, num_epochs=args.epochs, eval_dataset=valid, per_device_batch_size=32,
                  train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0})
    return trainer


if __name__ == "__main__":
    main()

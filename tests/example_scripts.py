"""pytorch-accelerated's published examples, adapted to tiny synthetic data and run under either
library (``tests/test_examples_compat.py`` compares the two).

Each ``example_*`` function takes a :class:`differential_scripts.Lib` and uses only names that
the example imports from ``pytorch_accelerated``, looked up in the given library, so the two runs
differ in their import alone. The adaptations keep what each example exercises (the hooks it
overrides, the callbacks and their arguments, the calls to ``train``/``evaluate``) and replace
datasets, pretrained models and third-party training components with small stand-ins.

The original's second ``train()`` on a trainer whose run history is kept stops after one update
(``test_differential.py`` pins this), so for the original each further ``train()`` of a
multi-stage example runs in a new trainer on the same model, optimizer and callback objects;
fasttrain runs every stage in one trainer, as the examples do. :func:`merged_history` joins the
original's stages for the comparison.
"""

from __future__ import annotations

import functools
import importlib
from collections import namedtuple
from types import SimpleNamespace
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR
from torch.utils.data import Dataset, TensorDataset

from differential_scripts import NO_WORKERS, Lib, history_of

NUM_CLASSES = 4


def _module(lib: Lib, name: str):
    return importlib.import_module(f"{lib.name}.{name}")


def _initial(model_fn, seed: int = 1234):
    """``model_fn()`` built under a fixed seed, without disturbing the global random stream."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = model_fn()
    torch.random.set_rng_state(state)
    return model


def image_data(n: int, seed: int, size: int = 6) -> TensorDataset:
    """Single-channel images whose class is decided by a fixed projection of a pooled view, so
    that the label survives resizing (progressive resizing trains on several sizes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=g)
    pooled = F.adaptive_avg_pool2d(x, 2).flatten(1)
    w = torch.tensor([[1.0, -1.0, 0.5, 0.0], [0.0, 1.0, -1.0, 0.5], [-0.5, 0.0, 1.0, -1.0], [1.0, 0.5, 0.0, 1.0]])
    return TensorDataset(x, (pooled @ w).argmax(dim=1))


class MNISTLikeModel(nn.Module):
    def __init__(self, size: int = 6):
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(size * size, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, NUM_CLASSES)
        )

    def forward(self, x):
        return self.main(x.view(x.shape[0], -1))


class ResizableConvNet(nn.Module):
    """Takes any image size (pooled to a fixed size), with a backbone and a head as layer groups."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, NUM_CLASSES))

    def forward(self, x):
        return self.head(self.backbone(x))


def _weights(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stage_trainer(lib: Lib, trainer, make):
    """The trainer for a further ``train()`` stage (see the module docstring)."""
    return make() if lib.is_original else trainer


def merged_history(histories: List[Dict[str, list]]) -> Dict[str, list]:
    merged: Dict[str, list] = {}
    for history in histories:
        for name, values in history.items():
            merged.setdefault(name, []).extend(values)
    return merged


def plain_history(history: Dict[str, list]) -> Dict[str, list]:
    """Tensors recorded by metrics callbacks as floats, for comparison."""
    return {name: [float(v) for v in values] for name, values in history.items()}


# ----------------------------------------------------------------------------- core/train_mnist.py
def example_mnist(lib: Lib):
    model = _initial(MNISTLikeModel)
    trainer = lib.Trainer(
        model,
        loss_func=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        **lib.trainer_kwargs,
    )
    trainer.train(
        train_dataset=image_data(40, seed=0),
        eval_dataset=image_data(12, seed=1),
        num_epochs=2,
        per_device_batch_size=8,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
    )
    trained = history_of(trainer)
    trainer.evaluate(dataset=image_data(12, seed=2), per_device_batch_size=8, dataloader_kwargs=dict(NO_WORKERS))
    return _weights(trainer.get_model()), [trained, history_of(trainer)], {}


# ----------------------------------------------------------------------------- core/custom_callback_event.py
def example_custom_callback_event(lib: Lib):
    cb = lib.callbacks
    seen = []

    class VerifyBatchCallback(cb.TrainerCallback):
        def verify_train_batch(self, trainer, xb, yb):
            assert xb.shape[0] == trainer.run_config.train_per_device_batch_size
            assert xb.shape[1:] == (1, 6, 6)
            assert yb.shape[0] == trainer.run_config.train_per_device_batch_size
            seen.append(tuple(xb.shape))

    class TrainerWithCustomCallbackEvent(lib.Trainer):
        def calculate_train_batch_loss(self, batch) -> dict:
            xb, yb = batch
            self.callback_handler.call_event("verify_train_batch", trainer=self, xb=xb, yb=yb)
            return super().calculate_train_batch_loss(batch)

    model = _initial(MNISTLikeModel)
    trainer = TrainerWithCustomCallbackEvent(
        model,
        loss_func=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        callbacks=(
            VerifyBatchCallback,
            cb.TerminateOnNaNCallback,
            cb.PrintProgressCallback,
            cb.ProgressBarCallback,
            cb.LogMetricsCallback,
        ),
        **lib.trainer_kwargs,
    )
    trainer.train(
        train_dataset=image_data(44, seed=0),
        eval_dataset=image_data(12, seed=1),
        train_dataloader_kwargs={"drop_last": True, **NO_WORKERS},
        eval_dataloader_kwargs=dict(NO_WORKERS),
        num_epochs=2,
        per_device_batch_size=8,
    )
    return _weights(trainer.get_model()), [history_of(trainer)], {"verified": seen}


# ----------------------------------------------------------------------------- core/train_with_metrics_in_*.py
def _metric_collection():
    import torchmetrics

    return torchmetrics.MetricCollection(
        {
            "accuracy": torchmetrics.Accuracy(task="multiclass", num_classes=NUM_CLASSES),
            "precision": torchmetrics.Precision(task="multiclass", num_classes=NUM_CLASSES, average="macro"),
            "recall": torchmetrics.Recall(task="multiclass", num_classes=NUM_CLASSES, average="macro"),
        }
    )


def _record_metrics(run_history, metrics):
    computed = metrics.compute()
    for name in ("accuracy", "precision", "recall"):
        run_history.update_metric(name, computed[name].cpu())
    metrics.reset()


def _train_then_evaluate(trainer):
    """Both metrics examples' run: two epochs with evaluation, then one evaluation on new data;
    the metrics' tensors in the two histories as floats."""
    kwargs = dict(NO_WORKERS)
    trainer.train(
        train_dataset=image_data(40, seed=0),
        eval_dataset=image_data(16, seed=1),
        num_epochs=2,
        per_device_batch_size=8,
        train_dataloader_kwargs=kwargs,
        eval_dataloader_kwargs=kwargs,
    )
    trained = plain_history(history_of(trainer))
    trainer.evaluate(dataset=image_data(16, seed=2), per_device_batch_size=16, dataloader_kwargs=kwargs)
    return _weights(trainer.get_model()), [trained, plain_history(history_of(trainer))], {}


def metrics_callback(lib: Lib):
    """The examples' ``ClassificationMetricsCallback``: torchmetrics updated per eval step."""

    class ClassificationMetricsCallback(lib.callbacks.TrainerCallback):
        def __init__(self):
            self.metrics = _metric_collection()

        def on_training_run_start(self, trainer, **kwargs):
            self.metrics.to(trainer.device)

        def on_evaluation_run_start(self, trainer, **kwargs):
            self.metrics.to(trainer.device)

        def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
            self.metrics.update(batch_output["model_outputs"].argmax(dim=-1), batch[1])

        def on_eval_epoch_end(self, trainer, **kwargs):
            _record_metrics(trainer.run_history, self.metrics)

    return ClassificationMetricsCallback()


def example_metrics_in_callback(lib: Lib):
    model = _initial(MNISTLikeModel)
    trainer = lib.Trainer(
        model,
        loss_func=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        callbacks=(metrics_callback(lib), *lib.trainer.DEFAULT_CALLBACKS),
        **lib.trainer_kwargs,
    )
    return _train_then_evaluate(trainer)


def example_metrics_in_loop(lib: Lib):
    class TrainerWithMetrics(lib.Trainer):
        def __init__(self, num_classes, *args, **kwargs):
            super().__init__(*args, **kwargs)
            assert num_classes == NUM_CLASSES
            # an nn.Module attribute: MoveModulesToDeviceCallback moves it to the device
            self.metrics = _metric_collection()

        def calculate_eval_batch_loss(self, batch):
            batch_output = super().calculate_eval_batch_loss(batch)
            self.metrics.update(batch_output["model_outputs"].argmax(dim=-1), batch[1])
            return batch_output

        def eval_epoch_end(self):
            _record_metrics(self.run_history, self.metrics)

    model = _initial(MNISTLikeModel)
    trainer = TrainerWithMetrics(
        model=model,
        loss_func=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        num_classes=NUM_CLASSES,
        **lib.trainer_kwargs,
    )
    return _train_then_evaluate(trainer)


# ----------------------------------------------------------------------------- nlp/hf_bert_glue_mrpc.py
class TokenDataset(Dataset):
    """Dict samples as a tokenised text dataset gives them: token ids of varying length, a label."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for _ in range(n):
            length = int(torch.randint(3, 9, (1,), generator=g))
            ids = torch.randint(1, 20, (length,), generator=g)
            self.samples.append({"input_ids": ids, "labels": int(ids.float().mean() > 10)})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def pad_collate(samples):
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        mask[row, : len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["labels"] for s in samples])}


class SequenceClassifier(nn.Module):
    """Returns an output object with ``loss`` and ``logits``, as a transformers model does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.classifier = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.classifier(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


class AccuracyMetric:
    """The ``add_batch``/``compute`` interface of an ``evaluate`` metric."""

    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions.append(predictions)
        self.references.append(references)

    def compute(self):
        predictions, references = torch.cat(self.predictions), torch.cat(self.references)
        self.predictions, self.references = [], []
        return {"accuracy": float((predictions == references).float().mean())}


def linear_schedule(optimizer, num_training_steps):
    return LambdaLR(optimizer, lambda step: max(0.0, 1 - step / num_training_steps))


def example_hf_loss_func_none(lib: Lib, gradient_accumulation_steps: int = 2):
    class TransformersTrainer(lib.Trainer):
        def __init__(self, model, optimizer, metric, *args, **kwargs):
            super().__init__(model=model, optimizer=optimizer, loss_func=None, *args, **kwargs)
            self.metric = metric

        def calculate_train_batch_loss(self, batch):
            outputs = self.model(**batch)
            return {
                "loss": outputs.loss,
                "model_outputs": outputs.logits,
                "batch_size": batch["attention_mask"].size(0),
            }

        def calculate_eval_batch_loss(self, batch):
            with torch.no_grad():
                outputs = self.model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            self.metric.add_batch(predictions=self.gather(predictions), references=self.gather(batch["labels"]))
            return {
                "loss": outputs.loss,
                "model_outputs": outputs.logits,
                "batch_size": batch["attention_mask"].size(0),
            }

        def eval_epoch_end(self):
            self.run_history.update_metric("metrics", self.metric.compute())

        def create_scheduler(self):
            return self.create_scheduler_fn(
                optimizer=self.optimizer,
                num_training_steps=len(self._train_dataloader) * self.run_config.num_epochs,
            )

    model = _initial(SequenceClassifier)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=0.05)
    trainer = TransformersTrainer(model=model, optimizer=optimizer, metric=AccuracyMetric(), **lib.trainer_kwargs)
    trainer.train(
        train_dataset=TokenDataset(36, seed=0),
        eval_dataset=TokenDataset(12, seed=1),
        collate_fn=pad_collate,
        num_epochs=2,
        per_device_batch_size=4,
        create_scheduler_fn=functools.partial(linear_schedule),
        gradient_accumulation_steps=gradient_accumulation_steps,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
    )
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    return _weights(trainer.get_model()), [history_of(trainer)], {"lrs": lrs}


# ----------------------------------------------------------------------------- vision/transfer_learning/pets_finetune.py
def example_pets_finetune(lib: Lib):
    P = lib.TrainerPlaceholderValues
    model = _initial(ResizableConvNet)
    freezer = lib.finetuning.ModelFreezer(model, freeze_batch_norms=False)
    freezer.freeze()
    lr = 3e-2
    optimizer = torch.optim.Adam(params=freezer.get_trainable_parameters(), lr=lr / 25)
    metrics = metrics_callback(lib)

    def make():
        return lib.Trainer(
            model=model,
            loss_func=F.cross_entropy,
            optimizer=optimizer,
            callbacks=[metrics, *lib.trainer.DEFAULT_CALLBACKS],
            **lib.trainer_kwargs,
        )

    data = dict(
        train_dataset=image_data(40, seed=0),
        eval_dataset=image_data(16, seed=1),
        per_device_batch_size=8,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
    )
    trainer = make()
    schedule = functools.partial(OneCycleLR, max_lr=lr, epochs=P.NUM_EPOCHS, steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH)
    trainer.train(num_epochs=2, create_scheduler_fn=schedule, **data)
    histories = [plain_history(history_of(trainer))]
    frozen_after_first = sorted(n for n, p in model.named_parameters() if not p.requires_grad)

    param_groups = freezer.unfreeze()
    for param_group in param_groups.values():
        param_group["lr"] = lr / 1000
        optimizer.add_param_group(param_group)
    schedule = functools.partial(
        OneCycleLR, max_lr=lr / 100, epochs=P.NUM_EPOCHS, steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH
    )
    trainer = _stage_trainer(lib, trainer, make)
    trainer.train(num_epochs=3, create_scheduler_fn=schedule, reset_run_history=False, **data)
    histories.append(plain_history(history_of(trainer)))
    return _weights(model), histories, {"frozen_after_first": frozen_after_first, "groups": sorted(param_groups)}


# ----------------------------------------------------------------------------- vision/transfer_learning/progressive_resizing.py
def example_progressive_resizing(lib: Lib, save_path: str):
    import torchmetrics

    cb = lib.callbacks
    P = lib.TrainerPlaceholderValues
    devices = []

    class AccuracyCallback(cb.TrainerCallback):
        def __init__(self, num_classes):
            self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

        def on_training_run_start(self, trainer, **kwargs):
            devices.append(str(trainer._eval_dataloader.device))
            self.accuracy.to(trainer._eval_dataloader.device)

        def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
            self.accuracy.update(batch_output["model_outputs"].argmax(-1), batch[1])

        def on_eval_epoch_end(self, trainer, **kwargs):
            trainer.run_history.update_metric("accuracy", self.accuracy.compute().item())
            self.accuracy.reset()

    model = _initial(ResizableConvNet)
    optimizer = torch.optim.Adam(params=model.parameters(), lr=0.01 / 25)
    callbacks = (
        cb.TerminateOnNaNCallback,
        AccuracyCallback(num_classes=NUM_CLASSES),
        cb.PrintProgressCallback,
        cb.ProgressBarCallback,
        cb.LogMetricsCallback,
        cb.EarlyStoppingCallback(early_stopping_patience=2),
        cb.SaveBestModelCallback(save_path=save_path, watch_metric="accuracy", greater_is_better=True),
    )

    def make():
        return lib.Trainer(model, loss_func=nn.CrossEntropyLoss(), optimizer=optimizer, callbacks=callbacks, **lib.trainer_kwargs)

    EpochConfig = namedtuple("EpochConfig", ["num_epochs", "image_size", "lr"])
    trainer, histories = None, []
    for config in (EpochConfig(2, 4, 0.01), EpochConfig(2, 6, 0.01), EpochConfig(3, 8, 0.001)):
        trainer = make() if trainer is None else _stage_trainer(lib, trainer, make)
        schedule = functools.partial(
            OneCycleLR, max_lr=config.lr, epochs=P.NUM_EPOCHS, steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH
        )
        trainer.train(
            train_dataset=image_data(32, seed=0, size=config.image_size),
            eval_dataset=image_data(16, seed=1, size=config.image_size),
            num_epochs=config.num_epochs,
            create_scheduler_fn=schedule,
            per_device_batch_size=8,
            reset_run_history=False,
            train_dataloader_kwargs=dict(NO_WORKERS),
            eval_dataloader_kwargs=dict(NO_WORKERS),
        )
        histories.append(history_of(trainer))
    return _weights(model), histories, {"devices": devices}


# ----------------------------------------------------------------------------- vision/using_timm_components/train_mixup_ema.py
def mixup(xb, yb, alpha: float = 0.2):
    """Mixes each sample with the batch reversed, with one Beta(alpha, alpha) weight per batch,
    and returns soft targets (the part of timm's ``Mixup`` the example relies on)."""
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    targets = F.one_hot(yb, NUM_CLASSES).float()
    return lam * xb + (1 - lam) * xb.flip(0), lam * targets + (1 - lam) * targets.flip(0)


class CosineEpochScheduler:
    """A timm-style scheduler: ``step_update(num_updates)`` per update, ``step(epoch)`` per epoch."""

    def __init__(self, optimizer, t_initial, lr_min=1e-4):
        self.optimizer, self.t_initial, self.lr_min = optimizer, t_initial, lr_min
        self.base = [group["lr"] for group in optimizer.param_groups]
        self.calls = []

    def step(self, epoch):
        self.calls.append(("step", epoch))
        t = min(epoch, self.t_initial) / self.t_initial
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = self.lr_min + 0.5 * (base - self.lr_min) * (1 + torch.cos(torch.tensor(t * torch.pi)).item())

    def step_update(self, num_updates):
        self.calls.append(("step_update", num_updates))


def example_mixup_ema(lib: Lib):
    import torchmetrics

    ModelEma = _module(lib, "utils").ModelEma

    class MixupEmaTrainer(lib.Trainer):
        def __init__(self, eval_loss_fn, num_classes, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.eval_loss_fn = eval_loss_fn
            self.num_updates = None
            self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
            self.ema_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
            self.ema_model = None

        def create_scheduler(self):
            return CosineEpochScheduler(self.optimizer, t_initial=self.run_config.num_epochs)

        def training_run_start(self):
            self.ema_model = ModelEma(self._accelerator.unwrap_model(self.model), decay=0.9)

        def train_epoch_start(self):
            super().train_epoch_start()
            self.num_updates = self.run_history.current_epoch * len(self._train_dataloader)

        def calculate_train_batch_loss(self, batch):
            xb, yb = batch
            return super().calculate_train_batch_loss(mixup(xb, yb))

        def train_epoch_end(self):
            self.ema_model.update(self.model)
            self.ema_model.eval()

        def scheduler_step(self):
            self.num_updates += 1
            if self.scheduler is not None:
                self.scheduler.step_update(num_updates=self.num_updates)

        def calculate_eval_batch_loss(self, batch):
            with torch.no_grad():
                xb, yb = batch
                outputs = self.model(xb)
                val_loss = self.eval_loss_fn(outputs, yb)
                self.accuracy.update(outputs.argmax(-1), yb)
                self.ema_accuracy.update(self.ema_model.module(xb).argmax(-1), yb)
            return {"loss": val_loss, "model_outputs": outputs, "batch_size": xb.size(0)}

        def eval_epoch_end(self):
            super().eval_epoch_end()
            if self.scheduler is not None:
                self.scheduler.step(self.run_history.current_epoch + 1)
            self.run_history.update_metric("accuracy", self.accuracy.compute().cpu())
            self.run_history.update_metric("ema_model_accuracy", self.ema_accuracy.compute().cpu())
            self.accuracy.reset()
            self.ema_accuracy.reset()

    model = _initial(ResizableConvNet)
    trainer = MixupEmaTrainer(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        loss_func=nn.BCEWithLogitsLoss(),  # soft mixup targets
        eval_loss_fn=nn.CrossEntropyLoss(),
        num_classes=NUM_CLASSES,
        callbacks=[*lib.trainer.DEFAULT_CALLBACKS],
        **lib.trainer_kwargs,
    )
    trainer.train(
        train_dataset=image_data(40, seed=0),
        eval_dataset=image_data(16, seed=1),
        num_epochs=3,
        per_device_batch_size=8,
        create_scheduler_fn=CosineEpochScheduler,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
    )
    extra = {"ema": _weights(trainer.ema_model.module), "calls": list(trainer.scheduler.calls)}
    return _weights(trainer.get_model()), [plain_history(history_of(trainer))], extra

"""LightningModules fitted under both lightning.Trainer and fasttrain.lightning.Trainer in the
tests, and a helper that runs one module under each from the same seed and data order."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)


def classification_data(n=48, features=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def loader(dataset, batch_size=8, shuffle=False, seed=0):
    # shuffled from the global generator, which fit_both seeds the same for both trainers
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


#: what most tests train on, and what the fit and checkpoint tests validate on
DATA = classification_data()
VAL = classification_data(n=20, seed=1)


def train_loader():
    """:data:`DATA` in batches of 8, shuffled."""
    return loader(DATA, batch_size=8, shuffle=True)


def val_loader():
    """:data:`VAL` in batches of 5 (the last one smaller), in order."""
    return loader(VAL, batch_size=5)


class Classifier(L.LightningModule):
    """Adam, per-step and per-epoch logging, validation and test."""

    def __init__(self, features=6, classes=3, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.Tanh(), torch.nn.Linear(16, classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_max", loss, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        self.log("val_batch_loss", F.cross_entropy(logits, y), on_step=True, on_epoch=False)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class ReturnsLogits(Classifier):
    """Returns its logits beside the loss, records the dtypes ``on_train_batch_end`` is handed
    (loss, logits), and predicts logits."""

    def __init__(self):
        super().__init__()
        self.handed = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return {"loss": loss, "logits": logits}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.handed.append((outputs["loss"].dtype, outputs["logits"].dtype))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class ScheduledClassifier(Classifier):
    """SGD with momentum, a per-epoch StepLR and a per-step OneCycle in a list of dicts."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=int(total) + 1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": onecycle, "interval": "step", "frequency": 1}}


class EpochScheduled(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class PlateauScheduled(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


class TinyGPT(L.LightningModule):
    """A one-block causal transformer with a per-step warmup scheduler dict (frequency 2)."""

    def __init__(self, vocab=17, dim=16, context=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(context, dim))
        self.block = torch.nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.emb(x) + self.pos[: x.size(1)]
        h = self.block(h, src_mask=self.mask[: x.size(1), : x.size(1)], is_causal=True)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.log("loss", loss)
        return {"loss": loss, "tokens": torch.tensor(y.numel(), device=self.device)}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step", "frequency": 2}}


class TiedCausalLM(L.LightningModule):
    """Shaped like users' language models: dict batches (``input_ids``, ``labels``), a pre-norm
    block, a final LayerNorm and a head tied to the embedding; AdamW with weight decay and a
    per-step warmup."""

    def __init__(self, vocab=17, dim=16, context=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids):
        h = self.emb(input_ids) + self.pos[: input_ids.size(1)]
        h = h + self.mlp(self.ln1(h))
        return self.head(self.ln_f(h))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class TiedCausalLMLoggingNorms(TiedCausalLM):
    """Logs the gradient norms before each update, as Lightning's docs show, and the tied
    weight's after each backward (on the device: no host read)."""

    def on_after_backward(self):
        self.log("tied_grad_norm", self.emb.weight.grad.norm())

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))


class LogsGradientNormsOfTheModule(L.Callback):
    """What TiedCausalLMLoggingNorms logs, from a callback: the tied weight's gradient norm after
    each backward and Lightning's grad_norm before each update, through the module's log."""

    def on_after_backward(self, trainer, module):
        module.log("tied_grad_norm", module.emb.weight.grad.norm())

    def on_before_optimizer_step(self, trainer, module, optimizer):
        from lightning.pytorch.utilities import grad_norm

        module.log_dict(grad_norm(module, norm_type=2))


class TokenDicts(torch.utils.data.Dataset):
    """Token windows as dicts of ``input_ids`` and next-token ``labels``."""

    def __init__(self, n=40, context=8, vocab=17, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, context + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def token_data(n=32, context=9, vocab=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, vocab, (n, context), generator=g))


class MetricsModule(Classifier):
    """Logs torchmetrics objects (step and epoch) and a logged value with an explicit batch size."""

    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log_dict({"loss_sum": loss, "weighted": loss * 2}, reduce_fx="sum", on_epoch=True)
        self.log("explicit", loss, on_epoch=True, batch_size=3)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)
        self.log("val_loss", F.cross_entropy(logits, y))


class TwoOptimizerManual(L.LightningModule):
    """Manual optimization: two optimizers stepped alternately, clipping, two schedulers."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        sched_a, sched_b = self.lr_schedulers()
        loss = F.cross_entropy(self.b(torch.tanh(self.a(x))), y)
        for opt in (opt_a, opt_b):
            self.toggle_optimizer(opt)
            opt.zero_grad()
            self.manual_backward(loss, retain_graph=opt is opt_a)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            self.untoggle_optimizer(opt)
        sched_a.step()
        if self.trainer.is_last_batch:
            sched_b.step()
        self.log("loss", loss, prog_bar=True)

    def configure_optimizers(self):
        opt_a = torch.optim.SGD(self.a.parameters(), lr=0.1)
        opt_b = torch.optim.Adam(self.b.parameters(), lr=0.01)
        return [opt_a, opt_b], [
            torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.5),
            torch.optim.lr_scheduler.ExponentialLR(opt_b, 0.9),
        ]


def fit_both(module_factory, loader_factory, val_factory=None, seed=0, trainer_kwargs=None, fasttrain_kwargs=None,
             quiet=True):
    """Fit ``module_factory()`` under lightning.Trainer and fasttrain.lightning.Trainer from the
    same seed and data; returns ``(lightning_trainer, lightning_module, fasttrain_trainer,
    fasttrain_module)``; ``fasttrain_kwargs`` add to ``trainer_kwargs`` for fasttrain's, or replace
    them (callbacks of its own). ``quiet=False`` leaves fasttrain's fit's warnings to the caller."""
    from fasttrain.lightning import Trainer as FastTrainer

    kwargs = dict(QUIET)
    kwargs.update(trainer_kwargs or {})
    torch.manual_seed(seed)
    reference_module = module_factory()
    module = copy.deepcopy(reference_module)
    out = []
    for trainer_cls, mod, extra in ((L.Trainer, reference_module, {}), (FastTrainer, module, fasttrain_kwargs or {})):
        torch.manual_seed(seed + 1)
        with warnings.catch_warnings():
            if quiet or trainer_cls is L.Trainer:
                warnings.simplefilter("ignore")
            trainer = trainer_cls(**{**kwargs, **extra})  # fasttrain_kwargs replace trainer_kwargs
            trainer.fit(mod, loader_factory(), val_factory() if val_factory else None)
        out += [trainer, mod]
    return tuple(out)


def assert_same_weights(a, b, atol=1e-6):
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(q, p, atol=atol, rtol=0, msg=f"parameter {name} differs")


def assert_same_metrics(reference: dict, ours: dict, atol=1e-5):
    assert sorted(ours) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(
            torch.as_tensor(ours[key]).double(), torch.as_tensor(value).double(), atol=atol, rtol=0, msg=key
        )


def assert_same_results(reference: list, ours: list, atol=1e-6):
    """``validate()``/``test()`` results: one dict of metrics per loader, the same keys and values."""
    assert len(ours) == len(reference)
    for their_loader, our_loader in zip(reference, ours):
        assert_same_metrics(their_loader, our_loader, atol=atol)

"""Models, data, cases and a recorder shared by the engine tests (CPU) and the graphed-engine tests (GPU).

Everything is tiny: on the CPU each compiled run is dominated by tracing and compiling, which
scales with the number of graphs, not with the model.
"""

from __future__ import annotations

import functools
import warnings
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer, TrainerPlaceholderValues, prepare
from fasttrain.callbacks import TrainerCallback

# Models ---------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in=8, width=16, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    """Conv + BatchNorm: the compiled forward also mutates buffers (running statistics)."""

    def __init__(self, classes=3):
        super().__init__()
        # no bias before BatchNorm: its gradient is exactly zero in theory, and Adam would turn
        # rounding noise in it into full-size updates that differ between eager and compiled
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1, stride=2)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class TinyGPT(nn.Module):
    """One pre-norm decoder block with causal self-attention, weight-tied head."""

    def __init__(self, vocab=32, seq=8, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.ln1 = nn.LayerNorm(d)
        # no qkv bias: the key bias has an exactly-zero gradient (softmax ignores a constant
        # added to every score of a query), so Adam would amplify rounding noise in it
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.size(-1), dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.ln_f(x) @ self.tok.weight.t()


class MeanPool(nn.Module):
    """Accepts any number of input features (see :class:`RaggedCollate`)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x.mean(dim=1, keepdim=True) * self.scale


class HostReadingTrainer(Trainer):
    """Reads the learning rate on the host in optimizer_step: fine eagerly and compiled (a sync),
    impossible inside a CUDA graph."""

    def optimizer_step(self):
        super().optimizer_step()
        self.last_lr = float(prepare.stepping_optimizer(self).param_groups[0]["lr"])


class GraphBreakTrainer(Trainer):
    """A loss hook dynamo cannot trace whole, with nothing read on the host: the graph breaks
    between the model and the loss (both hooks). A CUDA graph can still capture the step."""

    def calculate_train_batch_loss(self, batch):
        outputs = self.model(batch[0])
        torch._dynamo.graph_break()
        loss = self.loss_func(outputs, batch[1])
        return {"loss": loss, "model_outputs": outputs, "batch_size": batch[1].size(0)}

    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            outputs = self.model(batch[0])
            torch._dynamo.graph_break()
            loss = self.loss_func(outputs, batch[1])
        return {"loss": loss, "model_outputs": outputs, "batch_size": batch[1].size(0)}


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# Data -----------------------------------------------------------------------------------------


def vector_data(n=70, d_in=8, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g))


def image_data(n=44, classes=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, classes, (n,), generator=g))


def token_data(n=36, vocab=32, seq=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class RaggedCollate:
    """A collate_fn whose batches each keep a different number of features: dynamic shapes."""

    def __init__(self):
        self.calls = []

    def __call__(self, samples):
        keep = 4 + len(self.calls) % 4
        self.calls.append(keep)
        xs = torch.stack([s[0] for s in samples])[:, :keep].contiguous()
        return xs, torch.stack([s[1] for s in samples])


def one_cycle(max_lr=0.05):
    return functools.partial(
        torch.optim.lr_scheduler.OneCycleLR,
        max_lr=max_lr,
        epochs=TrainerPlaceholderValues.NUM_EPOCHS,
        steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
    )


# Recording ------------------------------------------------------------------------------------


def dynamo_counts():
    """(graphs compiled, frames compiled): a recompile raises the second, a new graph the first."""
    from torch._dynamo.utils import counters

    from fasttrain.engine.compile_events import compiles_so_far

    return counters["stats"]["unique_graphs"], compiles_so_far()


def held_hyperparams(trainer):
    """``(lr, betas or None)``: the tensors the trainer's compiled or graphed engine holds for the
    optimizer's first group and lends to it while compiled code runs (engine/hyperparams.py)."""
    held = trainer._engine._hparams._held[0]
    return held.lr, held.betas


def fasttrain_warnings(caught) -> List[str]:
    """The messages of fasttrain's own RuntimeWarnings among those ``warnings.catch_warnings(record=True)`` caught."""
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "fasttrain:" in str(w.message)]


class CountsCaptureFrames:
    """Mixed in before a graphed engine class: appends the number of frames dynamo compiled during
    each capture to ``frames_in_captures``, which each test sets to a fresh list on its class."""

    frames_in_captures: List[int] = []

    def _capture(self, body):
        from fasttrain.engine.compile_events import compiles_so_far

        # every frame compiled, the fullgraph=True ones included (compile_events.py)
        before = compiles_so_far()
        result = super()._capture(body)
        type(self).frames_in_captures.append(compiles_so_far() - before)
        return result


class Recorder(TrainerCallback):
    """Host values from the batched flushes, and dynamo's counts after each epoch."""

    def __init__(self):
        self.train: List[float] = []
        self.eval: List[float] = []
        self.grad_norms: List[float] = []
        self.counts_after_epoch: List[tuple] = []

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        (self.train if metrics.phase == "train" else self.eval).extend(metrics.losses)
        self.grad_norms.extend(metrics.grad_norms)

    def on_training_run_epoch_end(self, trainer, **kwargs):
        self.counts_after_epoch.append(dynamo_counts())


@dataclass
class Run:
    recorder: Recorder
    trainer: Trainer
    state: dict = field(default_factory=dict)


@dataclass
class Case:
    model: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    data: Callable[[], TensorDataset]
    loss: Callable = F.cross_entropy
    batch_size: int = 8
    epochs: int = 2
    train_kwargs: dict = field(default_factory=dict)
    trainer_cls: type = Trainer


def mlp_case(trainer_cls=Trainer, epochs=3, **train_kwargs) -> Case:
    """The MLP with AdamW, accumulation 2, norm clipping and a one-cycle schedule; ``train_kwargs``
    add to or replace those train() arguments."""
    kwargs = dict(gradient_accumulation_steps=2, gradient_clip_norm=0.5, create_scheduler_fn=one_cycle())
    kwargs.update(train_kwargs)
    return Case(
        model=MLP,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
        data=vector_data,
        epochs=epochs,
        train_kwargs=kwargs,
        trainer_cls=trainer_cls,
    )


def run(case: Case, engine: str, compile_options: Optional[dict] = None, device=None, log_every_n_steps=3,
        callbacks=(), **overrides) -> Run:
    """``case`` trained on ``engine`` from seed 0, with the recorder and ``callbacks``; ``overrides``
    add to or replace the ``train()`` arguments."""
    torch.manual_seed(0)
    model = case.model()
    if device is not None:
        model = model.to(device)
    recorder = Recorder()
    trainer = case.trainer_cls(
        model,
        case.loss,
        case.optimizer(model),
        callbacks=[recorder, *callbacks],
        engine=engine,
        log_every_n_steps=log_every_n_steps,
        compile_options=compile_options,
    )
    data = case.data()
    kwargs = dict(
        train_dataset=data,
        eval_dataset=data,
        num_epochs=case.epochs,
        per_device_batch_size=case.batch_size,
        train_dataloader_kwargs={"shuffle": False, "num_workers": 0},
        eval_dataloader_kwargs={"num_workers": 0},
    )
    kwargs.update(case.train_kwargs)
    kwargs.update(overrides)
    trainer.train(**kwargs)
    state = {k: v.detach().float().cpu().clone() for k, v in trainer.get_model().state_dict().items()}
    return Run(recorder, trainer, state)


def eager_and(case: Case, engine: str, compile_options: Optional[dict] = None, **overrides):
    """``case`` run eagerly, then on ``engine``: ``(eager run, other run, fasttrain's warnings of
    the other run)``."""
    eager = run(case, "eager", **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = run(case, engine, compile_options, **overrides)
    return eager, other, fasttrain_warnings(caught)


def assert_runs_match(expected: Run, actual: Run, rtol=1e-4, atol=1e-5):
    """Per-step losses (training and evaluation), grad norms and final weights agree.

    Tolerance: fp32 has a 1.2e-7 epsilon; compiled kernels reassociate sums and fuse ops, and the
    learning rate and betas are fp32 tensors instead of Python floats, so each step differs by a
    few ulp and the difference grows slowly over tens of updates. 1e-4 relative is three orders
    of magnitude above that and far below what a real error does: a missed scale by 1/k, a clip
    applied twice or an update applied twice changes losses and weights in the second or third
    digit.
    """
    e, a = expected.recorder, actual.recorder
    assert len(e.train) == len(a.train) and len(e.eval) == len(a.eval)
    torch.testing.assert_close(torch.tensor(a.train), torch.tensor(e.train), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(a.eval), torch.tensor(e.eval), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(a.grad_norms), torch.tensor(e.grad_norms), rtol=rtol, atol=atol)
    assert expected.state.keys() == actual.state.keys()
    for key in expected.state:
        torch.testing.assert_close(
            actual.state[key], expected.state[key], rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )


def intentional_break(reason: str) -> bool:
    """The graph breaks torch's optimizers make on purpose: ``torch._dynamo.graph_break()`` around
    ``step`` (to keep AOTAutograd's no-grad graph) and the step wrapper an LR scheduler installs,
    whose file dynamo skips."""
    return "graph_break()" in reason or "lr_scheduler" in reason


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)

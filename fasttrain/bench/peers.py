"""The training loops fasttrain is measured against, and fasttrain itself, behind one interface.

Every peer trains the same workload: same initial weights (seeded factory), same synthetic batches
in the same order (an unshuffled DataLoader with ``num_workers=0`` and a pass-through collate
function), same optimizer, same batch size and precision.

A peer has two operations. ``setup()`` builds the model, optimizer and trainer. ``run(n)`` is one
complete training call of ``n`` optimizer steps, the way a user would make it: a fresh pass over
the DataLoader for the hand-written loops, one ``train()``/``fit()`` for the trainers; it returns
after the device has finished the work. The runner times whole ``run`` calls and subtracts two of
them (see runner.py), so no peer carries a timing hook inside its loop.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
from typing import Callable, Dict, List, Optional

import torch

from fasttrain.bench.workloads import PeerUnavailable, Workload, passthrough_collate


def device_sync(device: torch.device) -> None:
    """Wait for queued device work; the end of every ``run`` calls it so that the clock read
    after it covers the computation, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC(bench): the clock must cover the queued work


def loader_kwargs(workload: Workload) -> Dict[str, object]:
    """DataLoader settings shared by every peer. The dataset is already in page-locked memory on
    CUDA and hands out views of it, so ``pin_memory`` would only re-check it; workers would
    measure process start-up. Every peer copies these pinned batches with ``non_blocking=True``:
    the hand-written loops say so, fasttrain decides it from the batch (``fasttrain.data``),
    pytorch-accelerated is given accelerate's ``non_blocking`` option and Lightning does it on
    CUDA by default."""
    return {"shuffle": False, "num_workers": 0, "pin_memory": False, "drop_last": True}


def _autocast(workload: Workload, cache_enabled: Optional[bool] = None):
    if workload.amp_dtype is None:
        return contextlib.nullcontext()
    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.autocast(workload.device.type, dtype=workload.amp_dtype, **kwargs)


class Peer:
    """Base class: a named way of running training steps on a workload."""

    name = "peer"

    def __init__(self, workload: Workload):
        self.workload = workload
        self.device = workload.device
        self.notes: List[str] = []

    def setup(self) -> None:
        raise NotImplementedError

    def run(self, num_steps: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Drop references so the next peer gets the memory back."""
        self.__dict__.pop("model", None)
        self.__dict__.pop("optimizer", None)
        self.__dict__.pop("trainer", None)

    def _loader(self):
        wl = self.workload
        return torch.utils.data.DataLoader(
            wl.dataset, batch_size=wl.batch_size, collate_fn=passthrough_collate, **loader_kwargs(wl)
        )


# --------------------------------------------------------------------------------------------
# hand-written loops


class BareLoop(Peer):
    """The floor of eager overhead: DataLoader, forward, loss, backward, step, zero_grad."""

    name = "bare"

    def setup(self) -> None:
        self.model = self.workload.make_model()
        self.optimizer = self.workload.make_optimizer(self.model)
        self.model.train()

    def run(self, num_steps: int) -> None:
        model, opt, loss_func, dev = self.model, self.optimizer, self.workload.loss_func, self.device
        for x, y in itertools.islice(self._loader(), num_steps):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with _autocast(self.workload):
                loss = loss_func(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # SYNC(bench): the clock read after run() returns must include the queued device work.
        device_sync(dev)


class CompiledLoop(BareLoop):
    """The bare loop with forward + loss compiled as one graph (backward runs the compiled
    backward graph) and the optimizer step compiled, as PyTorch's tutorials recommend."""

    name = "compiled"

    def setup(self) -> None:
        super().setup()
        model, loss_func, wl, opt = self.model, self.workload.loss_func, self.workload, self.optimizer

        def forward_loss(x, y):
            with _autocast(wl):
                return loss_func(model(x), y)

        def optimizer_step():
            opt.step()

        self._forward_loss = torch.compile(forward_loss)
        self._optimizer_step = torch.compile(optimizer_step)

    def run(self, num_steps: int) -> None:
        dev = self.device
        for x, y in itertools.islice(self._loader(), num_steps):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = self._forward_loss(x, y)
            loss.backward()
            self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
        # SYNC(bench): the clock read after run() returns must include the queued device work.
        device_sync(dev)


class CompiledModelLoop(BareLoop):
    """The bare loop over ``torch.compile(model)``: what a user who compiles the model writes
    (the loss, backward and optimizer step stay eager). A model that cannot be traced whole,
    such as transformers' GPT-2 with its logging calls, compiles with graph breaks."""

    name = "compiled-model"

    def setup(self) -> None:
        super().setup()
        self.model = torch.compile(self.model)


class CudaGraphLoop(Peer):
    """The whole step (forward, loss, backward, optimizer step) captured once into a CUDA graph
    and replayed; each batch is copied into the static input buffers the graph reads."""

    name = "cudagraph"

    def setup(self) -> None:
        if self.device.type != "cuda":
            raise PeerUnavailable("needs CUDA")
        wl = self.workload
        self.model = wl.make_model()
        self.model.train()
        # capturable: Adam keeps its step count on the device, so the captured step needs no host value.
        self.optimizer = wl.make_optimizer(self.model, capturable=True)
        x0, y0 = wl.dataset.__getitems__(list(range(wl.batch_size)))
        self.static_x = x0.to(self.device, copy=True)
        self.static_y = y0.to(self.device, copy=True)

        def step():
            # Autocast's weight-cast cache would hold tensors from outside the graph's memory pool.
            with _autocast(wl, cache_enabled=False):
                loss = wl.loss_func(self.model(self.static_x), self.static_y)
            loss.backward()
            self.optimizer.step()
            return loss

        # Warm up on a side stream so lazily created state (optimizer moments, cuBLAS
        # workspaces, autograd buffers) exists before capture and stays out of the graph.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.optimizer.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Gradients set to None before capture: backward then allocates them in the graph's
        # pool and each replay overwrites rather than accumulates them.
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = step()

    def run(self, num_steps: int) -> None:
        for x, y in itertools.islice(self._loader(), num_steps):
            self.static_x.copy_(x, non_blocking=True)
            self.static_y.copy_(y, non_blocking=True)
            self.graph.replay()
        # SYNC(bench): the clock read after run() returns must include the queued device work.
        device_sync(self.device)

    def close(self) -> None:
        self.__dict__.pop("graph", None)
        super().close()


# --------------------------------------------------------------------------------------------
# trainers


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _TrainerPeer(Peer):
    """A pytorch-accelerated-style Trainer with its default callbacks, trained with
    ``max_num_train_steps`` over a dataset that holds enough batches for one epoch."""

    def _make_trainer(self, model, optimizer):
        raise NotImplementedError

    def _context(self):
        return contextlib.nullcontext()

    def setup(self) -> None:
        model = self.workload.make_model()
        optimizer = self.workload.make_optimizer(model)
        with self._context():
            self.trainer = self._make_trainer(model, optimizer)

    def run(self, num_steps: int) -> None:
        wl = self.workload
        with self._context():
            self.trainer.train(
                train_dataset=wl.dataset,
                num_epochs=1,
                per_device_batch_size=wl.batch_size,
                max_num_train_steps=num_steps,
                train_dataloader_kwargs=loader_kwargs(wl),
                collate_fn=passthrough_collate,
            )
        # SYNC(bench): the clock read after run() returns must include the queued device work.
        device_sync(self.device)


def _non_blocking_accelerator():
    """pytorch-accelerated's ``Accelerator()`` with one change: batches are copied with
    ``non_blocking=True``, as every other peer copies them (accelerate's default is a blocking
    copy, a host-device sync per batch, which would measure the copy rather than the trainer)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True))


class PyTorchAcceleratedPeer(_TrainerPeer):
    name = "pytorch-accelerated"

    def _make_trainer(self, model, optimizer):
        try:
            from pytorch_accelerated import Trainer
        except ImportError as exc:
            raise PeerUnavailable(f"pytorch-accelerated is not installed ({exc})") from exc
        class SameCopyTrainer(Trainer):
            def _create_accelerator(self):
                return _non_blocking_accelerator()

        return SameCopyTrainer(model, self.workload.loss_func, optimizer)

    def _context(self):
        # Its Trainer builds ``Accelerator()`` without arguments inside train(); accelerate reads
        # the precision from this variable, so set it explicitly either way.
        return _env(ACCELERATE_MIXED_PRECISION="bf16" if self.workload.amp_dtype else "no")


class FasttrainPeer(_TrainerPeer):
    engine = "eager"

    def _make_trainer(self, model, optimizer):
        try:
            from fasttrain.trainer import Trainer
        except ImportError as exc:
            raise PeerUnavailable(f"fasttrain.trainer is not importable ({exc})") from exc
        return Trainer(
            model,
            self.workload.loss_func,
            optimizer,
            engine=self.engine,
            mixed_precision="bf16" if self.workload.amp_dtype else "no",
        )

    @property
    def engine_ran(self) -> Optional[str]:
        """The engine that ran the last training steps (another one after a fallback)."""
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else trainer.active_engine

    def run(self, num_steps: int) -> None:
        super().run(num_steps)
        if self.trainer.stop_reason == "interrupted":
            # the trainer's own SIGINT handler ended train() early; the benchmark must stop too
            raise KeyboardInterrupt


def _fasttrain_peer(engine: str):
    return type(f"Fasttrain{engine.title()}Peer", (FasttrainPeer,), {"name": f"fasttrain-{engine}", "engine": engine})


#: Lightning versions each Lightning peer runs with. The plain peer uses Lightning 2's public
#: Trainer arguments; ``fasttrain.lightning`` uses Lightning internals, so it is held to the range
#: pyproject.toml's ``lightning`` and ``peers`` extras install (tests/test_bench_peers.py keeps
#: the two in step).
LIGHTNING_REQUIRES = ">=2.0"
FASTTRAIN_LIGHTNING_REQUIRES = ">=2.6,<2.7"


def _import_lightning():
    """The ``lightning`` package, else ``pytorch_lightning``. One that is installed but fails to
    import (built against another torch, a dependency missing) is reported with the reason, and
    the other peers still run."""
    for name in ("lightning", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            if importlib.util.find_spec(name) is None:
                continue  # not installed
            failure = exc
        except Exception as exc:
            failure = exc
        raise PeerUnavailable(f"{name} fails to import: {_one_line(failure)}") from failure
    raise PeerUnavailable("Lightning is not installed (pip install fasttrain[peers])")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _check_lightning_version(L, requires: str, peer: str) -> None:
    """Raise :class:`PeerUnavailable` unless the imported Lightning's version is in ``requires``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = getattr(L, "__version__", None)
    try:
        supported = version is not None and Version(version) in SpecifierSet(requires)
    except InvalidVersion:
        supported = False
    if not supported:
        raise PeerUnavailable(
            f"{peer} runs with {L.__name__}{requires}, found {version}; "
            f"pip install 'lightning{requires}' (the fasttrain[peers] extra pins it)"
        )


class LightningPeer(Peer):
    """A LightningModule that logs its loss to the progress bar, as Lightning's documentation
    shows; default callbacks except checkpointing, model summary and logger, whose work happens
    once per fit() and would only write files."""

    name = "lightning"

    def setup(self) -> None:
        L = _import_lightning()
        _check_lightning_version(L, LIGHTNING_REQUIRES, self.name)
        wl = self.workload
        model = wl.make_model()
        optimizer = wl.make_optimizer(model)

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = model

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = wl.loss_func(self.model(x), y)
                self.log("train_loss", loss, prog_bar=True)
                return loss

            def configure_optimizers(self):
                return optimizer

        self._L = L
        self.module = Module()

    def run(self, num_steps: int) -> None:
        wl = self.workload
        trainer = self._trainer_class()(
            accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=[self.device.index or 0] if self.device.type == "cuda" else 1,
            precision="bf16-mixed" if wl.amp_dtype else "32-true",
            max_steps=num_steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(self.module, train_dataloaders=self._loader())
        # SYNC(bench): the clock read after run() returns must include the queued device work.
        device_sync(self.device)

    def _trainer_class(self):
        return self._L.Trainer

    def close(self) -> None:
        self.__dict__.pop("module", None)
        super().close()


class FasttrainLightningPeer(LightningPeer):
    """The same LightningModule, fitted by ``fasttrain.lightning.Trainer`` (the one changed
    import), on the engine ``"auto"`` picks."""

    name = "fasttrain-lightning"

    def setup(self) -> None:
        super().setup()
        if self._L.__name__ != "lightning":
            raise PeerUnavailable("fasttrain.lightning needs the lightning package (pip install fasttrain[lightning])")
        _check_lightning_version(self._L, FASTTRAIN_LIGHTNING_REQUIRES, self.name)
        try:
            from fasttrain.lightning import Trainer
        except Exception as exc:  # at set-up, so it is reported as unavailable, not as a failed run
            raise PeerUnavailable(
                f"fasttrain.lightning fails to import with lightning {self._L.__version__}: {_one_line(exc)}"
            ) from exc
        self._fasttrain_trainer = Trainer

    def _trainer_class(self):
        return self._fasttrain_trainer


PEERS: Dict[str, Callable[[Workload], Peer]] = {
    "bare": BareLoop,
    "compiled": CompiledLoop,
    "compiled-model": CompiledModelLoop,
    "cudagraph": CudaGraphLoop,
    "pytorch-accelerated": PyTorchAcceleratedPeer,
    "lightning": LightningPeer,
    "fasttrain-lightning": FasttrainLightningPeer,
    "fasttrain-eager": _fasttrain_peer("eager"),
    "fasttrain-compiled": _fasttrain_peer("compiled"),
    "fasttrain-cudagraph": _fasttrain_peer("cudagraph"),
}

ALIASES = {"pta": "pytorch-accelerated", "pytorch_accelerated": "pytorch-accelerated", "pl": "lightning"}

#: the peer every ratio is taken against.
BASELINE = "bare"


def resolve_peers(spec: Optional[str]) -> List[str]:
    """Parse a comma-separated peer list (None: all). The baseline is always included, first,
    because every ratio is relative to it."""
    if not spec:
        return list(PEERS)
    names = []
    for raw in spec.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        name = ALIASES.get(name, name)
        if name not in PEERS:
            raise ValueError(f"unknown peer {raw.strip()!r}; choose from {', '.join(PEERS)}")
        if name not in names:
            names.append(name)
    if BASELINE in names:
        names.remove(BASELINE)
    return [BASELINE] + names


def make_peer(name: str, workload: Workload) -> Peer:
    return PEERS[name](workload)

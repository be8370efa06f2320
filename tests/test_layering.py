"""The dependencies point one way: trainer -> engine -> kernels. Engines know the trainer only
through the StepContext it builds (fasttrain/engine/context.py)."""

import ast
from pathlib import Path

import pytest
import torch

import fasttrain
from fasttrain import Trainer, prepare
from fasttrain.engine import EagerEngine, create_engine
from fasttrain.engine.context import StepContext

PACKAGE = Path(fasttrain.__file__).parent
KERNELS = Path(fasttrain.kernels.__file__).parent
# what sits above the engines: the Trainer and everything that drives or observes it
ABOVE_ENGINE = (
    "fasttrain.trainer", "fasttrain.callbacks", "fasttrain.prepare", "fasttrain.loops",
    "fasttrain.checkpointing", "fasttrain.signals", "fasttrain.nonfinite", "fasttrain.lightning",
    "fasttrain.step_metrics", "fasttrain.resume",
)


def imported_modules(path: Path):
    """Every module ``path`` imports, at any depth (imports inside functions count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            for alias in node.names:  # from fasttrain import trainer
                yield f"{node.module}.{alias.name}"


def _is_under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def engine_files():
    return sorted((PACKAGE / "engine").glob("*.py"))


def test_engine_modules_import_nothing_above_them():
    assert len(engine_files()) >= 5
    offending = [
        (path.name, module)
        for path in engine_files()
        for module in imported_modules(path)
        if _is_under(module, ABOVE_ENGINE)
    ]
    assert offending == []


def test_kernels_import_no_engine_and_no_trainer():
    files = sorted(KERNELS.glob("*.py"))
    assert files
    offending = [
        (path.name, module)
        for path in files
        for module in imported_modules(path)
        if _is_under(module, ("fasttrain.engine",) + ABOVE_ENGINE)
    ]
    assert offending == []


def test_engines_use_no_private_name_of_the_trainer():
    # ``trainer._x``, ``self.trainer._x`` and ``ctx.trainer._x``: the context carries all of that
    offending = []
    for path in engine_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            named_trainer = (isinstance(owner, ast.Name) and owner.id == "trainer") or (
                isinstance(owner, ast.Attribute) and owner.attr == "trainer"
            )
            if named_trainer:
                offending.append((path.name, node.lineno, node.attr))
    assert offending == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fasttrain.trainer import Trainer\nfrom fasttrain import callbacks\n")
    found = list(imported_modules(bad))
    assert "fasttrain.trainer" in found and "fasttrain.callbacks" in found
    assert _is_under("fasttrain.callbacks", ABOVE_ENGINE)
    assert not _is_under("fasttrain.callbacksx", ABOVE_ENGINE)


def test_an_engine_runs_from_a_context_without_any_trainer():
    # a plain object with the public hooks is enough: the engine asks nothing else of it
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    class Hooks:
        device = torch.device("cpu")
        scheduler = None

        def __init__(self):
            self.model, self.optimizer = model, optimizer

        def calculate_train_batch_loss(self, batch):
            calls.append("forward")
            return {"loss": self.model(batch).pow(2).mean(), "batch_size": batch.size(0)}

        def backward_step(self, loss):
            calls.append("backward")
            loss.backward()

        def optimizer_step(self):
            calls.append("step")
            self.optimizer.step()

        def optimizer_zero_grad(self):
            calls.append("zero_grad")
            self.optimizer.zero_grad()

    ctx = StepContext(
        trainer=Hooks(),
        loss_for_backward=lambda out: out["loss"] / 2,
        clip=lambda: calls.append("clip"),
        step_was_skipped=lambda: False,
        no_sync=lambda update: __import__("contextlib").nullcontext(),
    )
    engine = create_engine("eager", ctx)
    assert isinstance(engine, EagerEngine)
    before = model.weight.detach().clone()
    engine.train_step(torch.ones(2, 3), update=False)
    assert calls == ["forward", "backward"]
    engine.train_step(torch.ones(2, 3), update=True)
    assert calls[2:] == ["forward", "backward", "clip", "step", "zero_grad"]
    assert not torch.equal(model.weight, before)


def test_the_trainer_context_records_overridden_hooks_and_loss_scaling():
    class Custom(Trainer):
        def optimizer_zero_grad(self):
            super().optimizer_zero_grad()

    model = torch.nn.Linear(3, 1)
    trainer = Custom(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    ctx = prepare.step_context(trainer, Trainer)
    assert ctx.overridden_hooks == frozenset({"optimizer_zero_grad"})
    assert ctx.overrides("optimizer_zero_grad") and not ctx.overrides("backward_step")
    assert ctx.capture_blockers == ()
    with pytest.raises(ValueError, match="'loss'"):
        ctx.loss_for_backward({"model_outputs": None})

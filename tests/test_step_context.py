"""The step context: what the Trainer hands an engine, and the pieces it is built from."""

import contextlib

import pytest
import torch

from fasttrain import Trainer, prepare
from fasttrain.engine import EagerEngine, create_engine
from fasttrain.engine.clipping import GradientClipper, UpdateClip
from fasttrain.engine.context import StepContext
from fasttrain.engine.loss_scaling import LossScaling
from fasttrain.nonfinite import NonFiniteGuard


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
        no_sync=lambda update: contextlib.nullcontext(),
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


def test_loss_scaling_divides_by_the_window_and_scales_token_losses_by_the_processes():
    loss = torch.tensor(6.0, requires_grad=True)
    assert LossScaling()({"loss": loss}) is loss  # nothing to scale: the same tensor
    assert LossScaling(accumulation_steps=3)({"loss": loss}).item() == pytest.approx(2.0)
    tokens = {"loss": loss, "num_items_in_batch": 10}
    # token-normalised: times the processes (DDP averages), then over the window
    assert LossScaling(2, num_processes=4, distributed=True)(tokens).item() == pytest.approx(12.0)
    # a loss without a token count is not multiplied, nor is anything in one process
    assert LossScaling(2, num_processes=4, distributed=True)({"loss": loss}).item() == pytest.approx(3.0)
    assert LossScaling(1, num_processes=4, distributed=False)(tokens) is loss


def test_update_clip_clips_by_norm_and_does_nothing_when_nothing_is_asked():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    assert UpdateClip(NonFiniteGuard("stop"), GradientClipper([p]))() is None
    assert torch.equal(p.grad, torch.full((4,), 3.0))
    clip = UpdateClip(NonFiniteGuard("stop"), GradientClipper([p], clip_norm=1.0))
    norm = clip()
    assert norm.item() == pytest.approx(6.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    assert len(clip.mutated_flags()) == 3


def test_the_engine_clips_with_the_guard_of_the_current_run():
    model = torch.nn.Linear(3, 1)
    trainer = Trainer(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[], engine="eager", nonfinite="skip")
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    for _ in range(2):  # each train() builds a new guard; the context must not keep the old one
        trainer.train(data, num_epochs=1, per_device_batch_size=4)
        ctx = trainer._engine.ctx
        assert ctx.clip is trainer._update_clip and ctx.clip.guard is trainer._nonfinite
        assert ctx.loss_for_backward == LossScaling(1, 1, False)

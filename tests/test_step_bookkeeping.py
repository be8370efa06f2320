"""The step loop keeps its books straight: ring slots across a device counter restart, clipping of
layers unfrozen mid-run, no gradients leaking between train() calls, eval limits honoured."""

from __future__ import annotations

import torch
from torch import nn

from fasttrain import Trainer
from fasttrain.callbacks import LimitEvalStepsCallback, TrainerCallback
from fasttrain.engine import graph_buffers
from fasttrain.engine.graph_buffers import StepRing

from tiny_regression import NO_WORKERS, sum_data, tanh_mlp


# ---------------------------------------------------------------------------- graph ring slots
def test_ring_slots_stay_in_step_with_the_device_counter_across_its_restart():
    # A replay writes at the device counter, then the host asks next_slot() which slot that was.
    # When the host restarts the device counter (every 2**23 calls), the slot the host returns
    # for later replays must still be the one the device wrote.
    ring = StepRing(4, torch.device("cpu"))
    start = graph_buffers._COUNTER_RESET - 6
    ring.calls = start
    ring.losses.counters[3].fill_(float(start))
    for i in range(16):
        loss = torch.tensor(float(i + 1))
        ring.record({"loss": loss}, None)  # what the captured graph does on a replay
        slot = ring.next_slot()
        assert ring.loss_views[slot].item() == float(i + 1), f"replay {i}: host reads the wrong slot"


# ---------------------------------------------------------------------------- clipping
class _Unfreeze(TrainerCallback):
    def on_train_epoch_start(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 2:
            for p in trainer.model[0].parameters():
                p.requires_grad_(True)


def test_parameters_unfrozen_during_training_are_clipped():
    model = tanh_mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = Trainer(model, nn.MSELoss(), optimizer, callbacks=[_Unfreeze()], engine="eager")
    before = [p.detach().clone() for p in model[0].parameters()]
    clip = 1e-4
    trainer.train(
        sum_data(8),
        num_epochs=2,
        per_device_batch_size=4,
        gradient_clip_value=clip,
        train_dataloader_kwargs=NO_WORKERS,
    )
    # epoch 2 has two updates with SGD(lr=1): every element moves by at most 2 * clip (plus
    # float32 rounding); unclipped, the first layer moves by orders of magnitude more
    for p, b in zip(model[0].parameters(), before):
        assert (p.detach() - b).abs().max().item() <= 2 * clip + 1e-6


# ---------------------------------------------------------------------------- eval limits
class _CountEvalSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_eval_step_end(self, trainer, **kwargs):
        self.steps += 1


def test_limit_eval_steps_callback_limits_the_evaluation_epoch():
    counter = _CountEvalSteps()
    model = tanh_mlp()
    trainer = Trainer(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[LimitEvalStepsCallback(2, limit_intermediate_only=False), counter],
        engine="eager",
    )
    trainer.train(
        sum_data(8),
        num_epochs=1,
        eval_dataset=sum_data(24, seed=1),
        per_device_batch_size=4,
        train_dataloader_kwargs=NO_WORKERS,
        eval_dataloader_kwargs=NO_WORKERS,
    )
    assert counter.steps == 2


# ---------------------------------------------------------------------------- between train() calls
class _StopAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, trainer, step, **kwargs):
        if step == self.step:
            from fasttrain.callbacks import StopTrainingError

            raise StopTrainingError("stop inside an accumulation window")


def test_gradients_of_an_unfinished_window_do_not_leak_into_the_next_train_call():
    import copy

    model = tanh_mlp()
    stopper = _StopAtStep(0)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[stopper], engine="eager")
    # step 0 of a 4-step window: its gradients are accumulated, then training stops
    trainer.train(sum_data(16), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=4,
                  train_dataloader_kwargs=NO_WORKERS)
    assert trainer.stop_reason == "stop_training_error"
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    stopper.step = -1
    trainer.train(sum_data(16, seed=3), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=NO_WORKERS)

    fresh = Trainer(reference, nn.MSELoss(), torch.optim.SGD(reference.parameters(), lr=0.1), callbacks=(), engine="eager")
    fresh.train(sum_data(16, seed=3), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=NO_WORKERS)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)

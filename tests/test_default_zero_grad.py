"""The default ``optimizer_zero_grad`` hook: it clears what torch's ``zero_grad()`` clears, without
that call's per-update wrappers, and steps aside for an optimizer with its own ``zero_grad``, for a
patched instance and while a profiler runs (torch's call labels the zeroing in the trace)."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer, prepare
from fasttrain.callbacks import TrainerCallback


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))


class _GradsAfterUpdates(TrainerCallback):
    """Whether every parameter of every group had no gradient after each update."""

    def __init__(self):
        self.cleared = []

    def on_train_step_end(self, trainer, **kwargs):
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        self.cleared.append(all(p.grad is None for p in params))


def _two_group_optimizer(model):
    # a second group, as a fine-tuning script adds for its head
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.01)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.001})
    return opt


def _train(optimizer_fn, callbacks=(), gradient_accumulation_steps=1):
    model = _model()
    trainer = Trainer(model, nn.MSELoss(), optimizer_fn(model), callbacks=list(callbacks), engine="eager")
    trainer.train(_data(), 2, per_device_batch_size=4, gradient_accumulation_steps=gradient_accumulation_steps,
                  train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    return model


@pytest.fixture
def counted_torch_zero_grad(monkeypatch):
    """torch's ``Optimizer.zero_grad`` with a call counter, still recognised as torch's own."""
    calls = []
    original = torch.optim.Optimizer.zero_grad

    def zero_grad(self, set_to_none=True):
        calls.append(type(self).__name__)
        return original(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", zero_grad)
    monkeypatch.setattr(prepare, "_TORCH_ZERO_GRAD", zero_grad, raising=False)
    return calls


def test_the_default_hook_clears_every_group_without_calling_torchs_zero_grad(counted_torch_zero_grad):
    seen = _GradsAfterUpdates()
    _train(_two_group_optimizer, [seen])
    assert counted_torch_zero_grad == []
    assert seen.cleared == [True] * 12  # 6 batches a epoch, each an update


def test_gradients_accumulate_between_updates_and_clear_after_each():
    seen = _GradsAfterUpdates()
    _train(_two_group_optimizer, [seen], gradient_accumulation_steps=3)
    assert seen.cleared == [False, False, True] * 4


def test_the_weights_equal_those_of_torchs_own_zero_grad():
    fast = _train(_two_group_optimizer)

    def patched_instance(model):
        opt = _two_group_optimizer(model)
        opt.zero_grad = opt.zero_grad  # in the instance's __dict__: the hook calls it
        return opt

    torchs = _train(patched_instance)
    for a, b in zip(fast.parameters(), torchs.parameters()):
        assert torch.equal(a, b)


def test_an_optimizer_with_its_own_zero_grad_keeps_it():
    calls = []

    class CountingAdamW(torch.optim.AdamW):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    _train(lambda model: CountingAdamW(model.parameters(), lr=0.01))
    assert calls == [True] * 12


def test_a_zero_grad_set_on_the_instance_is_called():
    calls = []

    def optimizer(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        torchs = opt.zero_grad
        opt.zero_grad = lambda set_to_none=True: (calls.append(1), torchs(set_to_none))
        return opt

    _train(optimizer)
    assert len(calls) == 12


def test_under_a_profiler_the_zeroing_keeps_torchs_label(counted_torch_zero_grad):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(lambda model: torch.optim.AdamW(model.parameters(), lr=0.01))
    assert counted_torch_zero_grad == ["AdamW"] * 12
    names = [event.name for event in prof.events()]
    assert names.count("Optimizer.zero_grad#AdamW.zero_grad") == 12

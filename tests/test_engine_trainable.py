"""Layers unfrozen between epochs or between ``train()`` calls train in the compiled engines as in
eager, on every torch CI covers (fasttrain/engine/trainable.py: torch 2.11's dynamo does not trace
code again when a parameter starts to require gradients, so the unfrozen layers got no gradient
and never trained, with no error)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from fasttrain.callbacks import TrainerCallback
from fasttrain.engine import trainable
from fasttrain.engine.compile_cache import with_own_dynamo_cache
from fasttrain.engine.trainable import dynamo_sees_requires_grad_changes, notice_trainable_change

from engine_cases import MLP, mlp_case, run
from test_engine_graph_logic import AOT, host_graphs  # noqa: F401


def _loss(holder, x):
    return holder.layer(x).sum()


def test_the_probe_says_what_dynamo_does_and_draws_no_random_number():
    # the same question asked of this torch directly: a frozen layer's compiled loss, unfrozen
    layer = nn.Linear(2, 1)
    layer.requires_grad_(False)
    holder = types.SimpleNamespace(layer=layer)
    compiled = torch.compile(with_own_dynamo_cache(_loss), backend="aot_eager", fullgraph=True, dynamic=False)
    compiled(holder, torch.ones(1, 2))
    layer.requires_grad_(True)
    sees = compiled(holder, torch.ones(1, 2)).requires_grad
    state = torch.random.get_rng_state()
    assert dynamo_sees_requires_grad_changes.__wrapped__() == sees
    assert torch.equal(torch.random.get_rng_state(), state)
    if torch.__version__.startswith("2.11."):
        assert not sees  # the torch this works around (pytorch/pytorch#139476)


def test_a_change_is_noticed_once_and_forgets_compiled_code_where_dynamo_would_not(monkeypatch):
    forgotten = []
    monkeypatch.setattr(torch._dynamo, "reset_code_caches", lambda: forgotten.append(True))
    monkeypatch.setattr(trainable, "dynamo_sees_requires_grad_changes", lambda: False)
    model = MLP()
    wrapped = types.SimpleNamespace(module=model)  # a wrapper is seen through (DDP, Lightning's step module)
    assert not notice_trainable_change(model)  # the first look
    assert not notice_trainable_change(wrapped) and not forgotten
    model.net[0].weight.requires_grad_(False)
    assert notice_trainable_change(wrapped) and forgotten == [True]
    assert not notice_trainable_change(model) and forgotten == [True]
    monkeypatch.setattr(trainable, "dynamo_sees_requires_grad_changes", lambda: True)
    model.net[0].weight.requires_grad_(True)
    assert notice_trainable_change(model) and forgotten == [True]  # dynamo sees it: nothing forgotten


class UnfreezesAtEpoch(TrainerCallback):
    """Trains only the last layer for the first epoch, then everything (a finetuning schedule)."""

    def on_training_run_start(self, trainer, **kwargs):
        for p in trainer.get_model().net[:-1].parameters():
            p.requires_grad_(False)

    def on_train_epoch_start(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 2:
            for p in trainer.get_model().parameters():
                p.requires_grad_(True)


@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_layers_unfrozen_at_an_epoch_start_train_as_in_eager(engine):
    case = mlp_case(epochs=3, gradient_clip_norm=None, create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    initial = MLP().state_dict()
    runs = {}
    for name, options in (("eager", None), (engine, AOT)):
        result = run(case, name, options, callbacks=[UnfreezesAtEpoch()], eval_dataset=None)
        assert result.trainer.active_engine == name
        runs[name] = result.state
    first_layer = "net.0.weight"
    assert not torch.allclose(runs[engine][first_layer], initial[first_layer])  # it trained
    for key, value in runs["eager"].items():
        torch.testing.assert_close(runs[engine][key], value, rtol=1e-4, atol=1e-5)

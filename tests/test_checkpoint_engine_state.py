"""Checkpoints written under the compiled and graphed engines hold what the user's optimizer
would write: float learning rates and betas (the engines hold them as device tensors) and the
user's own ``capturable`` flag (the engines switch Adam/AdamW to ``capturable=True`` on CUDA).
Such a checkpoint loads on a machine without the device, and an eager SGD resumed from it steps
without reading its learning rate from a tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.engine.hyperparams import TensorHyperparams, plain_optimizer_state

from engine_cases import held_hyperparams
from host_reads import HostReads

AOT = {"backend": "aot_eager"}


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


def _trainer(optimizer_fn, engine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return Trainer(model, nn.MSELoss(), optimizer_fn(model.parameters()), engine=engine,
                   compile_options=AOT if engine != "eager" else None, callbacks=())


def _train(trainer):
    trainer.train(train_dataset=_data(), num_epochs=1, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0})


def _assert_plain(groups):
    for group in groups:
        for key, value in group.items():
            assert not isinstance(value, torch.Tensor), key
            if isinstance(value, tuple):
                assert all(type(v) is float for v in value), key


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_checkpoint_of_the_compiled_engine_holds_floats(tmp_path, opt):
    optimizer_fn = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    }[opt]
    trainer = _trainer(optimizer_fn, "compiled")
    _train(trainer)
    assert trainer._engine.active_engine == "compiled"
    assert isinstance(held_hyperparams(trainer)[0], torch.Tensor)  # held by the engine
    assert type(trainer.optimizer.param_groups[0]["lr"]) is float  # the group's own, outside its calls
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    _assert_plain(saved["optimizer_state_dict"]["param_groups"])
    trainer.save_training_state(tmp_path / "state")
    _assert_plain(torch.load(tmp_path / "state" / "optimizer.pt", weights_only=True)["param_groups"])

    # resumed by the eager engine: a float learning rate, no host read in the step
    resumed = _trainer(optimizer_fn, "eager")
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    group = resumed.optimizer.param_groups[0]
    assert type(group["lr"]) is float
    assert group["lr"] == pytest.approx(float(trainer.optimizer.param_groups[0]["lr"]))
    if opt == "adamw":
        assert all(type(b) is float for b in group["betas"])
        return
    model = resumed.model
    model(torch.randn(3, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with HostReads() as reads:
        resumed.optimizer.step()
    assert reads.reads == 0
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step ran


def test_the_users_own_capturable_flag_is_saved():
    # the engines switch Adam to capturable=True on CUDA only; the same switch is made here on the
    # CPU by hand, next to a group the user made capturable
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]
    optimizer = torch.optim.Adam([{"params": [params[0]]}, {"params": [params[1]], "capturable": True}], lr=0.1)
    hparams = TensorHyperparams(optimizer, capturable=True)
    hparams.apply()
    hparams._make_capturable(optimizer.param_groups[0])
    for p in params:
        optimizer.state[p] = {"step": torch.tensor(4.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    assert optimizer.param_groups[0]["capturable"] is True
    state = plain_optimizer_state(optimizer)
    groups = state["param_groups"]
    assert [g["capturable"] for g in groups] == [False, True]
    assert [g["lr"] for g in groups] == [pytest.approx(0.1)] * 2
    _assert_plain(groups)
    # the optimizer itself is left as the engine holds it (the learning rates are the groups' own
    # floats outside compiled calls; the engine lends its tensors only to them)
    assert optimizer.param_groups[0]["capturable"] is True
    assert type(optimizer.param_groups[0]["lr"]) is float
    # and it loads into the user's optimizer as written
    fresh = torch.optim.Adam([{"params": [params[0]]}, {"params": [params[1]], "capturable": True}], lr=0.3)
    fresh.load_state_dict(state)
    assert [g["capturable"] for g in fresh.param_groups] == [False, True]
    assert type(fresh.param_groups[0]["lr"]) is float
    # after the engine gives its groups back, nothing is rewritten any more
    hparams.release()
    assert optimizer.param_groups[0]["capturable"] is False
    assert [g["capturable"] for g in plain_optimizer_state(optimizer)["param_groups"]] == [False, True]

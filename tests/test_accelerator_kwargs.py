"""Trainer(accelerator_kwargs=...): accelerate's distributed configuration, passed publicly."""

import os

import pytest
import torch
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin

from fasttrain import Trainer
from fasttrain.accelerate_state import build_accelerator


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def _trainer(**options):
    model = torch.nn.Linear(2, 1)
    return Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=None, **options)


def test_kwargs_reach_the_accelerator():
    handler = DistributedDataParallelKwargs(static_graph=True, gradient_as_bucket_view=True)
    trainer = _trainer(accelerator_kwargs={"kwargs_handlers": [handler]})
    assert trainer._accelerator.ddp_handler is handler


def test_bad_kwargs_say_what_to_pass():
    with pytest.raises(TypeError, match="accelerator_kwargs must be a dict"):
        _trainer(accelerator_kwargs=[("fsdp_plugin", None)])
    with pytest.raises(ValueError, match=r"Trainer\(mixed_precision=...\)"):
        _trainer(accelerator_kwargs={"mixed_precision": "bf16"})


def test_a_plugin_given_to_one_trainer_does_not_leak_into_the_environment(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    build_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    # accelerate writes ACCELERATE_USE_FSDP=true for a given plugin; every later Accelerator of
    # the process would then build a default (FSDP1) plugin from it
    assert "ACCELERATE_USE_FSDP" not in os.environ

"""Trainer(accelerator_kwargs=...) and Trainer(accelerator=...): accelerate's distributed
configuration, passed publicly; FSDP1 and launches accelerate did not recognise are refused."""

import os

import pytest
import torch
from accelerate import Accelerator
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


# ------------------------------------------------------------------------------------ FSDP1
def test_an_fsdp1_plugin_is_refused_with_the_fsdp2_way():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match=r"FSDP version 1 \(accelerator_kwargs\['fsdp_plugin'\]\).*fsdp_version=2"):
        _trainer(accelerator_kwargs={"fsdp_plugin": plugin})


@pytest.mark.parametrize("version", [None, "1"])
def test_fsdp1_from_the_launcher_environment_is_refused(monkeypatch, version):
    # what `accelerate launch --config_file` writes for an FSDP config without fsdp_version: 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    if version is None:
        monkeypatch.delenv("FSDP_VERSION", raising=False)
    else:
        monkeypatch.setenv("FSDP_VERSION", version)
    with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP from the launcher.*fsdp_version: 2"):
        _trainer()


def test_fsdp2_from_the_launcher_environment_is_accepted(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    trainer = _trainer()
    assert trainer._accelerator.num_processes == 1  # one process: nothing to shard


def test_an_accelerator_in_fsdp1_state_is_refused_at_train():
    from accelerate.utils import DistributedType

    class FSDP1Trainer(Trainer):
        """What a GPU launch with an FSDP1 plugin gives: accelerate's state says FSDP, version 1."""

        def _create_accelerator(self):
            accelerator = Accelerator()
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
            return accelerator

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="FSDP version 1 .*the accelerator's FSDP plugin"):
        FSDP1Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=None)


# ------------------------------------------------------------------------------------ accelerator=
def _data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g))


def test_a_ready_accelerator_runs_every_train_and_evaluate():
    accelerator = Accelerator()
    trainer = _trainer(accelerator=accelerator, engine="eager")
    for _ in range(2):
        trainer.train(_data(), num_epochs=1, per_device_batch_size=4)
        assert trainer._accelerator is accelerator
        assert accelerator._models == [trainer.model]
    trainer.evaluate(_data(), per_device_batch_size=4)
    assert trainer._accelerator is accelerator
    assert len(trainer.run_history.get_metric_values("evaluation_loss")) == 1


def test_a_ready_accelerator_excludes_the_settings_it_replaces():
    with pytest.raises(ValueError, match="accelerator_kwargs would be ignored"):
        _trainer(accelerator=Accelerator(), accelerator_kwargs={"split_batches": True})
    with pytest.raises(ValueError, match="mixed_precision would be ignored"):
        _trainer(accelerator=Accelerator(), mixed_precision="bf16")
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        _trainer(accelerator={"mixed_precision": "bf16"})


def test_a_ready_accelerator_whose_settings_another_trainer_replaced_raises():
    accelerator = Accelerator(mixed_precision="no")
    trainer = _trainer(accelerator=accelerator, engine="eager")
    _trainer(mixed_precision="bf16")  # rebuilds accelerate's process-wide settings
    with pytest.raises(RuntimeError, match=r"no longer has the settings.*'no'.*'bf16'"):
        trainer.train(_data(), num_epochs=1, per_device_batch_size=4)


# ------------------------------------------------------------------------------------ bad launch
def test_a_launch_accelerate_took_for_one_process_raises(monkeypatch):
    # WORLD_SIZE from a launcher, but nothing accelerate recognises as a process group
    # (tests/test_fsdp.py launches torchrun for real)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("LOCAL_RANK", "RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* single process.*ACCELERATE_USE_CPU=1"):
        _trainer()

"""``trainer.strategy`` and ``trainer.accelerator`` as Lightning's classes (isinstance checks, what
callbacks read of them) and the ``strategy=`` argument: names and objects that map onto
accelerate, the ones refused, ``devices`` lists; DDP's ``find_unused_parameters`` over two gloo
processes against one lightning.Trainer process."""

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from launching import finish, launch_env, start, torchrun_two  # noqa: E402
from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    ScheduledClassifier,
    assert_same_weights,
    classification_data,
    loader,
)
from side_by_side import run_both  # noqa: E402

BOTH = (L.Trainer, Trainer)


def _strategy_view(trainer, module) -> dict:
    strategy = trainer.strategy
    return {
        "single": isinstance(strategy, SingleDeviceStrategy),
        "ddp": isinstance(strategy, (DDPStrategy, ParallelStrategy)),
        "strategy": isinstance(strategy, Strategy),
        "cpu": isinstance(trainer.accelerator, CPUAccelerator),
        "cuda": isinstance(trainer.accelerator, CUDAAccelerator),
        "same_accelerator": strategy.accelerator is trainer.accelerator,
        "root_device": strategy.root_device,
        "module": strategy.lightning_module is module,
        "model": strategy.model is module,
        "optimizers": [type(o).__name__ for o in strategy.optimizers],
        "optimizers_are_trainers": strategy.optimizers == trainer.optimizers,
        "lightning_optimizers": len(strategy._lightning_optimizers),
        "schedulers": [type(c.scheduler).__name__ for c in strategy.lr_scheduler_configs],
        "launcher": strategy.launcher,
        "ranks": (strategy.is_global_zero, strategy.global_rank, strategy.local_rank, strategy.world_size),
        "precision": type(strategy.precision_plugin).__name__,
        "reduce": strategy.reduce(torch.tensor(3.0)).item(),
        "broadcast": strategy.broadcast({"a": 1}),
        "handles_accumulation": strategy.handles_gradient_accumulation,
    }


class _Seen(L.Callback):
    def on_train_start(self, trainer, module):
        self.during = _strategy_view(trainer, module)


def test_strategy_and_accelerator_objects_like_lightning():
    def action(trainer):
        seen = _Seen()
        trainer.callbacks.append(seen)
        module = ScheduledClassifier()
        before = isinstance(trainer.strategy, SingleDeviceStrategy), isinstance(trainer.accelerator, CPUAccelerator)
        trainer.fit(module, loader(DATA, batch_size=8))
        after = _strategy_view(trainer, module)
        other = ScheduledClassifier()
        trainer.strategy.connect(other)
        return before, seen.during, after, trainer.lightning_module is other, trainer.strategy.lightning_module is other

    out = run_both(action, max_epochs=1)
    assert out["lightning"][0] == (True, True)
    assert out["lightning"][1]["optimizers"] == ["SGD"]
    assert out["fasttrain"] == out["lightning"]


@pytest.mark.parametrize("flag", [
    "auto", "single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true",
    "ddp_spawn_find_unused_parameters_false", "DDP",
])
def test_strategy_names_give_lightnings_strategy_classes(flag):
    seen = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(strategy=flag, accelerator="cpu", devices=1, **QUIET)
        strategy = trainer.strategy
        seen.append((
            isinstance(strategy, SingleDeviceStrategy), isinstance(strategy, DDPStrategy),
            getattr(strategy, "_ddp_kwargs", None), getattr(strategy, "_start_method", None), trainer.device_ids,
            trainer.num_devices, str(strategy.root_device),
        ))
    assert seen[0] == seen[1]


def test_strategy_objects_give_lightnings_strategy_classes():
    seen = []
    for trainer_cls in BOTH:
        objects = [SingleDeviceStrategy(device="cpu"), DDPStrategy(find_unused_parameters=True, static_graph=False),
                   DDPStrategy(start_method="spawn")]
        row = []
        for given in objects:
            strategy = trainer_cls(strategy=given, accelerator="cpu", devices=1, **QUIET).strategy
            row.append((type(given).__name__, isinstance(strategy, type(given)), str(strategy.root_device),
                        getattr(strategy, "_ddp_kwargs", None)))
        seen.append(row)
    assert seen[0] == seen[1]
    assert all(same for _, same, _, _ in seen[1])


def test_a_ddp_name_in_one_process_trains_like_lightning():
    """``strategy="ddp"`` with one device: Lightning's DDPStrategy, and the fit of one process."""

    def action(trainer):
        torch.manual_seed(0)
        module = ScheduledClassifier()
        trainer.fit(module, loader(DATA, batch_size=8))
        return module, trainer.global_step

    lightning_out = run_both(action, max_epochs=2)["lightning"]
    ours = Trainer(max_epochs=2, strategy="ddp", devices=1, accelerator="cpu", **QUIET)
    assert isinstance(ours.strategy, DDPStrategy)
    module, steps = action(ours)
    assert steps == lightning_out[1]
    assert_same_weights(lightning_out[0], module)


@pytest.mark.parametrize("devices", [[0, 1], "0,1", [0], 2, "2", "1"])
def test_devices_arguments_on_the_cpu_like_lightning(devices):
    seen = []
    for trainer_cls in BOTH:
        try:
            trainer = trainer_cls(accelerator="cpu", devices=devices, **QUIET)
        except (TypeError, ValueError) as error:
            seen.append((type(error).__name__, str(error)))
            continue
        seen.append((trainer.device_ids, trainer.num_devices, isinstance(trainer.strategy, DDPStrategy)))
    assert seen[0] == seen[1]


def test_spawning_strategies_do_not_return_predictions_like_lightning():
    seen = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(strategy="ddp_spawn", accelerator="cpu", devices=1, **QUIET)
        trainer.predict_loop.return_predictions = None
        default = trainer.predict_loop.return_predictions
        with pytest.raises(MisconfigurationException, match="`return_predictions` should be set to `False`"):
            trainer.predict_loop.return_predictions = True
        seen.append(default)
    assert seen == [False, False]


@pytest.mark.parametrize("flag, match", [
    ("deepspeed", "does not support strategy 'deepspeed'.*torchrun"),
    ("deepspeed_stage_2", "does not support strategy 'deepspeed_stage_2'"),
    ("xla", "does not support strategy 'xla'"),
    ("fsdp_cpu_offload", "cannot honour FSDPStrategy's 'cpu_offload'"),
    (DDPStrategy(ddp_comm_hook=lambda *a: None), r"cannot honour DDPStrategy\(ddp_comm_hook"),
    (DDPStrategy(process_group=None), r"cannot pass \['process_group'\] to DDP"),
    (FSDPStrategy(sharding_strategy="NO_SHARD"), "cannot honour FSDPStrategy's 'sharding_strategy'"),
])
def test_strategies_that_cannot_map_are_refused_at_construction(flag, match):
    with pytest.raises(ValueError, match=match):
        Trainer(strategy=flag, **QUIET)


@pytest.mark.parametrize("flag", ["dpp", 3])
def test_an_unknown_strategy_is_lightnings_error(flag):
    for trainer_cls in BOTH:
        with pytest.raises(ValueError, match=f"You selected an invalid strategy name: `strategy={flag!r}`"):
            trainer_cls(strategy=flag, **QUIET)


def test_a_spawning_strategy_with_several_devices_in_one_process_says_how_to_launch():
    trainer = Trainer(strategy="ddp_notebook", accelerator="cpu", devices=2, max_epochs=1, **QUIET)
    assert isinstance(trainer.strategy, DDPStrategy)
    with pytest.raises(ValueError, match=r"starts no processes itself.*'fork'.*notebook_launcher"):
        trainer.fit(ScheduledClassifier(), loader(DATA, batch_size=8))


@pytest.mark.multiprocess
def test_find_unused_parameters_over_two_processes_like_lightning(tmp_path):
    launch = start(torchrun_two(HERE / "lightning" / "strategy_worker.py", tmp_path), tmp_path / "launch.log",
                   launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, time.monotonic() + 300, "the two processes", retry_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    from strategy_worker import WithUnusedLayer

    torch.manual_seed(0)
    reference = WithUnusedLayer()
    trainer = L.Trainer(max_epochs=1, **QUIET)
    trainer.fit(reference, loader(classification_data(n=32), batch_size=8))
    for rank, result in enumerate(ranks):
        for case in ("name", "object"):
            seen = result[case]
            assert "error" not in seen, seen.get("error")
            assert (seen["class"], seen["is_ddp"], seen["ddp_kwargs"]) == (
                "DDPStrategy", True, {"find_unused_parameters": True})
            assert seen["ranks"] == (2, rank, rank, 0)
            assert seen["sampler"] == {"num_replicas": 2, "rank": rank}
            assert (seen["parallel_devices"], seen["device_ids"]) == (["cpu", "cpu"], [0, 1])
            assert seen["global_step"] == trainer.global_step
            ours = WithUnusedLayer()
            ours.load_state_dict(seen["state_dict"])
            assert_same_weights(reference, ours, atol=1e-6)
        # without find_unused_parameters DDP fails, and Lightning's DDPStrategy says what to set
        assert "strategy='ddp_find_unused_parameters_true'" in result["plain"]["error"]

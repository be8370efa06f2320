"""The private methods through which pytorch-accelerated 0.1.61 ran a training or evaluation run
(``_prepare_model_optimizer_and_dataloaders``, ``_create_run_config``, ``_check_eval_batch_size``,
``_run_training``, ``_run_train_epoch``, ``_run_eval_epoch``, ``_run_evaluation``): fasttrain's
``train()`` and ``evaluate()`` go through them in the original's order with the original's
arguments, so a subclass overriding one changes the run as it did there."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback

NO_WORKERS = {"num_workers": 0, "shuffle": False}


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


class Recording(Trainer):
    """Records each seam as it is entered, with the loader it was given, then runs it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _prepare_model_optimizer_and_dataloaders(self):
        self.calls.append("prepare")
        super()._prepare_model_optimizer_and_dataloaders()

    def _create_run_config(self, *args, **kwargs):
        self.calls.append("run_config")
        return super()._create_run_config(*args, **kwargs)

    def _check_eval_batch_size(self):
        # the run config is in place when the check runs, as in the original
        self.calls.append(("check_eval", self.run_config.num_epochs))
        super()._check_eval_batch_size()

    def _run_training(self):
        self.calls.append("run_training")
        super()._run_training()

    def _run_evaluation(self):
        self.calls.append("run_evaluation")
        super()._run_evaluation()

    def _run_train_epoch(self, train_dl):
        self.calls.append(("train_epoch", train_dl is self._train_dataloader))
        return super()._run_train_epoch(train_dl)

    def _run_eval_epoch(self, valid_dl, is_training=True, is_intermediate=False):
        self.calls.append(("eval_epoch", valid_dl is self._eval_dataloader, is_training))
        super()._run_eval_epoch(valid_dl, is_training, is_intermediate)


def _trainer(cls=Recording, callbacks=()):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return cls(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=list(callbacks))


def test_train_goes_through_the_seams_in_the_originals_order():
    trainer = _trainer()
    trainer.train(_data(8), 2, eval_dataset=_data(4, seed=1), per_device_batch_size=4,
                  train_dataloader_kwargs=NO_WORKERS, eval_dataloader_kwargs=NO_WORKERS)
    assert trainer.calls == [
        "prepare", "run_config", ("check_eval", 2), "run_training",
        ("train_epoch", True), ("eval_epoch", True, True),
        ("train_epoch", True), ("eval_epoch", True, True),
    ]
    # the seams ran the real epochs
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 2
    assert len(trainer.run_history.get_metric_values("eval_loss_epoch")) == 2


def test_evaluate_goes_through_the_seams_in_the_originals_order():
    trainer = _trainer()
    trainer.evaluate(_data(4, seed=1), per_device_batch_size=2, dataloader_kwargs=NO_WORKERS)
    assert trainer.calls == ["prepare", "run_config", ("check_eval", 1), "run_evaluation", ("eval_epoch", True, False)]
    assert len(trainer.run_history.get_metric_values("evaluation_loss")) == 1


def test_an_overridden_epoch_replaces_the_trainers():
    class NoEvaluation(Trainer):
        def _run_eval_epoch(self, valid_dl, is_training=True, is_intermediate=False):
            self.skipped = getattr(self, "skipped", 0) + 1

    trainer = _trainer(NoEvaluation)
    trainer.train(_data(8), 3, eval_dataset=_data(4, seed=1), per_device_batch_size=4,
                  train_dataloader_kwargs=NO_WORKERS, eval_dataloader_kwargs=NO_WORKERS)
    assert trainer.skipped == 3
    assert trainer.run_history.get_metric_names() == {"train_loss_epoch"}


def test_reaching_max_steps_in_an_epoch_ends_the_training_loop():
    trainer = _trainer()
    # 4 batches an epoch; the limit falls in the second epoch, which is the last one
    trainer.train(_data(16), 5, per_device_batch_size=4, max_num_train_steps=6, train_dataloader_kwargs=NO_WORKERS)
    assert [c for c in trainer.calls if c[0] == "train_epoch"] == [("train_epoch", True)] * 2
    assert trainer.num_updates == 6


def test_a_stop_in_an_epoch_ends_the_training_loop():
    class StopInSecondEpoch(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            if trainer.run_history.current_epoch == 2:
                from fasttrain.callbacks import StopTrainingError

                raise StopTrainingError("enough")

    trainer = _trainer(callbacks=[StopInSecondEpoch()])
    trainer.train(_data(8), 4, per_device_batch_size=4, train_dataloader_kwargs=NO_WORKERS)
    assert [c for c in trainer.calls if c[0] == "train_epoch"] == [("train_epoch", True)] * 2
    assert trainer.stop_reason == "stop_training_error"


class _FakeAccelerator:
    """What the run config reads of a prepared accelerate run on four processes."""

    num_processes = 4
    is_main_process = True
    is_local_main_process = False
    distributed_type = "MULTI_GPU"
    mixed_precision = "bf16"


def test_create_run_config_counts_per_process_and_over_all_processes():
    trainer = _trainer(Trainer)
    trainer._accelerator = _FakeAccelerator()
    trainer._train_dataloader = [None] * 20  # 20 batches on each process
    trainer._train_dl_kwargs = {"batch_size": 64}
    trainer._eval_dl_kwargs = {"batch_size": 16}
    config = trainer._create_run_config(
        per_device_batch_size=8, num_epochs=300, gradient_accumulation_steps=2,
        max_num_train_steps=None, gradient_clip_value=0.5,
    )
    assert (config.num_update_steps_per_epoch, config.num_local_update_steps_per_epoch) == (40, 10)
    assert config.max_num_train_steps == 300 * 40 + 1
    assert config.num_epochs == 300
    assert (config.train_per_device_batch_size, config.train_total_batch_size) == (64, 64 * 4 * 2)
    assert (config.eval_per_device_batch_size, config.eval_total_batch_size) == (16, 64)
    assert (config.is_distributed, config.is_world_process_zero, config.is_local_process_zero) == (True, True, False)
    assert (config.mixed_precision, config.gradient_clip_value, config.num_processes) == ("bf16", 0.5, 4)


class _Distributed:
    is_distributed = True
    eval_per_device_batch_size = 8
    num_processes = 4
    eval_total_batch_size = 32


@pytest.mark.parametrize(
    "left_over,expected", [(0, None), (23, "waits forever"), (25, "padding_value")],
    ids=["full-last-round", "a-process-without-a-batch", "a-smaller-batch"],
)
def test_check_eval_batch_size_warns_about_uneven_last_batches(recwarn, left_over, expected):
    trainer = _trainer(Trainer)
    trainer.run_config = _Distributed()
    trainer.eval_dataset = list(range(64 + left_over))
    trainer._check_eval_batch_size()
    messages = [str(w.message) for w in recwarn.list if issubclass(w.category, UserWarning)]
    if expected is None:
        assert messages == []
    else:
        assert len(messages) == 1 and expected in messages[0]


def test_check_eval_batch_size_refuses_a_set_smaller_than_one_round():
    trainer = _trainer(Trainer)
    trainer.run_config = _Distributed()
    trainer.eval_dataset = list(range(31))
    with pytest.raises(ValueError, match="lower per_device_batch_size"):
        trainer._check_eval_batch_size()


def test_check_eval_batch_size_checks_nothing_in_one_process(recwarn):
    class OneProcess(_Distributed):
        is_distributed = False

    trainer = _trainer(Trainer)
    trainer.run_config = OneProcess()
    trainer.eval_dataset = list(range(7))  # smaller than a batch: fine with one process
    trainer._check_eval_batch_size()
    assert [w for w in recwarn.list if issubclass(w.category, UserWarning)] == []

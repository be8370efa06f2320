"""Non-finite losses and gradients: Trainer(nonfinite="stop" | "skip" | "ignore")."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from tiny_run import LossRecorder  # noqa: E402

from fasttrain import Trainer, checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback, TerminateOnNaNCallback, TrainerCallback  # noqa: E402

BAD_BATCH = 2  # with 16 samples in batches of 4, no shuffle: samples 8..11


def _dataset(bad: bool = True) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    y = torch.randn(16, 4, generator=generator)
    if bad:
        x[9, 1] = float("nan")
    return TensorDataset(x, y)


class WeightWatcher(TrainerCallback):
    """Records the weights after every micro-step."""

    def __init__(self):
        self.after = []

    def on_train_step_end(self, trainer, **kwargs):
        self.after.append([p.detach().clone() for p in trainer.get_model().parameters()])


def _trainer(optimizer="sgd", callbacks=(), **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif optimizer == "fused_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    elif optimizer == "fused_sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorder = LossRecorder()
    trainer = Trainer(
        model, nn.MSELoss(), opt, callbacks=[recorder, TerminateOnNaNCallback(), *callbacks], engine="eager", **kwargs
    )
    return trainer, recorder


def _train(trainer, dataset=None, **kwargs):
    kwargs.setdefault("num_epochs", 2)
    trainer.train(
        dataset if dataset is not None else _dataset(),
        per_device_batch_size=4,
        train_dataloader_kwargs={"shuffle": False, "num_workers": 0},
        **kwargs,
    )


def _all_finite(trainer) -> bool:
    return all(torch.isfinite(p).all() for p in trainer.get_model().parameters())


# ----------------------------------------------------------------------------- stop
def test_stop_is_the_default_and_ends_at_the_next_flush():
    trainer, recorder = _trainer(log_every_n_steps=1)
    assert trainer.nonfinite == "stop"
    _train(trainer)
    assert trainer.stop_reason == "nonfinite_loss"
    assert trainer.num_updates == BAD_BATCH + 1  # the bad update was applied, then the flush stopped it
    assert trainer.run_history.get_latest_metric("stopped_nonfinite_loss") == BAD_BATCH + 1
    terminate = next(cb for cb in trainer.callback_handler if isinstance(cb, TerminateOnNaNCallback))
    assert terminate.triggered


def test_stop_without_terminate_on_nan_callback_still_stops():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[], log_every_n_steps=1)
    _train(trainer)
    assert trainer.stop_reason == "nonfinite_loss"
    assert trainer.num_updates == BAD_BATCH + 1


def test_stop_keeps_the_last_good_state(tmp_path):
    # a save every update, rotating two: the save after the bad update must not happen (its flush
    # sees the NaN first), neither the final one, and the rotation keeps the good ones
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=1, max_checkpoints=2)
    trainer, _ = _trainer(callbacks=[saver])
    _train(trainer)
    assert trainer.stop_reason == "nonfinite_loss"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
    latest = checkpointing.find_latest_training_state(tmp_path)
    assert latest == tmp_path / "step_2"
    state = torch.load(latest / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert trainer.save_training_state(tmp_path / "later") is False
    assert not (tmp_path / "later").exists()


def test_stop_on_nonfinite_gradient_with_finite_loss():
    class SqrtAtZero(Trainer):
        # d/dw sqrt(|w|) at w = 0 is infinite, times 0: a NaN gradient under a finite loss
        def calculate_train_batch_loss(self, batch):
            xb, yb = batch
            out = self.model(xb)
            loss = self.loss_func(out, yb) + 0.0 * torch.sqrt(self.model.weight.abs()).sum()
            return {"loss": loss, "model_outputs": out, "batch_size": yb.size(0)}

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[0, 0] = 0.0
    trainer = SqrtAtZero(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[], log_every_n_steps=1
    )
    _train(trainer, _dataset(bad=False), gradient_clip_norm=1.0)
    assert trainer.stop_reason == "nonfinite_gradients"
    assert trainer.num_updates == 1


def test_stop_on_nonfinite_validation_loss():
    trainer, _ = _trainer()
    _train(trainer, _dataset(bad=False), eval_dataset=_dataset(bad=True), eval_dataloader_kwargs={"num_workers": 0})
    assert trainer.stop_reason == "nonfinite_loss"
    assert trainer.run_history.current_epoch == 1


# ----------------------------------------------------------------------------- skip
@pytest.mark.parametrize(
    "optimizer, clip",
    [
        pytest.param("fused_adamw", None, id="fused-adamw-device-skip"),
        pytest.param("fused_sgd", {"gradient_clip_norm": 1.0}, id="fused-sgd-clip-norm"),
        pytest.param("sgd", None, id="sgd-host-check"),
        pytest.param("adamw", {"gradient_clip_value": 0.5}, id="adamw-clip-value"),
    ],
)
def test_skip_drops_the_bad_update_and_counts_it(optimizer, clip):
    watcher = WeightWatcher()
    trainer, recorder = _trainer(optimizer, callbacks=[watcher], nonfinite="skip")
    _train(trainer, **(clip or {}))
    assert trainer.stop_reason is None
    assert trainer.num_updates == 8
    assert trainer.skipped_updates == 2  # the bad batch, once per epoch
    assert recorder.skipped[-1] == 2  # delivered in FlushedMetrics.skipped_updates
    assert _all_finite(trainer)
    for before, after in zip(watcher.after[BAD_BATCH - 1], watcher.after[BAD_BATCH]):
        assert torch.equal(before, after)  # the bad update left every weight as it was
    assert any(math.isnan(loss) for _, _, _, loss in recorder.records)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert not hasattr(opt, "found_inf")  # detached when train() returned
    if optimizer.startswith("fused_adamw"):
        steps = {int(state["step"]) for state in opt.state.values()}
        assert steps == {6}  # the skipped steps were rolled back inside the fused kernel


def test_skip_with_fused_optimizer_never_syncs_per_step(monkeypatch):
    # .item() is how a device value reaches the host; count the calls made by fasttrain itself
    # (the data loader draws its worker seed with one per epoch, on the CPU)
    calls = []
    original_item = torch.Tensor.item

    def counting_item(self):
        if f"{os.sep}fasttrain{os.sep}" in sys._getframe(1).f_code.co_filename:
            calls.append(1)
        return original_item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    fused, _ = _trainer("fused_adamw", nonfinite="skip")
    _train(fused)
    assert len(calls) == 0
    plain, _ = _trainer("sgd", nonfinite="skip")
    _train(plain)
    assert len(calls) == 8  # the non-fused optimizer needs the flag on the host, once per update


def test_skip_then_resume_keeps_the_count(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=3, save_at_end=False)
    trainer, _ = _trainer("fused_adamw", callbacks=[saver], nonfinite="skip")
    _train(trainer)
    again, _ = _trainer("fused_adamw", nonfinite="skip")
    _train(again, resume_from=str(tmp_path / "step_6"))
    assert again.skipped_updates == trainer.skipped_updates == 2
    for a, b in zip(again.get_model().parameters(), trainer.get_model().parameters()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- ignore
def test_ignore_trains_through():
    trainer, _ = _trainer(nonfinite="ignore", log_every_n_steps=1)
    _train(trainer)
    assert trainer.stop_reason is None
    assert trainer.num_updates == 8
    assert not _all_finite(trainer)
    terminate = next(cb for cb in trainer.callback_handler if isinstance(cb, TerminateOnNaNCallback))
    assert not terminate.triggered


def test_invalid_policy_is_refused():
    with pytest.raises(ValueError, match="nonfinite must be one of 'stop', 'skip', 'ignore'"):
        Trainer(nn.Linear(1, 1), nn.MSELoss(), None, nonfinite="skip_it")


def test_processes_share_the_stop_decision():
    from types import SimpleNamespace

    from fasttrain.metrics import FlushedMetrics
    from fasttrain.nonfinite import NonFiniteGuard
    from fasttrain.progress import TrainProgress
    from fasttrain.signals import InterruptFlag
    from fasttrain.tracking import InMemoryRunHistory

    class FakeAccelerator:
        device = torch.device("cpu")

        def __init__(self, other_code):
            self.other_code = other_code

        def gather(self, tensor):  # rows: [signal, non-finite code, loss sum, samples] of each process
            other = torch.tensor([[0.0, float(self.other_code), 0.0, 0.0]], dtype=tensor.dtype)
            return torch.cat([tensor, other])

    def trainer(other_code):
        return SimpleNamespace(
            run_config=SimpleNamespace(is_distributed=True),
            _accelerator=FakeAccelerator(other_code),
            _interrupt=InterruptFlag(),
            stop_reason=None,
            run_history=InMemoryRunHistory(),
            num_updates=7,
            progress=TrainProgress(num_updates=7),
        )

    def metrics(phase, nonfinite, is_epoch_end=False):
        return FlushedMetrics(phase, 1, [0], [1.0], [1], 7, nonfinite=nonfinite, is_epoch_end=is_epoch_end)

    guard = NonFiniteGuard("stop")
    finite_here = trainer(other_code=1)  # another process saw a non-finite loss
    error = guard.check_flush(finite_here, metrics("train", nonfinite=False))
    assert error is not None and finite_here.stop_reason == "nonfinite_loss"

    # an intermediate evaluation flush is not aligned across processes: remembered, decided at
    # the end of the evaluation epoch
    quiet = trainer(other_code=0)
    assert guard.check_flush(quiet, metrics("eval", nonfinite=True)) is None
    assert guard.check_flush(quiet, metrics("eval", nonfinite=False, is_epoch_end=True)) is not None
    assert quiet.stop_reason == "nonfinite_loss" and not quiet.progress.nonfinite_applied

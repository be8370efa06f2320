"""Manual optimization (two optimizers, on the eager engine) and mixed precision through accelerate."""

import warnings

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    QUIET,
    Classifier,
    TwoOptimizerManual,
    assert_same_metrics,
    assert_same_weights,
    fit_both,
    train_loader,
)


@pytest.fixture
def fresh_accelerate_state():
    # accelerate keeps the precision in a process-wide singleton; a precision test sets its own
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def test_two_optimizer_manual_optimization_matches_lightning():
    lt, lm, ft, fm = fit_both(TwoOptimizerManual, train_loader, trainer_kwargs=dict(max_epochs=2))
    assert ft.global_step == lt.global_step == 2 * 12  # every optimizer's step counts
    assert_same_weights(lm, fm)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    assert ft.lr_scheduler_configs[0].scheduler.get_last_lr() == lt.lr_scheduler_configs[0].scheduler.get_last_lr()


def test_manual_optimization_runs_eagerly_and_says_so():
    trainer = Trainer(max_epochs=1, engine="compiled", **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoOptimizerManual(), train_loader())
    assert trainer.engine == "eager"
    assert any("automatic_optimization = False" in str(w.message) for w in caught)


def test_manual_optimization_rejects_trainer_accumulation():
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        Trainer(max_epochs=1, accumulate_grad_batches=2, **QUIET).fit(TwoOptimizerManual(), train_loader())


@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_bf16_mixed_trains_under_autocast_close_to_lightning(precision, fresh_accelerate_state):
    """bf16 autocast on the CPU: both trainers run the step under autocast; results agree to
    bf16 resolution, not bit for bit (the autocast regions differ: Lightning wraps the whole
    training_step, accelerate the forward as well)."""
    seen = []

    class Recording(Classifier):
        def training_step(self, batch, batch_idx):
            seen.append(self(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    lt, lm, ft, fm = fit_both(Recording, train_loader, trainer_kwargs=dict(max_epochs=1, precision=precision))
    assert seen[-1] == torch.bfloat16 and seen[0] == torch.bfloat16
    assert ft.global_step == lt.global_step == 6
    assert_same_weights(lm, fm, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_mixed_scales_the_loss_on_cuda(fresh_accelerate_state):
    lt, lm, ft, fm = fit_both(Classifier, train_loader, trainer_kwargs=dict(max_epochs=1, precision="16-mixed"))
    assert ft._scaler() is not None
    assert ft.global_step == lt.global_step
    assert_same_weights(lm, fm, atol=1e-2)

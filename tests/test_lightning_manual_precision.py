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


class SGDClassifier(Classifier):
    """SGD: its update is linear in the gradients, so the rounding differences of compiled fp16
    kernels stay as small in the weights as in the gradients (Adam's first updates, close to
    ``lr * sign(grad)``, turn them into differences near the learning rate wherever a gradient is
    close to zero, which says nothing about the loss scaling)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fp16_scaled_on_the_cpu(monkeypatch, init_scale):
    """Lightning's MixedPrecision and accelerate with a loss scaler on the CPU, as both have one on
    CUDA (neither makes one for the CPU): the scaling, unscaling, skipping and scale updates run
    the same code as on a GPU, under CPU fp16 autocast."""
    import fasttrain.lightning.runner as runner
    from lightning.pytorch.plugins.precision import MixedPrecision

    build = runner.build_accelerator

    def with_a_scaler(mixed_precision, **kwargs):
        accelerator = build(mixed_precision, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        accelerator.native_amp = True  # accelerate's autocast (fp16) and unscaling, as on CUDA
        return accelerator

    monkeypatch.setattr(runner, "build_accelerator", with_a_scaler)
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))


@pytest.mark.parametrize("engine, module, atol", [("eager", Classifier, 0.0), ("compiled", SGDClassifier, 1e-4)])
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**28])
def test_fp16_loss_scaling_steps_as_lightnings_amp(monkeypatch, fresh_accelerate_state, engine, module, atol, init_scale):
    # 2**28 overflows the first steps' fp16 gradients: both skip those updates and lower the scale
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = _fp16_scaled_on_the_cpu(monkeypatch, init_scale)
    options = {"engine": engine, "compile_options": {"backend": "aot_eager"} if engine == "compiled" else None}
    torch.manual_seed(0)
    lm = module()
    fm = module()
    fm.load_state_dict(lm.state_dict())
    fitted = []
    # the plugin on the CPU: fp16 autocast there is only what the plugin asks for (precision="16-mixed"
    # on the CPU is bf16-mixed in Lightning); fasttrain's is accelerate's scaler once the fit has started
    fasttrain_plugin = MixedPrecision("16-mixed", "cpu")
    for trainer in (L.Trainer(max_epochs=2, plugins=[plugin], **QUIET),
                    Trainer(max_epochs=2, plugins=[fasttrain_plugin], **options, **QUIET)):
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(lm if not fitted else fm, train_loader())
        fitted.append(trainer)
    lt, ft = fitted
    assert ft.engine == engine
    assert ft.global_step == lt.global_step == 12
    assert ft.precision == lt.precision == "16-mixed"
    assert ft.precision_plugin is fasttrain_plugin and fasttrain_plugin.scaler is ft._scaler()
    assert ft._scaler().get_scale() == lt.precision_plugin.scaler.get_scale()
    assert (ft._scaler().get_scale() < init_scale) == (init_scale > 2.0**16)  # the skips happened
    assert_same_weights(lm, fm, atol=atol)


def test_16_mixed_on_the_cpu_runs_bf16_autocast_with_lightnings_warning(fresh_accelerate_state):
    """Lightning runs precision="16-mixed" on the CPU as bf16-mixed and says so; accelerate would
    run it in full precision (it has no fp16 autocast for the CPU) while the trainer read 16-mixed."""
    import lightning as L

    seen = {}

    class Recording(Classifier):
        def training_step(self, batch, batch_idx):
            seen.setdefault(type(self.trainer).__module__, self(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    said = []
    for make in (L.Trainer, Trainer):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(accelerator="cpu", precision="16-mixed", **QUIET)
        said.append([str(w.message) for w in caught if "16-mixed" in str(w.message)])
    assert said[0] == said[1] and len(said[1]) == 1 and "Using `precision='bf16-mixed'` instead" in said[1][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lt, lm, ft, fm = fit_both(Recording, train_loader,
                                  trainer_kwargs=dict(max_epochs=1, accelerator="cpu", precision="16-mixed"))
    assert ft.precision == lt.precision == "bf16-mixed"
    assert list(seen.values()) == [torch.bfloat16, torch.bfloat16] and len(seen) == 2
    assert ft._scaler() is None
    assert_same_weights(lm, fm, atol=2e-2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_the_precision_plugin_is_lightnings_for_each_precision(precision, fresh_accelerate_state):
    import lightning as L

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lt = L.Trainer(accelerator="cpu", precision=precision, **QUIET)
        ft = Trainer(accelerator="cpu", precision=precision, **QUIET)
    assert type(ft.precision_plugin) is type(lt.precision_plugin)
    assert ft.strategy.precision_plugin is ft.precision_plugin
    for name in ("precision", "device", "scaler"):
        assert getattr(ft.precision_plugin, name, None) == getattr(lt.precision_plugin, name, None)


def test_an_fp16_plugin_accelerate_cannot_scale_is_refused_before_the_first_step(fresh_accelerate_state):
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Counting(Classifier):
        steps = 0

        def training_step(self, batch, batch_idx):
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_epochs=1, plugins=[MixedPrecision("16-mixed", "cpu")], **QUIET)
    with pytest.raises(ValueError, match="MixedPrecision\\('16-mixed'.*bf16-mixed"):
        trainer.fit(Counting(), train_loader())
    assert Counting.steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine, module, atol", [("eager", Classifier, 1e-5), ("auto", SGDClassifier, 1e-3)])
def test_fp16_mixed_scales_the_loss_on_cuda(fresh_accelerate_state, engine, module, atol):
    # the eager engine runs Lightning's kernels (equal weights); "auto" runs the compiled engine
    # (fp16 scaling keeps graphs out), whose fp16 kernels round differently: compared with SGD
    lt, lm, ft, fm = fit_both(module, train_loader, trainer_kwargs=dict(max_epochs=1, precision="16-mixed"),
                              fasttrain_kwargs=dict(engine=engine))
    assert ft._scaler() is not None
    assert ft.global_step == lt.global_step
    assert ft._scaler().get_scale() == lt.precision_plugin.scaler.get_scale()
    assert_same_weights(lm.cpu(), fm.cpu(), atol=atol)

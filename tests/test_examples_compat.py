"""pytorch-accelerated's published examples (``example_scripts``) under both libraries: the same
weights (to float32 rounding) and run histories (to 1e-7 relative) where fasttrain documents no fix."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytorch_accelerated")
pytest.importorskip("torchmetrics")

import differential_scripts as ds  # noqa: E402
import example_scripts as ex  # noqa: E402

REL = 1e-7


def assert_weights_equal(a, b):
    # float32 weights: a few units in the last place apart where the two libraries sum in a
    # different order (batch-norm statistics)
    ds.weights_close(a, b, rtol=1e-6, atol=1e-7)


def assert_histories_equal(a: dict, b: dict, train_loss_factor: float = 1.0):
    assert sorted(a) == sorted(b)
    for name in a:
        expected = a[name]
        if name == "train_loss_epoch":
            expected = [v * train_loss_factor for v in expected]
        assert len(b[name]) == len(expected), name
        for x, y in zip(expected, b[name]):
            if isinstance(x, dict):
                assert x == pytest.approx(y, rel=REL), name
            else:
                assert y == pytest.approx(x, rel=REL), name


def run_both(original, ours, example, *args):
    return example(original, *args), example(ours, *args)


def test_mnist(original, ours):
    (wa, ha, _), (wb, hb, _) = run_both(original, ours, ex.example_mnist)
    assert_weights_equal(wa, wb)
    for a, b in zip(ha, hb):
        assert_histories_equal(a, b)
    assert sorted(hb[1]) == ["evaluation_loss"] and len(hb[0]["eval_loss_epoch"]) == 2


def test_custom_callback_event(original, ours):
    (wa, ha, ea), (wb, hb, eb) = run_both(original, ours, ex.example_custom_callback_event)
    assert_weights_equal(wa, wb)
    assert_histories_equal(ha[0], hb[0])
    # 44 samples, batches of 8 with drop_last: 5 verified batches per epoch
    assert eb["verified"] == ea["verified"] == [(8, 1, 6, 6)] * 10


@pytest.mark.parametrize("example", [ex.example_metrics_in_callback, ex.example_metrics_in_loop])
def test_torchmetrics(original, ours, example):
    (wa, ha, _), (wb, hb, _) = run_both(original, ours, example)
    assert_weights_equal(wa, wb)
    for a, b in zip(ha, hb):
        assert_histories_equal(a, b)
    assert sorted(hb[0]) == ["accuracy", "eval_loss_epoch", "precision", "recall", "train_loss_epoch"]
    assert len(hb[0]["accuracy"]) == 2
    assert sorted(hb[1]) == ["accuracy", "evaluation_loss", "precision", "recall"]


def test_loss_func_none_with_accumulation(original, ours):
    (wa, ha, ea), (wb, hb, eb) = run_both(original, ours, ex.example_hf_loss_func_none)
    assert_weights_equal(wa, wb)
    # the original reports train_loss_epoch divided by the accumulation steps (docs/migrating.md)
    assert_histories_equal(ha[0], hb[0], train_loss_factor=2)
    assert eb["lrs"] == pytest.approx(ea["lrs"], rel=REL)
    assert [m["accuracy"] for m in hb[0]["metrics"]] == pytest.approx([m["accuracy"] for m in ha[0]["metrics"]])


def test_pets_finetuning_with_a_second_train(original, ours):
    (wa, ha, ea), (wb, hb, eb) = run_both(original, ours, ex.example_pets_finetune)
    assert_weights_equal(wa, wb)
    assert eb == ea
    assert eb["frozen_after_first"] == ["backbone.0.bias", "backbone.0.weight"]  # batch norm kept
    # fasttrain's one trainer holds both stages; the original's stages are joined
    assert_histories_equal(ex.merged_history(ha), hb[1])
    assert len(hb[1]["eval_loss_epoch"]) == 5


def test_progressive_resizing(original, ours, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    wa, ha, ea = ex.example_progressive_resizing(original, str(tmp_path / "a" / "best.pt"))
    wb, hb, eb = ex.example_progressive_resizing(ours, str(tmp_path / "b" / "best.pt"))
    assert_weights_equal(wa, wb)
    assert_histories_equal(ex.merged_history(ha), hb[-1])
    assert eb["devices"] == ea["devices"] == ["cpu"] * 3
    best_a = torch.load(tmp_path / "a" / "best.pt", weights_only=True)["model_state_dict"]
    best_b = torch.load(tmp_path / "b" / "best.pt", weights_only=True)["model_state_dict"]
    assert_weights_equal(best_a, best_b)


def test_mixup_and_ema(original, ours):
    (wa, ha, ea), (wb, hb, eb) = run_both(original, ours, ex.example_mixup_ema)
    assert_weights_equal(wa, wb)
    assert_weights_equal(ea["ema"], eb["ema"])
    assert eb["calls"] == ea["calls"]
    assert_histories_equal(ha[0], hb[0])
    assert sorted(hb[0]) == ["accuracy", "ema_model_accuracy", "eval_loss_epoch", "train_loss_epoch"]


def test_timm_components(original, ours):
    timm = pytest.importorskip("timm")
    results = []
    for lib in (original, ours):
        model = ex._initial(ex.MNISTLikeModel)
        trainer = lib.trainer.TrainerWithTimmScheduler(
            model,
            loss_func=timm.loss.LabelSmoothingCrossEntropy(smoothing=0.1),
            optimizer=timm.optim.create_optimizer_v2(model, opt="adamw", lr=0.01),
            callbacks=lib.callbacks.get_default_callbacks(progress_bar=False),
            **lib.trainer_kwargs,
        )
        trainer.train(
            train_dataset=ex.image_data(40, seed=0),
            eval_dataset=ex.image_data(16, seed=1),
            num_epochs=2,
            per_device_batch_size=8,
            create_scheduler_fn=lambda optimizer: timm.scheduler.CosineLRScheduler(optimizer, t_initial=2),
            train_dataloader_kwargs=dict(ds.NO_WORKERS),
            eval_dataloader_kwargs=dict(ds.NO_WORKERS),
        )
        results.append((ex._weights(trainer.get_model()), ds.history_of(trainer)))
    (wa, ha), (wb, hb) = results
    assert_weights_equal(wa, wb)
    assert_histories_equal(ha, hb)

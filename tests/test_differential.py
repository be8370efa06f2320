"""The same training scripts under pytorch-accelerated 0.1.61 and fasttrain.

Each test runs a script of ``differential_scripts`` under both libraries and compares final
weights (relative 1e-5), run history values and the order of the callback events. Where fasttrain
deliberately differs (docs/migrating.md), the test asserts the documented relation instead of
equality.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("pytorch_accelerated")

import differential_scripts as ds  # noqa: E402


def assert_history_close(a: dict, b: dict, rel=1e-5):
    assert sorted(a) == sorted(b)
    for name in a:
        assert len(a[name]) == len(b[name]), name
        assert a[name] == pytest.approx(b[name], rel=rel), name


def assert_same_run(a: ds.Outcome, b: ds.Outcome, accumulation: int = 1):
    """Equal weights, run history, events and optimizer steps. With gradient accumulation the
    original's train_loss_epoch is divided by the accumulation steps (a documented fix)."""
    ds.weights_close(a.weights, b.weights)
    history_a = dict(a.history)
    if "train_loss_epoch" in history_a:
        history_a["train_loss_epoch"] = [v * accumulation for v in history_a["train_loss_epoch"]]
    assert_history_close(history_a, b.history)
    assert a.events == b.events
    assert a.extra["num_optimizer_steps"] == b.extra["num_optimizer_steps"]


def expected_epoch_events(num_train_batches, num_eval_batches):
    events = ["on_train_epoch_start"]
    events += ["on_train_step_start", "on_train_step_end"] * num_train_batches
    events += ["on_train_epoch_end"]
    if num_eval_batches:
        events += ["on_eval_epoch_start"]
        events += ["on_eval_step_start", "on_eval_step_end"] * num_eval_batches
        events += ["on_eval_epoch_end"]
    return events + ["on_training_run_epoch_end"]


# ----------------------------------------------------------------------------- plain training
def test_plain_training_with_eval_matches(original, ours):
    a = ds.script_plain(original)
    b = ds.script_plain(ours)
    assert_same_run(a, b)
    # 52 samples in batches of 8: 7 train batches; 20 eval samples: 3 eval batches
    expected = ["on_init_end", "on_training_run_start"]
    expected += expected_epoch_events(7, 3) * 3
    expected += ["on_training_run_end"]
    assert b.events == expected
    assert b.extra["num_optimizer_steps"] == 21
    assert len(b.history["train_loss_epoch"]) == len(b.history["eval_loss_epoch"]) == 3


def test_shuffle_and_dropout_are_seeded_identically(ours):
    """The comparison above is meaningful: without shuffling the result changes, so both
    libraries drew the same permutation (and the same dropout masks) from the seed."""
    shuffled = ds.script_plain(ours, shuffle=True)
    unshuffled = ds.script_plain(ours, shuffle=False)
    assert not torch.allclose(shuffled.weights["head.weight"], unshuffled.weights["head.weight"])
    again = ds.script_plain(ours, shuffle=True)
    ds.weights_close(shuffled.weights, again.weights, rtol=0, atol=0)


# ----------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("steps", [2, 3])
def test_gradient_accumulation_matches(original, ours, steps):
    a = ds.script_accumulation(original, steps)
    b = ds.script_accumulation(ours, steps)
    ds.weights_close(a.weights, b.weights)
    assert a.events == b.events
    assert a.history["eval_loss_epoch"] == pytest.approx(b.history["eval_loss_epoch"], rel=1e-5)
    # documented fix: the original reports the epoch loss divided by the accumulation steps
    assert b.history["train_loss_epoch"] == pytest.approx(
        [v * steps for v in a.history["train_loss_epoch"]], rel=1e-5
    )
    # 7 batches per epoch: ceil(7 / steps) updates, the last window being short
    assert a.extra["num_optimizer_steps"] == b.extra["num_optimizer_steps"] == 3 * math.ceil(7 / steps)


def _one_update_with_value_clipping(lib, clip):
    """One optimizer update from two micro-batches of one sample each (SGD, lr=1), clipped by
    value; returns the weight change."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    start = model.weight.detach().clone()
    x = torch.tensor([[1.0, 2.0, -1.0], [-3.0, 0.5, 2.0]])
    y = torch.tensor([[4.0], [-2.0]])
    trainer = lib.Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=1.0), callbacks=(), **lib.trainer_kwargs
    )
    trainer.train(
        torch.utils.data.TensorDataset(x, y),
        num_epochs=1,
        per_device_batch_size=1,
        gradient_accumulation_steps=2,
        gradient_clip_value=clip,
        train_dataloader_kwargs={"shuffle": False, "num_workers": 0},
    )
    return start, trainer.get_model().weight.detach() - start, (x, y)


def test_clipping_happens_once_per_update_with_accumulation(original, ours, monkeypatch):
    clip = 1.0
    start, delta_ours, (x, y) = _one_update_with_value_clipping(ours, clip)
    _, delta_original, _ = _one_update_with_value_clipping(original, clip)
    # independent expectations from the per-sample gradients of the halved losses
    grads = []
    for i in range(2):
        w = start.clone().requires_grad_(True)
        (((x[i : i + 1] @ w.T - y[i : i + 1]) ** 2).mean() / 2).backward()
        grads.append(w.grad)
    once = -(grads[0] + grads[1]).clamp(-clip, clip)
    per_micro_step = -(grads[0].clamp(-clip, clip) + grads[1]).clamp(-clip, clip)
    assert not torch.allclose(once, per_micro_step)  # the data tell the two apart
    torch.testing.assert_close(delta_ours, once)
    torch.testing.assert_close(delta_original, per_micro_step)

    # and the clipping kernel runs once per update: 7 batches, 3 micro-steps -> 3 updates
    from fasttrain import kernels

    calls = []
    real = kernels.clip_grad_value_

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "clip_grad_value_", counting)
    model = ds.make_model()
    trainer = ours.Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=(), seed=42
    )
    trainer.train(**ds.train_kwargs(num_epochs=1, eval_dataset=None, gradient_accumulation_steps=3, gradient_clip_value=0.1))
    assert len(calls) == 3


def test_value_clipping_matches(original, ours):
    a = ds.script_clip_value(original)
    b = ds.script_clip_value(ours)
    assert_same_run(a, b)
    unclipped = ds.script_clip_value(ours, clip=None)  # the clip changes the result
    assert not torch.allclose(unclipped.weights["head.weight"], b.weights["head.weight"])


# ----------------------------------------------------------------------------- schedulers
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_one_cycle_with_placeholders_matches(original, ours, engine):
    a = ds.script_one_cycle(original)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if engine == "eager":
            b = ds.script_one_cycle(ours, engine="eager")
        else:
            b = ds.script_one_cycle(ours, engine="compiled", compile_options={"backend": "aot_eager"})
    if engine == "eager":
        assert_same_run(a, b, accumulation=2)
    else:
        # compiled kernels round differently from eager: weights and losses to 1e-4, the rest equal
        ds.weights_close(a.weights, b.weights)
        history_a = dict(a.history, train_loss_epoch=[v * 2 for v in a.history["train_loss_epoch"]])
        assert_history_close(history_a, b.history, rel=1e-4)
        assert a.events == b.events and a.extra["num_optimizer_steps"] == b.extra["num_optimizer_steps"]
    # the learning rates the groups show after each scheduler step are the scheduler's floats
    assert a.extra["lrs"] == b.extra["lrs"]
    # 7 batches, 2 micro-steps per update: 4 updates per epoch, 3 epochs
    assert (b.extra["num_epochs"], b.extra["updates_per_epoch"], b.extra["total_steps"]) == (3, 4, 12)
    assert a.extra["total_steps"] == 12
    assert len(b.extra["lrs"]) == 12
    assert max(b.extra["lrs"]) == pytest.approx(0.1, rel=0.01)
    # fasttrain steps the optimizer before the scheduler, and torch can tell
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lr_scheduler.step()" in m], messages


@pytest.mark.parametrize(
    "factory_kwargs, accumulation",
    [({}, 1), ({"k_decay": 2.0, "num_cooldown_epochs": 1}, 2)],
    ids=["plain", "k_decay-cooldown-accumulation"],
)
def test_cosine_without_warmup_matches(original, ours, factory_kwargs, accumulation):
    factory = ds.cosine_factory(0, **factory_kwargs)
    a = ds.run_scheduler_script(original, factory, accumulation=accumulation)
    b = ds.run_scheduler_script(ours, factory, accumulation=accumulation)
    assert_same_run(a, b, accumulation)
    assert a.extra["lrs"] == pytest.approx(b.extra["lrs"], rel=1e-9, abs=1e-12)
    updates = b.extra["updates_per_epoch"] * 4
    expected = ds.expected_cosine_lrs(
        0.1, 1e-3, 1e-3, updates, 0, cooldown=b.extra["updates_per_epoch"] * factory_kwargs.get("num_cooldown_epochs", 0),
        k=factory_kwargs.get("k_decay", 1.0),
    )
    assert b.extra["lrs"] == pytest.approx(expected, rel=1e-9)


def test_cosine_with_warmup_uses_the_corrected_schedule(original, ours):
    factory = ds.cosine_factory(num_warmup_epochs=1)
    a = ds.run_scheduler_script(original, factory)
    b = ds.run_scheduler_script(ours, factory)
    assert a.events == b.events
    per_epoch = b.extra["updates_per_epoch"]
    total, warmup = 4 * per_epoch, per_epoch
    expected = ds.expected_cosine_lrs(0.1, 1e-3, 1e-3, total, warmup)
    assert b.extra["lrs"] == pytest.approx(expected, rel=1e-9)
    # the cosine phase lasts its full length: the last value is still above the minimum
    assert b.extra["lrs"][-1] > 1e-3 * 1.1
    # the original agrees until its cosine phase ends `warmup` updates early, then sits at lr_min
    assert a.extra["lrs"][: total - warmup] == pytest.approx(expected[: total - warmup], rel=1e-9)
    assert a.extra["lrs"][total - warmup :] == pytest.approx([1e-3] * warmup)
    assert not torch.allclose(a.weights["head.weight"], b.weights["head.weight"])


@pytest.mark.parametrize(
    "factory_kwargs, accumulation",
    [
        ({"num_warmup_epochs": 1, "decay_phase_ratio": 0.3, "num_checkpoints": 2}, 1),
        ({"decay_phase_ratio": 0.25, "lr_min": 0.01, "use_inverse_sqrt_decay": False}, 2),
        ({"decay_phase_ratio": 0.25, "lr_min": 0.01}, 1),
    ],
    ids=["warmup-2-checkpoints", "sqrt-accumulation", "inverse-sqrt"],
)
def test_wsd_matches(original, ours, factory_kwargs, accumulation):
    factory = ds.wsd_factory(**factory_kwargs)
    a = ds.run_scheduler_script(original, factory, accumulation=accumulation)
    b = ds.run_scheduler_script(ours, factory, accumulation=accumulation)
    assert_same_run(a, b, accumulation)
    assert a.extra["lrs"] == pytest.approx(b.extra["lrs"], rel=1e-9, abs=1e-12)
    lrs = b.extra["lrs"]
    assert len(lrs) == 4 * b.extra["updates_per_epoch"]
    assert max(lrs) == pytest.approx(0.1) and lrs[-1] < 0.1  # a stable phase, then a decay


# ----------------------------------------------------------------------------- run control
@pytest.mark.parametrize("max_steps, accumulation", [(10, 1), (5, 2)])
def test_max_num_train_steps_matches(original, ours, max_steps, accumulation):
    a = ds.script_max_steps(original, max_steps, accumulation)
    b = ds.script_max_steps(ours, max_steps, accumulation)
    ds.weights_close(a.weights, b.weights)
    assert a.events == b.events
    assert a.history["eval_loss_epoch"] == pytest.approx(b.history["eval_loss_epoch"], rel=1e-5)
    assert b.extra["num_optimizer_steps"] == a.extra["num_optimizer_steps"] == max_steps
    assert b.extra["num_epochs"] == a.extra["num_epochs"] == 2
    # the second epoch stops after the update that reaches the limit
    updates_first_epoch = math.ceil(7 / accumulation)
    steps_second = (max_steps - updates_first_epoch) * accumulation
    second = b.events[b.events.index("on_training_run_epoch_end") + 1 :]
    assert second.count("on_train_step_end") == steps_second
    assert second[-1] == "on_training_run_end"


def test_evaluate_matches(original, ours):
    a = ds.script_evaluate(original)
    b = ds.script_evaluate(ours)
    assert_same_run(a, b)
    assert list(b.history) == ["evaluation_loss"]
    # 20 samples in batches of 6: 4 batches
    assert b.events == (
        ["on_evaluation_run_start", "on_eval_epoch_start"]
        + ["on_eval_step_start", "on_eval_step_end"] * 4
        + ["on_eval_epoch_end", "on_evaluation_run_end"]
    )


def test_save_best_model_and_early_stopping_match(original, ours, tmp_path):
    a = ds.script_save_best_and_early_stopping(original, str(tmp_path / "original.pt"))
    b = ds.script_save_best_and_early_stopping(ours, str(tmp_path / "ours.pt"))
    assert_same_run(a, b)
    epochs_run = len(b.history["eval_loss_epoch"])
    assert epochs_run < 30  # early stopping ended the run
    assert b.events.count("on_stop_training_error") == 1
    assert b.events[-2:] == ["on_stop_training_error", "on_training_run_end"]
    eval_losses = b.history["eval_loss_epoch"]
    best_epoch = eval_losses.index(min(eval_losses)) + 1
    assert b.extra["best_metric_epoch"] == a.extra["best_metric_epoch"] == best_epoch
    assert best_epoch < epochs_run  # the best model is not the last one: loading it matters
    assert b.extra["best_metric"] == pytest.approx(a.extra["best_metric"], rel=1e-5)
    assert b.extra["saved_metric"] == pytest.approx(min(eval_losses), rel=1e-6)
    assert a.extra["saved_metric"] == pytest.approx(b.extra["saved_metric"], rel=1e-5)
    # the final weights are the saved best ones
    ds.weights_close(b.weights, b.extra["saved_weights"], rtol=0, atol=0)
    ds.weights_close(a.extra["saved_weights"], b.extra["saved_weights"])
    # patience 2: stopped two epochs after the best one
    assert epochs_run == best_epoch + 2
    assert b.extra["patience_counter"] == a.extra["patience_counter"] == 2


def test_custom_event_from_a_hook_matches(original, ours):
    a = ds.script_custom_event(original)
    b = ds.script_custom_event(ours)
    assert_same_run(a, b)
    assert b.extra["my_event_payloads"] == a.extra["my_event_payloads"] == [{"epoch": 1}, {"epoch": 2}]
    # fired from the train_epoch_end hook: after the last step, before on_train_epoch_end
    for i, event in enumerate(b.events):
        if event == "my_event":
            assert b.events[i - 1] == "on_train_step_end"
            assert b.events[i + 1] == "on_train_epoch_end"
    assert b.events.count("my_event") == 2


# ----------------------------------------------------------------------------- fine-tuning
def test_finetuning_with_model_freezer_matches(original, ours):
    # The original's second train() on the same trainer stops early (see below), so its
    # reference for the second phase runs in a fresh trainer on the same model and optimizer.
    a = ds.script_finetuning(original, fresh_trainer_for_second_phase=True)
    b = ds.script_finetuning(ours)
    first_a, first_b = a.extra["first_phase"], b.extra["first_phase"]
    assert_same_run(first_a, first_b)
    assert b.extra["trainable_first"] == a.extra["trainable_first"] == ["head.weight", "head.bias"]
    # the frozen body did not move in the first phase
    ds.weights_close(
        {k: v for k, v in first_b.weights.items() if k.startswith("body")},
        {k: v for k, v in ds.make_model().state_dict().items() if k.startswith("body")},
        rtol=0,
        atol=0,
    )
    assert b.extra["unfrozen_groups"] == a.extra["unfrozen_groups"] == [0]
    assert b.extra["unfrozen_names"] == a.extra["unfrozen_names"] == ["body.0.bias", "body.0.weight"]
    # second phase: same weights, same eval losses; fasttrain appends to the run history
    ds.weights_close(a.weights, b.weights)
    assert b.extra["num_optimizer_steps"] == 2 * 14  # counted over both phases
    assert a.extra["num_optimizer_steps"] == 14
    assert b.history["eval_loss_epoch"][:2] == first_b.history["eval_loss_epoch"]
    assert b.history["eval_loss_epoch"][2:] == pytest.approx(a.history["eval_loss_epoch"], rel=1e-5)
    assert b.history["train_loss_epoch"][2:] == pytest.approx(a.history["train_loss_epoch"], rel=1e-5)
    assert len(b.history["train_loss_epoch"]) == 4
    assert b.events[len(first_b.events) :] == a.events[1:]  # the same run, without on_init_end


def test_second_train_with_kept_history_runs_all_its_epochs(original, ours):
    """Not listed as a fixed defect: the original derives its update limit from the run
    history's epoch, so a second train() with reset_run_history=False stops after one update."""
    a = ds.script_finetuning(original)
    b = ds.script_finetuning(ours)
    assert a.extra["num_optimizer_steps"] - 14 == 1
    assert b.extra["num_optimizer_steps"] - 14 == 14
    assert len(b.history["eval_loss_epoch"]) == 4
    assert len(a.history["eval_loss_epoch"]) == 3


@pytest.mark.parametrize("max_steps", [None, 10])
def test_trainer_subclass_keeping_its_own_num_updates_matches(original, ours, max_steps):
    """pytorch-accelerated's TrainerWithTimmScheduler pattern: the subclass assigns
    ``self.num_updates``, which must neither fail nor disturb fasttrain's own update count."""
    a = ds.script_timm_subclass(original, max_steps)
    b = ds.script_timm_subclass(ours, max_steps)
    ds.weights_close(a.weights, b.weights)
    assert_history_close(a.history, b.history)
    assert a.events == b.events
    assert b.extra["calls"] == a.extra["calls"]
    assert b.extra["num_updates"] == a.extra["num_updates"]
    updates = [n for kind, n in b.extra["calls"] if kind == "step_update"]
    # 7 batches per epoch; the subclass restarts its count at epoch * 7 every epoch
    expected = [7 * e + i for e in (1, 2, 3) for i in range(1, 8)]
    assert updates == (expected if max_steps is None else expected[:max_steps])
    assert [n for kind, n in b.extra["calls"] if kind == "step"] == ([2, 3, 4] if max_steps is None else [2, 3])


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_a_subclass_clipping_in_its_own_clip_gradients_matches(original, ours, engine):
    # the original's seam for how gradients are clipped: fasttrain calls it once per update
    a = ds.script_own_clipping(original)
    b = ds.script_own_clipping(ours, engine=engine, compile_options={"backend": "aot_eager"} if engine == "compiled" else None)
    assert b.extra["clip_calls"] == a.extra["clip_calls"] == a.extra["num_optimizer_steps"] == 21
    if engine == "eager":
        assert_same_run(a, b)
    else:
        ds.weights_close(a.weights, b.weights)
    by_value = ds.script_clip_value(ours, clip=1.0)  # what the default clipping gives
    assert not torch.allclose(by_value.weights["head.weight"], b.weights["head.weight"])

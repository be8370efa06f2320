"""Schedulers: values against pytorch-accelerated 0.1.61, the cosine fix, tensor learning rates."""

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fasttrain.placeholders import resolve_placeholders
from fasttrain.schedulers import (
    CosineLrScheduler,
    SchedulerBase,
    StatefulSchedulerBase,
    WSDLrScheduler,
    estimate_checkpoint_steps,
    set_param_group_value,
)

BASE_LRS = (0.1, 0.003)


def make_optimizer(lrs=BASE_LRS, tensor_lr=False):
    groups = []
    for lr in lrs:
        groups.append(
            {
                "params": [torch.nn.Parameter(torch.zeros(2))],
                "lr": torch.tensor(lr, dtype=torch.float64) if tensor_lr else lr,
            }
        )
    return torch.optim.SGD(groups, lr=0.5)


def lrs_of(optimizer):
    return [float(group["lr"]) for group in optimizer.param_groups]


def steps_of(scheduler, optimizer, num_steps):
    """The learning rates after each of ``num_steps`` more steps."""
    values = []
    for _ in range(num_steps):
        scheduler.step()
        values.append(lrs_of(optimizer))
    return values


def trace(cls, num_steps, **kwargs):
    """The learning rates after construction and after each of ``num_steps`` steps."""
    optimizer = make_optimizer()
    scheduler = cls(optimizer, **kwargs)
    return [lrs_of(optimizer)] + steps_of(scheduler, optimizer, num_steps)


def state_after(cls, num_steps, **kwargs):
    """The state_dict of a ``cls`` scheduler after ``num_steps`` steps, and its optimizer."""
    optimizer = make_optimizer()
    scheduler = cls(optimizer, **kwargs)
    for _ in range(num_steps):
        scheduler.step()
    return scheduler.state_dict(), optimizer


def flat(rows):
    return [value for row in rows for value in row]


def assert_close_lists(ours, theirs, rel=1e-6, skip=()):
    assert len(ours) == len(theirs)
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if index in skip:
            continue
        assert a == pytest.approx(b, rel=rel, abs=1e-15), f"differs at trace index {index}"


# --- cosine ---------------------------------------------------------------------------------

COSINE_CONFIGS = [
    dict(total_num_epochs=10, num_update_steps_per_epoch=7),
    dict(total_num_epochs=6, num_update_steps_per_epoch=5, num_cooldown_epochs=2),
    dict(total_num_epochs=8, num_update_steps_per_epoch=3, k_decay=2.0, lr_min=1e-4),
    dict(total_num_epochs=8, num_update_steps_per_epoch=3, k_decay=0.5, min_lr_ratio=0.05),
    dict(total_num_epochs=10, num_update_steps_per_epoch=4, num_warmup_epochs=2),
    dict(
        total_num_epochs=12,
        num_update_steps_per_epoch=5,
        num_warmup_epochs=3,
        num_cooldown_epochs=2,
        warmup_starting_lr_ratio=0.1,
        min_lr_ratio=0.01,
    ),
    dict(
        total_num_epochs=9,
        num_update_steps_per_epoch=2,
        num_warmup_epochs=1,
        warmup_starting_lr=1e-4,
        k_decay=1.5,
        num_cooldown_epochs=1,
    ),
]


def cosine_defect_indices(config):
    """Trace indices where pytorch-accelerated has already jumped to the minimum.

    Trace index i holds the value for ``i - 1`` completed updates (the first ``step()`` applies
    update count 0).
    """
    per_epoch = config["num_update_steps_per_epoch"]
    total = config["total_num_epochs"] * per_epoch
    warmup = config.get("num_warmup_epochs", 0) * per_epoch
    cooldown = config.get("num_cooldown_epochs", 0) * per_epoch
    return {n + 1 for n in range(total - warmup - cooldown, total - cooldown)}


@pytest.mark.parametrize("config", COSINE_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_cosine_matches_original_outside_the_defect(config):
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    total = config["total_num_epochs"] * config["num_update_steps_per_epoch"]
    steps = total + 5  # a few steps past the end hold the minimum
    ours = trace(CosineLrScheduler, steps, **config)
    theirs = trace(original.CosineLrScheduler, steps, **config)
    defect = cosine_defect_indices(config)
    assert_close_lists(ours, theirs, skip=defect)


def cosine_value(lr_max, lr_min, t, length, k=1.0):
    return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * t**k / length**k))


def test_cosine_phase_ends_at_the_end_of_the_schedule_unlike_the_original():
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    config = dict(
        total_num_epochs=10, num_update_steps_per_epoch=4, num_warmup_epochs=2, lr_min=1e-5
    )
    total, warmup = 40, 8
    length = total - warmup
    ours = trace(CosineLrScheduler, total + 1, **config)
    theirs = trace(original.CosineLrScheduler, total + 1, **config)

    last_cosine_update = warmup + length - 1  # trace index is update count + 1
    expected = [cosine_value(lr, 1e-5, length - 1, length) for lr in BASE_LRS]
    assert ours[last_cosine_update + 1] == pytest.approx(expected, rel=1e-9)
    assert ours[last_cosine_update + 1][0] > 1e-5 * 1.01
    assert ours[total + 1] == pytest.approx([1e-5, 1e-5])
    # The original reaches the minimum `warmup` updates early.
    assert theirs[last_cosine_update + 1] == pytest.approx([1e-5, 1e-5])
    assert theirs[total - warmup + 1] == pytest.approx([1e-5, 1e-5])
    # Midway through the cosine, the learning rate is halfway between maximum and minimum.
    assert ours[warmup + length // 2 + 1][0] == pytest.approx((0.1 + 1e-5) / 2, rel=1e-9)


def test_cosine_construction_writes_warmup_start_and_first_step_is_update_zero():
    optimizer = make_optimizer()
    scheduler = CosineLrScheduler(
        optimizer, total_num_epochs=4, num_update_steps_per_epoch=5, num_warmup_epochs=1,
        warmup_starting_lr=1e-3,
    )
    assert lrs_of(optimizer) == [1e-3, 1e-3]
    scheduler.step()
    assert scheduler._num_updates == 0
    assert lrs_of(optimizer) == pytest.approx([1e-3, 1e-3])
    scheduler.step_update(5)  # explicit count, internal count untouched
    assert lrs_of(optimizer) == pytest.approx(list(BASE_LRS))
    assert scheduler._num_updates == 0


cosine_settings = st.fixed_dictionaries(
    {
        "total_num_epochs": st.integers(1, 12),
        "num_update_steps_per_epoch": st.integers(1, 9),
        "k_decay": st.sampled_from([0.5, 1.0, 1.7, 3.0]),
        "lr_min": st.sampled_from([0.0, 1e-6, 1e-4]),
        "warmup_epochs": st.integers(0, 3),
        "cooldown_epochs": st.integers(0, 3),
    }
)


@settings(max_examples=60, deadline=None, database=None)
@given(cosine_settings)
def test_cosine_is_monotone_in_each_phase_and_bounded(s):
    warmup_epochs = min(s["warmup_epochs"], s["total_num_epochs"])
    cooldown_epochs = min(s["cooldown_epochs"], s["total_num_epochs"] - warmup_epochs)
    per_epoch = s["num_update_steps_per_epoch"]
    total = s["total_num_epochs"] * per_epoch
    warmup, cooldown = warmup_epochs * per_epoch, cooldown_epochs * per_epoch
    optimizer = make_optimizer()
    scheduler = CosineLrScheduler(
        optimizer,
        total_num_epochs=s["total_num_epochs"],
        num_update_steps_per_epoch=per_epoch,
        k_decay=s["k_decay"],
        lr_min=s["lr_min"],
        num_warmup_epochs=warmup_epochs,
        num_cooldown_epochs=cooldown_epochs,
    )
    values = [scheduler.get_updated_values(n)[0] for n in range(total + 3)]
    lr_max = BASE_LRS[0]
    lowest = min(s["lr_min"], 1e-6)  # warmup starts at warmup_starting_lr=1e-6
    assert all(lowest - 1e-12 <= v <= lr_max + 1e-12 for v in values)
    assert all(a <= b for a, b in zip(values[:warmup], values[1:warmup]))
    cosine = values[warmup : total - cooldown]
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))
    if cosine:
        assert cosine[0] == pytest.approx(lr_max)
    assert values[total - cooldown :] == pytest.approx([s["lr_min"]] * (cooldown + 3))


@settings(max_examples=40, deadline=None, database=None)
@given(cosine_settings, st.sampled_from([None, 0.01, 0.2]), st.sampled_from([None, 0.05]))
def test_cosine_matches_original_for_random_settings(s, warmup_ratio, min_ratio):
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    config = dict(
        total_num_epochs=s["total_num_epochs"],
        num_update_steps_per_epoch=s["num_update_steps_per_epoch"],
        k_decay=s["k_decay"],
        lr_min=s["lr_min"],
        num_warmup_epochs=s["warmup_epochs"],
        num_cooldown_epochs=s["cooldown_epochs"],
        warmup_starting_lr_ratio=warmup_ratio,
        min_lr_ratio=min_ratio,
    )
    steps = config["total_num_epochs"] * config["num_update_steps_per_epoch"] + 2
    ours = trace(CosineLrScheduler, steps, **config)
    theirs = trace(original.CosineLrScheduler, steps, **config)
    assert_close_lists(ours, theirs, skip=cosine_defect_indices(config))


def test_cosine_state_dict_resumes_the_schedule():
    config = dict(total_num_epochs=5, num_update_steps_per_epoch=4, num_warmup_epochs=1)
    uninterrupted = trace(CosineLrScheduler, 20, **config)
    state, optimizer = state_after(CosineLrScheduler, 7, **config)
    assert all(isinstance(v, (int, float, type(None))) for v in state.values())
    second = CosineLrScheduler(optimizer, **config)
    second.load_state_dict(state)
    assert flat(steps_of(second, optimizer, 13)) == pytest.approx(flat(uninterrupted[8:]))


def test_cosine_rejects_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        CosineLrScheduler(make_optimizer(), total_num_epochs=0, num_update_steps_per_epoch=3)
    with pytest.raises(ValueError, match="lr_min"):
        CosineLrScheduler(make_optimizer(), 2, 3, lr_min=-1.0)


def test_cosine_factory_resolves_like_the_original():
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    ours = CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1, k_decay=2.0)
    theirs = original.CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1, k_decay=2.0)
    assert ours.keywords.keys() == theirs.keywords.keys()
    values = {"NUM_EPOCHS": 6, "NUM_UPDATE_STEPS_PER_EPOCH": 4}
    scheduler = resolve_placeholders(ours, values)(make_optimizer())
    assert scheduler.total_iterations == 24 and scheduler.warmup_iterations == 4


# --- WSD ------------------------------------------------------------------------------------

WSD_CONFIGS = [
    dict(total_steps=100),
    dict(total_steps=100, num_warmup_steps=None),
    dict(total_steps=200, num_warmup_steps=10, decay_phase_ratio=0.2, num_checkpoints=3),
    dict(total_steps=200, num_warmup_steps=5, num_checkpoints=2, use_inverse_sqrt_decay=False),
    dict(total_steps=400, num_checkpoints=4, lr_min=0.01, decay_phase_ratio=0.3),
    dict(num_epochs=8, num_update_steps_per_epoch=13, num_warmup_steps=13, lr_min=0.1,
         use_inverse_sqrt_decay=False, warmup_starting_lr=1e-4),
    dict(total_steps=37, num_warmup_steps=3, decay_phase_ratio=1.0),
]


def wsd_total(config):
    if "total_steps" in config:
        return config["total_steps"]
    return config["num_epochs"] * config["num_update_steps_per_epoch"]


@pytest.mark.parametrize("config", WSD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_wsd_matches_original(config):
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    total = wsd_total(config)
    ours_opt, theirs_opt = make_optimizer(), make_optimizer()
    ours = WSDLrScheduler(ours_opt, **config)
    theirs = original.WSDLrScheduler(theirs_opt, **config)
    assert lrs_of(ours_opt) == lrs_of(theirs_opt)
    assert ours.get_checkpoint_steps() == theirs.get_checkpoint_steps()
    assert ours.get_decay_info() == theirs.get_decay_info()
    assert ours.decay_phase_ratio == theirs.decay_phase_ratio
    for n in range(-1, total + 3):
        assert ours.get_phase_info(n) == theirs.get_phase_info(n)
    for _ in range(total + 5):
        ours.step()
        theirs.step()
        assert lrs_of(ours_opt) == pytest.approx(lrs_of(theirs_opt), rel=1e-6, abs=1e-15)
        assert ours.get_current_step() == theirs.get_current_step()
        assert ours.get_current_phase_info() == theirs.get_current_phase_info()
        assert ours.previous_checkpoint_step == theirs.previous_checkpoint_step


@settings(max_examples=40, deadline=None, database=None)
@given(
    st.integers(4, 500),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.05, 0.1, 0.3]),
    st.integers(0, 20),
    st.booleans(),
)
def test_wsd_phases_are_monotone_and_match_original(total, checkpoints, ratio, warmup, use_sqrt):
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    kwargs = dict(total_steps=total, num_checkpoints=checkpoints, decay_phase_ratio=ratio,
                  num_warmup_steps=warmup, use_inverse_sqrt_decay=use_sqrt, lr_min=0.01)
    ours = WSDLrScheduler(make_optimizer(), **kwargs)
    theirs = original.WSDLrScheduler(make_optimizer(), **kwargs)
    values = [ours.get_updated_values(n)[0] for n in range(total)]
    for n, value in enumerate(values):
        try:
            expected = theirs.get_updated_values(n)[0]
        except ZeroDivisionError:
            # The original divides by zero past the last checkpoint when a period has no decay
            # steps; the schedule is over there and the minimum is held instead.
            assert n >= ours.get_checkpoint_steps()[-1]
            expected = 0.01 * BASE_LRS[0]
        assert value == pytest.approx(expected, rel=1e-6)
    assert all(a <= b for a, b in zip(values[:warmup], values[1:warmup]))
    for info in ours.get_decay_info():
        decay = values[max(info["pre_decay_step"], warmup) : info["period_end"]]
        assert all(a >= b for a, b in zip(decay, decay[1:]))
        stable = values[max(info["period_start"], warmup) : info["pre_decay_step"]]
        assert stable == [BASE_LRS[0]] * len(stable)


@settings(max_examples=200, deadline=None, database=None)
@given(st.integers(1, 10**7), st.integers(1, 8))
def test_estimate_checkpoint_steps_matches_original(total, num):
    original = pytest.importorskip("pytorch_accelerated.schedulers.wsd_scheduler")
    assert estimate_checkpoint_steps(total, num) == original.estimate_checkpoint_steps(total, num)


def test_estimate_checkpoint_steps_examples():
    assert estimate_checkpoint_steps(100, 1) == [100]
    assert estimate_checkpoint_steps(100, 2) == [25, 50]
    assert estimate_checkpoint_steps(100) == [25, 50, 100]
    assert estimate_checkpoint_steps(200_000, 5) == [50_000, 100_000, 200_000]


def test_wsd_factory_resolves_like_the_original():
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    ours = WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=2, num_checkpoints=3)
    theirs = original.WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=2, num_checkpoints=3)
    assert ours.keywords.keys() == theirs.keywords.keys()
    values = {"NUM_EPOCHS": 10, "PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH": 20,
              "NUM_UPDATE_STEPS_PER_EPOCH": 40}
    scheduler = resolve_placeholders(ours, values)(make_optimizer())
    assert scheduler.total_steps == 200
    assert scheduler.num_warmup_steps == 40
    assert scheduler.get_checkpoint_steps() == [50, 100, 200]
    default = resolve_placeholders(WSDLrScheduler.create_scheduler_fn(), values)(make_optimizer())
    assert default.num_warmup_steps == 2  # 1% of 200


def test_wsd_without_decay_holds_minimum_past_the_end_where_the_original_divides_by_zero():
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    ours = WSDLrScheduler(make_optimizer(), total_steps=50, decay_phase_ratio=0.0, lr_min=0.5)
    theirs = original.WSDLrScheduler(make_optimizer(), total_steps=50, decay_phase_ratio=0.0, lr_min=0.5)
    assert ours.get_updated_values(49) == theirs.get_updated_values(49) == list(BASE_LRS)
    assert ours.get_updated_values(50) == pytest.approx([0.05, 0.0015])
    with pytest.raises(ZeroDivisionError):
        theirs.get_updated_values(50)


def test_wsd_paper_decay_with_zero_minimum():
    scheduler = WSDLrScheduler(make_optimizer(), total_steps=20, lr_min=0.0, decay_phase_ratio=0.5,
                               use_inverse_sqrt_decay=False)
    assert scheduler.get_updated_values(10) == list(BASE_LRS)
    assert scheduler.get_updated_values(15) == [0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_epochs=2, num_update_steps_per_epoch=3, total_steps=6), "not all three"),
        (dict(), "total_steps"),
        (dict(total_steps=0), "total_steps"),
        (dict(total_steps=10, decay_phase_ratio=1.5), "decay_phase_ratio"),
        (dict(total_steps=10, lr_min=-1), "lr_min"),
        (dict(total_steps=10, num_checkpoints=0), "num_checkpoints"),
        (dict(total_steps=10, warmup_starting_lr=1.0), "warmup_starting_lr"),
        (dict(total_steps=100, num_checkpoints=3, decay_phase_ratio=0.4), "overlapping|overlap"),
        (dict(total_steps=3, num_checkpoints=3), "too small"),
    ],
)
def test_wsd_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WSDLrScheduler(make_optimizer(), **kwargs)


def test_wsd_state_dict_resumes_the_schedule_and_is_plain_python():
    config = dict(total_steps=60, num_warmup_steps=6, num_checkpoints=2, decay_phase_ratio=0.2)
    uninterrupted = trace(WSDLrScheduler, 60, **config)
    state, optimizer = state_after(WSDLrScheduler, 20, **config)
    buffer = __import__("io").BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    second = WSDLrScheduler(optimizer, **config)
    second.load_state_dict(state)
    assert second.get_current_step() == 19
    assert flat(steps_of(second, optimizer, 40)) == pytest.approx(flat(uninterrupted[21:]))


def test_wsd_continuation_load_matches_original():
    original = pytest.importorskip("pytorch_accelerated.schedulers")
    first_config = dict(total_steps=100, num_warmup_steps=5)

    def continuation_trace(cls):
        state, _ = state_after(cls, 80, **first_config)
        second = cls(make_optimizer(), total_steps=40, is_continuation_from_checkpoint=True)
        second.load_state_dict(state)
        return (
            [second.get_updated_values(n) for n in range(45)],
            second.get_checkpoint_steps(),
            second.get_decay_info(),
            second.total_steps,
        )

    ours, theirs = continuation_trace(WSDLrScheduler), continuation_trace(original.WSDLrScheduler)
    assert ours[1:] == theirs[1:]
    assert flat(ours[0]) == pytest.approx(flat(theirs[0]), rel=1e-6)
    assert ours[3] == 40 and ours[1] == [40]


# --- base classes and tensor learning rates -------------------------------------------------


def test_set_param_group_value_writes_tensors_in_place_and_floats_by_assignment():
    lr = torch.tensor(0.5)
    group = {"lr": lr, "momentum": 0.9}
    set_param_group_value(group, "lr", 0.25)
    assert group["lr"] is lr and lr.item() == 0.25
    set_param_group_value(group, "momentum", 0.8)
    assert group["momentum"] == 0.8
    set_param_group_value(group, "new_field", 1.5)
    assert group["new_field"] == 1.5


@pytest.mark.parametrize("cls, kwargs", [
    (CosineLrScheduler, dict(total_num_epochs=4, num_update_steps_per_epoch=5, num_warmup_epochs=1)),
    (WSDLrScheduler, dict(total_steps=20, num_warmup_steps=3, decay_phase_ratio=0.3)),
])
def test_tensor_learning_rate_is_updated_in_place_without_host_reads(cls, kwargs, sync_counter):
    tensor_optimizer = make_optimizer(tensor_lr=True)
    lr_tensors = [group["lr"] for group in tensor_optimizer.param_groups]
    tensor_scheduler = cls(tensor_optimizer, **kwargs)
    float_optimizer = make_optimizer()
    float_scheduler = cls(float_optimizer, **kwargs)
    assert [g["initial_lr"] for g in tensor_optimizer.param_groups] == list(BASE_LRS)
    sync_counter["n"] = 0
    for _ in range(22):
        tensor_scheduler.step()
        float_scheduler.step()
        assert all(g["lr"] is t for g, t in zip(tensor_optimizer.param_groups, lr_tensors))
    assert sync_counter["n"] == 0
    for tensor, expected in zip(lr_tensors, lrs_of(float_optimizer)):
        assert tensor.item() == pytest.approx(expected, rel=1e-12)
    assert sync_counter["n"] == 2  # the counter sees host reads


def test_scheduler_base_contract():
    class Halving(SchedulerBase):
        def get_updated_values(self, num_updates):
            return None if num_updates < 0 else [lr / 2**num_updates for lr in self.base_lr_values]

    optimizer = make_optimizer()
    optimizer.param_groups[0]["initial_lr"] = 0.2  # an earlier scheduler's value is kept
    scheduler = Halving(optimizer)
    assert scheduler.base_lr_values == [0.2, 0.003]
    assert lrs_of(optimizer) == [0.2, 0.003]
    scheduler.step_update(2)
    assert lrs_of(optimizer) == pytest.approx([0.05, 0.00075])
    scheduler.step_update(-1)
    assert lrs_of(optimizer) == pytest.approx([0.05, 0.00075])
    assert "optimizer" not in scheduler.state_dict()
    with pytest.raises(KeyError, match="momentum_x"):
        Halving(optimizer, param_group_field="momentum_x")
    with pytest.raises(TypeError):
        StatefulSchedulerBase(optimizer)


def test_single_value_applies_to_every_group():
    class Constant(StatefulSchedulerBase):
        def get_updated_values(self, num_updates):
            return 0.01 * (num_updates + 1)

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    optimizer = make_optimizer()
    scheduler = Constant(optimizer)
    scheduler.step()
    scheduler.step()
    assert lrs_of(optimizer) == [0.02, 0.02]


def test_schedulers_do_not_import_the_trainer():
    import ast
    import pathlib

    import fasttrain.schedulers as package

    for path in pathlib.Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "fasttrain.trainer", path
                assert node.module != "fasttrain" or all(a.name != "Trainer" for a in node.names)


def test_partial_factory_keeps_user_arguments():
    factory = partial(CosineLrScheduler, total_num_epochs=3, num_update_steps_per_epoch=2, lr_min=0.0)
    scheduler = resolve_placeholders(factory, {})(make_optimizer())
    assert scheduler.get_updated_values(6) == [0.0, 0.0]

"""Run history and LossTracker: parity with pytorch-accelerated, state dicts, no host syncs."""

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fasttrain.tracking import InMemoryRunHistory, LossTracker, RunHistory


def original_tracking():
    return pytest.importorskip("pytorch_accelerated.tracking")


def exercise(history):
    """Drive a run history through its API and record every observable result."""
    seen = []

    def observe(label, fn):
        try:
            seen.append((label, fn()))
        except Exception as error:  # noqa: BLE001 - the error type is what is compared
            seen.append((label, type(error).__name__))

    observe("epoch", lambda: history.current_epoch)
    history.update_metric("train_loss_epoch", 0.5)
    history.update_metric("train_loss_epoch", 0.25)
    history.update_metric("eval_loss_epoch", 0.75)
    observe("names", history.get_metric_names)
    observe("values", lambda: list(history.get_metric_values("train_loss_epoch")))
    observe("latest", lambda: history.get_latest_metric("train_loss_epoch"))
    history.set_metric_name_prefix("ema_")
    observe("prefix", lambda: history.metric_name_prefix)
    history.update_metric("eval_loss_epoch", 0.6)
    observe("names_prefixed", history.get_metric_names)
    observe("latest_prefixed", lambda: history.get_latest_metric("ema_eval_loss_epoch"))
    observe("latest_unprefixed", lambda: history.get_latest_metric("eval_loss_epoch"))
    history.set_metric_name_prefix()
    history._increment_epoch()
    history._increment_epoch()
    observe("epoch_incremented", lambda: history.current_epoch)
    history._set_epoch(7)
    observe("epoch_set", lambda: history.current_epoch)
    history.delete_metric("eval_loss_epoch")
    observe("names_after_delete", history.get_metric_names)
    observe("latest_deleted", lambda: history.get_latest_metric("eval_loss_epoch"))
    observe("delete_missing", lambda: history.delete_metric("never_recorded"))
    history.set_metric_name_prefix("kept_")
    history.reset()
    observe("epoch_after_reset", lambda: history.current_epoch)
    observe("names_after_reset", history.get_metric_names)
    observe("prefix_after_reset", lambda: history.metric_name_prefix)
    return seen


def test_run_history_api_matches_original():
    assert exercise(InMemoryRunHistory()) == exercise(original_tracking().InMemoryRunHistory())


def test_latest_metric_raises_value_error_when_none_recorded():
    history = InMemoryRunHistory()
    with pytest.raises(ValueError, match="missing"):
        history.get_latest_metric("missing")
    with pytest.raises(ValueError):
        original_tracking().InMemoryRunHistory().get_latest_metric("missing")


def test_reading_an_unknown_metric_does_not_create_it():
    history = InMemoryRunHistory()
    assert history.get_metric_values("unknown") == []
    with pytest.raises(ValueError):
        history.get_latest_metric("unknown")
    assert history.get_metric_names() == set()
    # pytorch-accelerated's defaultdict adds the name on read; fasttrain does not.
    original = original_tracking().InMemoryRunHistory()
    original.get_metric_values("unknown")
    assert original.get_metric_names() == {"unknown"}


def test_run_history_is_abstract():
    with pytest.raises(TypeError):
        RunHistory()

    class Partial(RunHistory):
        def get_metric_names(self):
            return set()

    with pytest.raises(TypeError):
        Partial()


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_run_history_state_dict_roundtrips_through_weights_only_load():
    history = InMemoryRunHistory()
    history.update_metric("loss", 1.5)
    history.update_metric("loss", torch.tensor(0.5))
    history.update_metric("per_class", torch.tensor([1.0, 2.0]))
    history.update_metric("config", {"lr": 0.1, "name": "a", "sizes": (1, 2)})
    history.set_metric_name_prefix("eval_")
    history.update_metric("n", 3)
    history._set_epoch(4)
    state = roundtrip(history.state_dict())

    restored = InMemoryRunHistory()
    restored.load_state_dict(state)
    assert restored.current_epoch == 4
    assert restored.metric_name_prefix == "eval_"
    assert restored.get_metric_names() == {"loss", "per_class", "config", "eval_n"}
    assert restored.get_metric_values("loss") == [1.5, 0.5]
    assert restored.get_metric_values("per_class") == [[1.0, 2.0]]
    assert restored.get_latest_metric("config") == {"lr": 0.1, "name": "a", "sizes": [1, 2]}
    restored.update_metric("n", 4)  # restored lists are independent of the saved state
    assert state["metrics"]["eval_n"] == [3]


def test_run_history_state_dict_rejects_unsaveable_values():
    history = InMemoryRunHistory()
    history.update_metric("bad", object())
    with pytest.raises(TypeError, match="bad"):
        history.state_dict()


# --- LossTracker --------------------------------------------------------------------------

batches = st.lists(
    st.tuples(st.floats(0, 100, allow_nan=False), st.integers(1, 64)), min_size=1, max_size=30
)


@settings(max_examples=60, deadline=None, database=None)
@given(batches)
def test_loss_tracker_average_equals_original(pairs):
    ours, theirs = LossTracker(), original_tracking().LossTracker()
    tensor_tracker = LossTracker()
    for loss, batch_size in pairs:
        ours.update(loss, batch_size)
        theirs.update(loss, batch_size)
        tensor_tracker.update(torch.tensor(loss, dtype=torch.float32), batch_size)
    assert ours.average == theirs.average
    assert ours.total_loss == theirs.total_loss
    assert ours.running_count == theirs.running_count
    float32_pairs = [(float(torch.tensor(loss, dtype=torch.float32)), n) for loss, n in pairs]
    expected = sum(l * n for l, n in float32_pairs) / sum(n for _, n in pairs)
    assert tensor_tracker.average == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert tensor_tracker.running_count == theirs.running_count


def test_loss_tracker_empty_and_reset_match_original():
    ours, theirs = LossTracker(), original_tracking().LossTracker()
    assert (ours.average, ours.total_loss, ours.running_count, ours.loss_value) == (
        theirs.average, theirs.total_loss, theirs.running_count, theirs.loss_value)
    ours.update(torch.tensor(2.0), 3)
    ours.update(1.0, 1)
    assert ours.average == pytest.approx(7.0 / 4)
    ours.reset()
    assert (ours.average, ours.total_loss, ours.running_count) == (0, 0, 0)


def test_loss_tracker_tensor_batch_sizes_and_mixed_inputs():
    tracker = LossTracker()
    tracker.update(torch.tensor(1.0), torch.tensor(2))
    tracker.update(0.5, torch.tensor(4))
    tracker.update(torch.tensor(3.0, dtype=torch.bfloat16), 2)
    assert tracker.running_count == 8
    assert isinstance(tracker.running_count, int)
    assert tracker.total_loss == pytest.approx(2.0 + 2.0 + 6.0)
    assert tracker.average == pytest.approx(10.0 / 8)
    assert tracker.totals().tolist() == pytest.approx([10.0, 8.0])
    assert tracker.totals().dtype == torch.float64


def test_loss_tracker_detaches_and_rejects_non_scalar_losses():
    weight = torch.tensor(2.0, requires_grad=True)
    tracker = LossTracker()
    tracker.update(weight * 3, 1)
    assert not tracker._device_total.requires_grad
    with pytest.raises(ValueError, match="mean"):
        tracker.update(torch.ones(3), 3)


def test_loss_tracker_update_with_tensors_makes_no_host_sync(sync_counter):
    tracker = LossTracker()
    losses = [torch.tensor(0.1 * i, dtype=torch.float32, requires_grad=True) * 1 for i in range(50)]
    sizes = [torch.tensor(8)] * 25 + [8] * 25
    sync_counter["n"] = 0
    for loss, size in zip(losses, sizes):
        tracker.update(loss, size)
    totals = tracker.totals()
    assert sync_counter["n"] == 0
    average = tracker.average  # the documented epoch-end read
    assert sync_counter["n"] > 0  # the counter does see host reads
    assert average == pytest.approx(sum(0.1 * i for i in range(50)) / 50, rel=1e-6)
    assert totals.shape == (2,)


def test_loss_tracker_state_dict_roundtrip():
    tracker = LossTracker()
    tracker.update(torch.tensor(2.0), 4)
    tracker.update(1.0, 4)
    state = roundtrip(tracker.state_dict())
    assert state == {"total_loss": 12.0, "running_count": 8, "loss_value": 1.0}
    restored = LossTracker()
    restored.load_state_dict(state)
    restored.update(torch.tensor(4.0), 4)
    assert restored.average == pytest.approx((12.0 + 16.0) / 12)
    assert restored.running_count == 12

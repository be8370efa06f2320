"""The pieces the compiled and graphed engines are built from, tested without compiling.

Tensor hyperparameters (schedulers keep writing into the same tensors), the snapshot that undoes a
failed step, and the result ring whose slots the host predicts: the ring is exercised on the CPU
with a stand-in for a CUDA graph whose "replay" runs the same recording code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fasttrain.engine.graph_buffers import CapturedStep, StaticBatch, StepRing, batch_signature
from fasttrain.engine.hyperparams import TensorHyperparams, settings_advice, tensor_fields
from fasttrain.engine.snapshot import ReferenceSnapshot, StepSnapshot
from fasttrain.schedulers import CosineLrScheduler
from fasttrain.step_metrics import StepMetricsBuffer


def _params(seed=0):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]


# ----------------------------------------------------------------------------- hyperparameters
def _lent(hparams):
    """The groups' values as a compiled call sees them: written into the tensors, then lent."""
    hparams.write()
    hparams.lend()
    group = hparams.optimizer.param_groups[0]
    seen = group["lr"], group.get("betas")
    hparams.hand_back()
    return seen


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_torch_one_cycle_keeps_floats_in_the_groups_and_its_values_reach_the_held_tensors(opt_cls):
    kwargs = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {}
    plain = opt_cls(_params(), lr=0.1, **kwargs)
    held = opt_cls(_params(), lr=0.1, **kwargs)
    # SGD's momentum is not held as a tensor: cycling it would recompile, so keep it fixed there
    cycle = opt_cls is not torch.optim.SGD
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=12, cycle_momentum=cycle) for o in (plain, held)
    ]
    hparams = TensorHyperparams(held)
    assert hparams.apply()
    assert type(held.param_groups[0]["lr"]) is float  # the groups keep their own values
    lr, betas = _lent(hparams)
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0
    for _ in range(10):
        for s in scheds:
            s.step()
        group, reference = held.param_groups[0], plain.param_groups[0]
        # outside compiled calls: exactly what the eager optimizer's groups show
        assert group["lr"] == reference["lr"] and type(group["lr"]) is float
        lent_lr, lent_betas = _lent(hparams)
        assert lent_lr is lr and float(lr) == pytest.approx(reference["lr"], rel=1e-6)
        if betas is not None:
            assert lent_betas is betas and group["betas"] == reference["betas"]
            assert float(betas[0]) == pytest.approx(reference["betas"][0], rel=1e-6)
    assert hparams.changed_settings() == []


def test_a_list_of_learning_rates_kept_from_the_groups_holds_each_steps_value():
    # a callback appending group["lr"] each step (to the run history, say) reads it outside the
    # compiled calls: each entry is that step's float, not one tensor changing under it
    opt = torch.optim.AdamW(_params(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    hparams = TensorHyperparams(opt)
    hparams.apply()
    kept = []
    for _ in range(4):
        _lent(hparams)
        opt.step()
        sched.step()
        kept.append(opt.param_groups[0]["lr"])
    assert kept == [0.05, 0.025, 0.0125, 0.00625]


def test_fasttrain_scheduler_and_float_assignments_reach_the_held_tensor():
    opt = torch.optim.AdamW(_params(), lr=0.1)
    sched = CosineLrScheduler(opt, total_num_epochs=2, num_update_steps_per_epoch=5)
    hparams = TensorHyperparams(opt)
    hparams.apply()
    lr, betas = _lent(hparams)
    sched.step()
    assert type(opt.param_groups[0]["lr"]) is float
    assert float(_lent(hparams)[0]) == pytest.approx(opt.param_groups[0]["lr"])
    opt.param_groups[0]["lr"] = 0.0123  # a scheduler that assigns floats
    opt.param_groups[0]["betas"] = (0.5, opt.param_groups[0]["betas"][1])
    lent_lr, lent_betas = _lent(hparams)
    assert lent_lr is lr and float(lr) == pytest.approx(0.0123)
    assert lent_betas is betas and float(betas[0]) == 0.5
    assert opt.param_groups[0]["lr"] == 0.0123 and opt.param_groups[0]["betas"] == (0.5, 0.999)
    hparams.release()
    assert opt.param_groups[0]["lr"] == 0.0123 and opt.param_groups[0]["betas"] == (0.5, 0.999)


def test_a_value_written_or_assigned_inside_a_compiled_call_becomes_the_groups_value():
    # a scheduler stepped inside an overridden optimizer_step writes the lent tensor in place
    # (torch's schedulers do, for a tensor lr): that value is the group's from then on
    opt = torch.optim.AdamW(_params(), lr=0.1)
    hparams = TensorHyperparams(opt)
    hparams.apply()
    hparams.write()
    hparams.lend()
    group = opt.param_groups[0]
    group["lr"].fill_(0.25)
    group["betas"][0].fill_(0.5)
    hparams.hand_back()
    assert group["lr"] == 0.25 and group["betas"] == (0.5, 0.999)
    assert float(_lent(hparams)[0]) == 0.25
    hparams.lend()
    group["lr"] = 0.125  # an assignment stays
    hparams.hand_back()
    assert group["lr"] == 0.125 and float(_lent(hparams)[0]) == 0.125


def test_engines_holding_one_optimizer_share_what_was_copied_last():
    # the training engine and its evaluation's fallback hold the same tensors: a value one of
    # them copied in is known to the other, which copies the group's value back when it returns
    opt = torch.optim.AdamW(_params(), lr=0.1)
    first, second = TensorHyperparams(opt), TensorHyperparams(opt)
    first.apply()
    second.apply()
    lr = _lent(first)[0]
    assert _lent(second)[0] is lr
    opt.param_groups[0]["lr"] = 0.2
    _lent(second)
    opt.param_groups[0]["lr"] = 0.1
    assert float(_lent(first)[0]) == pytest.approx(0.1)


def test_the_users_own_tensor_learning_rate_is_used_as_it_is():
    user_lr = torch.tensor(0.05)
    opt = torch.optim.AdamW(_params(), lr=user_lr)
    hparams = TensorHyperparams(opt)
    hparams.apply()
    assert _lent(hparams)[0] is user_lr and opt.param_groups[0]["lr"] is user_lr
    user_lr.fill_(0.01)  # torch's schedulers write a tensor lr in place
    assert float(_lent(hparams)[0]) == pytest.approx(0.01) and opt.param_groups[0]["lr"] is user_lr


def test_changed_constant_settings_are_reported_and_loads_detected():
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    hparams = TensorHyperparams(opt)
    hparams.apply()
    opt.param_groups[0]["momentum"] = 0.85
    assert hparams.changed_settings() == ["param_groups[0]['momentum']: 0.9 -> 0.85"]
    hparams.accept_changes()
    assert hparams.changed_settings() == []
    assert not hparams.groups_replaced
    opt.load_state_dict(opt.state_dict())
    assert hparams.groups_replaced


def test_optimizers_without_tensor_lr_are_left_alone():
    opt = torch.optim.RMSprop(_params(), lr=0.1)
    hparams = TensorHyperparams(opt)
    assert not hparams.apply()
    assert opt.param_groups[0]["lr"] == 0.1
    assert _lent(hparams) == (0.1, None)  # nothing held: write, lend and hand back do nothing


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_keeps_float_betas_and_a_tensor_lr(opt_cls):
    # the fused kernel takes betas as floats only: tensors there are read back every update
    fused = opt_cls(_params(), lr=0.1, betas=(0.8, 0.95), fused=True)
    assert tensor_fields(fused, fused.param_groups[0]) == ("lr",)
    hparams = TensorHyperparams(fused, capturable=True)
    assert hparams.apply()
    group = fused.param_groups[0]
    assert isinstance(_lent(hparams)[0], torch.Tensor) and _lent(hparams)[1] == (0.8, 0.95)
    assert all(type(b) is float for b in group["betas"])
    assert not group.get("capturable")  # fused keeps its step counter on the device anyway
    # a scheduler changing them is reported, with what to do
    group["betas"] = (0.85, 0.95)
    changes = hparams.changed_settings()
    assert changes == ["param_groups[0]['betas']: (0.8, 0.95) -> (0.85, 0.95)"]
    assert "cycle_momentum=False" in settings_advice(changes) and "fused=False" in settings_advice(changes)
    plain = opt_cls(_params(), lr=0.1)
    assert tensor_fields(plain, plain.param_groups[0]) == ("lr", "betas")


# ----------------------------------------------------------------------------- snapshots
def test_step_snapshot_undoes_a_first_optimizer_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).square().mean().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    snapshot = StepSnapshot(model, opt)
    model(torch.randn(8, 4)).square().mean().backward()  # more gradients, new BatchNorm statistics
    opt.step()  # creates Adam's state lazily
    opt.param_groups[0]["lr"] = 0.5
    snapshot.restore()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    for p, (grad, copy) in zip(model.parameters(), grads):
        assert p.grad is grad
        torch.testing.assert_close(p.grad, copy, rtol=0, atol=0)
    assert len(opt.state) == 0
    assert opt.param_groups[0]["lr"] == 0.1


def test_reference_snapshot_rebinds_gradients_and_state():
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    grads = [p.grad for p in params]
    buffers = [opt.state[p]["momentum_buffer"] for p in params]
    refs = ReferenceSnapshot(opt)
    for p in params:
        p.grad = torch.zeros_like(p)
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    refs.restore()
    assert all(p.grad is g for p, g in zip(params, grads))
    assert all(opt.state[p]["momentum_buffer"] is b for p, b in zip(params, buffers))


# ----------------------------------------------------------------------------- static inputs
def test_static_buffers_keep_the_batchs_strides():
    # clone() makes a strided view contiguous: the step traced with the batch's layout would be
    # traced again inside the capture, for the buffers' layout
    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(8, 16, generator=g)[:, ::2], torch.randn(6, 8, generator=g).t(),
                torch.randn(4, 3, 2, generator=g).permute(2, 0, 1)[:, 1:])
    first = batch(0)
    static = StaticBatch(first)
    assert [b.stride() for b in static.tree] == [t.stride() for t in first] == [(16, 2), (1, 8), (1, 6, 2)]
    assert static.signature == batch_signature(first)
    for buffer, leaf in zip(static.tree, first):
        assert torch.equal(buffer, leaf) and buffer.data_ptr() != leaf.data_ptr()
    second = batch(1)
    static.load(second)
    assert all(torch.equal(b, t) for b, t in zip(static.tree, second))


def test_a_batch_with_overlapping_elements_gets_a_signature_of_its_own():
    expanded = (torch.randn(1, 4).expand(8, 4), torch.arange(8))
    static = StaticBatch(expanded)
    assert static.tree[0].is_contiguous() and torch.equal(static.tree[0], expanded[0])
    assert static.signature != batch_signature(expanded)  # the engine refuses to capture it


def test_static_batch_signature_and_load():
    batch = (torch.randn(4, 3), {"y": torch.arange(4), "tag": "a"})
    static = StaticBatch(batch)
    assert batch_signature(batch) == static.signature
    assert batch_signature((torch.randn(3, 3), {"y": torch.arange(3), "tag": "a"})) != static.signature
    assert batch_signature((torch.randn(4, 3), {"y": torch.arange(4), "tag": "b"})) != static.signature
    new = (torch.randn(4, 3), {"y": torch.arange(4) + 1, "tag": "a"})
    static.load(new)
    torch.testing.assert_close(static.tree[0], new[0])
    torch.testing.assert_close(static.tree[1]["y"], new[1]["y"])
    assert static.tree[1]["tag"] == "a"


# ----------------------------------------------------------------------------- result ring
class _FakeGraph:
    """Stands in for a CUDA graph: replay() runs the recorded body again."""

    def __init__(self, body):
        self.replay = body


def test_ring_views_stay_valid_until_the_flush_and_match_the_host_slots():
    size = 4  # = the micro-steps between two flushes below
    ring = StepRing(size, torch.device("cpu"))
    ring.warm_up()
    loss_in = torch.zeros(())
    items_in = torch.zeros(())
    norm_in = torch.zeros(())
    batch_output = {"loss": loss_in, "num_items_in_batch": items_in, "batch_size": 2, "model_outputs": None}

    def body():
        ring.record(batch_output, norm_in)

    step = CapturedStep(_FakeGraph(body), batch_output, norm_in, ring)
    buffer = StepMetricsBuffer("train", 1)
    expected_losses, expected_norms = [], []
    for i in range(3 * size + 1):
        loss_in.fill_(float(i) + 0.5)
        items_in.fill_(float(10 * i))
        norm_in.fill_(float(100 + i))
        output, norm = step.replay()
        assert output["batch_size"] == 2
        buffer.add(i, output)
        buffer.add_grad_norm(norm)
        expected_losses.append(float(i) + 0.5)
        expected_norms.append(float(100 + i))
        if len(buffer) == size:  # flush: every slot written since the last flush is still intact
            metrics = buffer.flush(num_updates=i, skipped_updates=0, is_epoch_end=False)
            assert metrics.losses == expected_losses
            assert metrics.grad_norms == expected_norms
            assert metrics.num_items == sum(10 * j for j in range(i - size + 1, i + 1))
            expected_losses, expected_norms = [], []
    assert ring.calls == 3 * size + 1
    counters = ring.losses.counters.tolist()
    assert counters[3] == 3 * size + 1  # the device counter the slots come from


def test_the_buffer_keeps_a_replays_loss_as_it_is_and_a_loss_with_history_detached():
    """A replayed step's loss is a view of the graph's ring, with no autograd history: the buffer
    keeps that tensor itself (a detached view of it per step would cost a view op per step and
    hold the same values); a loss that records history is kept detached, without it."""
    buffer = StepMetricsBuffer("train", 1)
    ring_slot = torch.full((), 1.5)
    buffer.add(0, {"loss": ring_slot, "batch_size": 2})
    weight = torch.ones((), requires_grad=True)
    buffer.add(1, {"loss": weight * 2.5, "batch_size": 2})
    kept = buffer._losses
    assert kept[0] is ring_slot
    assert not kept[1].requires_grad and kept[1].grad_fn is None and kept[1].item() == 2.5
    metrics = buffer.flush(num_updates=1, skipped_updates=0, is_epoch_end=False)
    assert metrics.losses == [1.5, 2.5]

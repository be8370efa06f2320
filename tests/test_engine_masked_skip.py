"""nonfinite="skip" without a host read: the update of SGD/Adam/AdamW masked on the device."""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.engine import masked_step
from fasttrain.engine.clipping import GradientClipper
from fasttrain.nonfinite import NonFiniteGuard

from engine_cases import fasttrain_warnings, mlp_case, run
from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: F401

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, amsgrad=True),
}


@pytest.fixture
def device_like(monkeypatch):
    # the CPU reads the flag for free, so the mask is used on devices only; here it is tested
    monkeypatch.setattr(masked_step, "host_read_is_free", lambda device: False)


def _state(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in optimizer.state.values()]
    return params, state


def _assert_identical(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k], k


def _backward(model, scale=1.0, poison=False):
    model.zero_grad(set_to_none=False)
    (model(torch.linspace(-1, 1, 12).reshape(3, 4)).square().sum() * scale).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masked_update_equals_the_step_or_leaves_everything_bit_identical(device_like, sync_counter, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = OPTIMIZERS[name](model.parameters())
    _backward(model)
    optimizer.step()  # the state exists from here on
    reference_model = copy.deepcopy(model)
    reference = OPTIMIZERS[name](reference_model.parameters())
    reference.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own state tensors

    guard = NonFiniteGuard("skip", optimizer)
    clipper = GradientClipper(model.parameters())
    assert guard._masked is not None
    for step, poison in enumerate([False, True, False, True, True, False]):
        _backward(model, scale=1 + step, poison=poison)
        _backward(reference_model, scale=1 + step)
        before = _state(model, optimizer)
        reads = sync_counter["n"]
        guard.clip(clipper)
        assert guard.allow_update() is True
        assert sync_counter["n"] == reads  # the flag stays on the device
        optimizer.step()
        masked_reads = sync_counter["n"] - reads
        if poison:
            _assert_identical(_state(model, optimizer), before)
        else:
            reads = sync_counter["n"]
            reference.step()
            # the hooks add no host read (CPU Adam reads its own host step counter either way)
            assert masked_reads == sync_counter["n"] - reads
            _assert_identical(_state(model, optimizer), _state(reference_model, reference))
    assert guard.pending_skips.tolist() == [3.0]
    guard.close()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


class _OpLog(TorchDispatchMode):
    """The names of the operators run inside the block, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_undo_is_one_save_and_one_restore_whatever_the_number_of_tensors(device_like, name):
    # one launch each way on a device (fasttrain.kernels.masked_restore), not a clone and a
    # select per parameter and state tensor (2n + 1 launches for n tensors)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    optimizer = OPTIMIZERS[name](model.parameters())
    guard = NonFiniteGuard("skip", optimizer)
    clipper = GradientClipper(model.parameters())
    _backward(model)
    optimizer.step()  # the state exists from here on
    for poison in (True, False):
        _backward(model, poison=poison)
        before = _state(model, optimizer)
        guard.clip(clipper)
        assert guard.allow_update() is True and guard._masked.armed
        with _OpLog() as log:
            optimizer.step()
        ours = [op for op in log.ops if op.startswith("fasttrain.")]
        assert ours == ["fasttrain.save_snapshot.default", "fasttrain.restore_where.default"]
        assert not [op for op in log.ops if op.startswith(("aten.clone", "aten.where"))]
        if poison:
            _assert_identical(_state(model, optimizer), before)
        else:
            assert not torch.equal(next(model.parameters()), before[0][0])
    guard.close()


def test_the_first_update_is_checked_on_the_host_until_the_state_exists(device_like):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = NonFiniteGuard("skip", optimizer)
    _backward(model, poison=True)
    guard.clip(GradientClipper(model.parameters()))
    assert guard.allow_update() is False and not guard._masked.armed  # no state yet: host check
    assert not optimizer.state


def test_sgd_without_momentum_keeps_no_state_and_is_masked_from_the_first_update(device_like, sync_counter):
    # plain SGD never creates optimizer state: waiting for it would check every update on the host
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonFiniteGuard("skip", optimizer)
    clipper = GradientClipper(model.parameters())
    for poison in (True, False, True):
        _backward(model, poison=poison)
        before = [p.detach().clone() for p in model.parameters()]
        reads = sync_counter["n"]
        guard.clip(clipper)
        assert guard.allow_update() is True and guard._masked.armed
        optimizer.step()
        assert sync_counter["n"] == reads
        changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert changed == [not poison] * 2
    assert not optimizer.state
    assert guard.pending_skips.tolist() == [2.0]
    guard.close()


def test_adam_whose_step_counters_went_back_to_the_host_is_checked_on_the_host():
    # after a fallback to eager, Adam's step counters are host tensors again (capturable=False):
    # the armed hooks would read the device flag once per parameter to undo them
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, capturable=True)
    flag = torch.zeros(1, device="meta")  # any device but the CPU; nothing is computed on it
    masked = masked_step.masked_step_for(optimizer, flag)
    assert masked is not None
    _backward(model)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p)}
    assert masked.ready()
    optimizer.param_groups[0]["capturable"] = False  # what TensorHyperparams.release does
    assert not masked.ready()
    assert masked_step.masked_step_for(optimizer, flag) is None


def test_fused_and_other_optimizers_are_not_masked(device_like):
    model = torch.nn.Linear(4, 2)
    assert NonFiniteGuard("skip", torch.optim.RMSprop(model.parameters()))._masked is None
    assert NonFiniteGuard("skip", torch.optim.SGD(model.parameters(), lr=0.1, fused=True))._masked is None
    assert NonFiniteGuard("stop", torch.optim.SGD(model.parameters(), lr=0.1))._masked is None


def test_on_the_cpu_the_flag_is_read_on_the_host():
    model = torch.nn.Linear(4, 2)
    assert NonFiniteGuard("skip", torch.optim.SGD(model.parameters(), lr=0.1))._masked is None


def _poisoned_vectors():
    data = mlp_case().data()
    x, y = data.tensors
    x = x.clone()
    x[58, 2] = float("nan")  # batch 7 of 9, an update: replayed from the captured graph
    return TensorDataset(x, y)


def _eager_and_graphed(case):
    """The case run eagerly and graphed; the graphed run captured both training graphs, without
    a fallback."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", AOT, eval_dataset=None)
        graphed = run(case, "cudagraph", AOT, eval_dataset=None)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph"
    # both training graphs were captured (a run that ends with the partial batch's first run
    # has dropped them by then)
    assert len(HostGraphEngine.graphs) >= 2
    return eager, graphed


class TiedNormedMLP(torch.nn.Module):
    """A model shaped like users' at its ends: a final LayerNorm and an output layer tied to the
    input layer's weight (its gradient summed from two uses)."""

    def __init__(self, d_in=8, width=16, classes=3):
        super().__init__()
        self.classes = classes
        self.inp = torch.nn.Linear(d_in, width)
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, x):
        h = self.ln_f(torch.nn.functional.gelu(self.inp(x)))
        return torch.nn.functional.linear(h, self.inp.weight.t())[:, : self.classes]


@pytest.mark.parametrize("model", ["mlp", "tied-final-norm"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_graphed_engine_captures_the_masked_skip(device_like, optimizer, model):
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite="skip"), epochs=1)
    case.data = _poisoned_vectors
    if model == "tied-final-norm":
        case.model = TiedNormedMLP
    if optimizer == "sgd":  # no momentum: no optimizer state ever, ready from the first update
        case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)
        case.train_kwargs["create_scheduler_fn"] = None
    eager, graphed = _eager_and_graphed(case)
    assert sum(g.replays for g in HostGraphEngine.graphs) > 0
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 1
    # the poisoned batch's loss is NaN in both runs; everything else, and the weights, agree
    e, g = eager.recorder, graphed.recorder
    assert sum(map(math.isnan, e.train)) == 1
    torch.testing.assert_close(torch.tensor(g.train), torch.tensor(e.train), rtol=1e-4, atol=1e-5, equal_nan=True)
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)
        assert torch.isfinite(graphed.state[key]).all()


def test_capture_waits_until_the_masked_skip_is_armed(device_like):
    # the first two updates are not finite: skipped on the host (no optimizer state exists yet
    # for the mask to restore), so capturing them would capture a host read
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite="skip"), epochs=2)
    x, y = case.data().tensors
    x = x.clone()
    x[0, 1] = x[17, 3] = float("inf")  # batches 0 and 2: the first two updates (accumulation 2)
    case.data = lambda: TensorDataset(x, y)
    eager, graphed = _eager_and_graphed(case)
    engine = graphed.trainer._engine
    assert engine._train_graphs[True].graph.replays > 0
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 4  # two per epoch
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


def test_a_capture_after_the_cache_evicted_the_undos_table_finds_it_built(device_like, monkeypatch):
    """The undo's kernels look their table up inside a CUDA graph capture, which cannot build
    one; the engine builds it before capturing an update, as it does the clipping's (the graphs
    are captured again in the second epoch, after other tables evicted this one)."""
    from fasttrain.engine import ENGINES
    from fasttrain.kernels import masked_restore
    from test_kernels_chunk_tables import engine_looking_up_tables_in_capture, flooding_trainer

    looked_up = []

    def lookup(engine):
        masked = engine.trainer._nonfinite._masked
        assert masked.ready()  # capture waits for the armed skip
        looked_up.append(masked_restore._table(masked._tensors_of_step(), masked_restore.DEFAULT_CHUNK_BYTES))

    monkeypatch.setattr(masked_restore, "_walkable", lambda tensors: bool(tensors))  # as on a GPU
    monkeypatch.setitem(ENGINES, "cudagraph", engine_looking_up_tables_in_capture(monkeypatch, lookup))
    case = mlp_case(trainer_cls=flooding_trainer(nonfinite="skip"), epochs=2)
    eager, graphed = _eager_and_graphed(case)
    # an update captured in each epoch, each finding the table of the same tensors
    assert len(looked_up) >= 2 and all(t.num_chunks == looked_up[0].num_chunks > 0 for t in looked_up)
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


def test_the_compiled_update_runs_the_optimizers_step_compiled_and_plain_sgd_never_checks_on_the_host(
    device_like, monkeypatch
):
    """SGD steps with ``alpha=-lr``, a host read of a tensor learning rate when it runs eagerly;
    traced, it multiplies on the device instead. So the compiled update must run the step's
    functional itself compiled (a harness that ran the ``optimizer_step`` hook outside dynamo saw
    one synchronisation per update on a GPU, which training never makes), and plain SGD, whose
    masked skip is armed from the first update, never reads the flag on the host."""
    import torch.optim.sgd as sgd_module

    compiled, checks = [], []
    functional = sgd_module.sgd

    def recording(*args, **kwargs):
        compiled.append(torch.compiler.is_compiling())
        return functional(*args, **kwargs)

    monkeypatch.setattr(sgd_module, "sgd", recording)

    class Checks(Trainer):
        def optimizer_step(self):
            super().optimizer_step()
            checks.append(self._nonfinite.last_update_read_host)

    case = mlp_case(trainer_cls=functools.partial(Checks, nonfinite="skip"), epochs=1, create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)
    result = run(case, "compiled", {"backend": "aot_eager"}, eval_dataset=None)
    assert result.trainer.active_engine == "compiled"
    assert compiled and all(compiled), compiled
    assert checks and not any(checks), checks

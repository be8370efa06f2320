"""The CUDA side of the second readiness pass (docs/engines.md, "What changed"): each defect's
decision is tested on the CPU next to the code it concerns; here the GPU checks that the step
really reads nothing on the host (``torch.cuda.set_sync_debug_mode``) and keeps its memory.

Skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.engine.eager import EagerEngine

from engine_cases import fasttrain_warnings, held_hyperparams, mlp_case, run
from memory_trace import recorded_history

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from gpu_check import WarningLog  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("exact_cuda"),
]


@contextlib.contextmanager
def sync_mode(mode):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class SyncsPerUpdate(Trainer):
    """Records, for each optimizer update, the synchronisations ``set_sync_debug_mode("warn")``
    reports while the engine runs the update as training runs it (the compiled update, or the
    eager one after a fallback; the non-finite check included), and whether that check read the
    flag on the host. The updates that compile also make the compiler's syncs (inductor's
    autotuning waits for the device between timings): those are counted apart, in
    ``compile_syncs`` (benchmarks/gpu_check.py's WarningLog tells them by the stack). Counted around the engine's update (:func:`count_update_syncs`), not inside
    the hook: a hook kept out of dynamo to count in it would step the optimizer eagerly, where
    its tensor learning rate and betas are read on the host, which the compiled update never does.
    ``fall_back_after``: fall back to the eager engine after that many compiled updates (as a
    graph break in a later-traced shape or the recompile limit would)."""

    fall_back_after = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.syncs = []
        self.compile_syncs = []
        self.host_checks = []


def _counting(update):
    def counted(engine):
        trainer = engine.trainer
        if not isinstance(trainer, SyncsPerUpdate):
            return update(engine)
        with WarningLog() as caught:
            with sync_mode("warn"):
                update(engine)
        trainer.syncs.append(len(caught.syncs(compiling=False)))
        trainer.compile_syncs.append(len(caught.syncs(compiling=True)))
        trainer.host_checks.append(trainer._nonfinite.last_update_read_host)
        if len(trainer.syncs) == trainer.fall_back_after and engine.active_engine == "compiled":
            engine._fall_back_train(None, "test", EagerEngine, warn=False, redo=False)

    return counted


@pytest.fixture(autouse=True)
def count_update_syncs(monkeypatch):
    from fasttrain.engine.compiled import CompiledEngine

    monkeypatch.setattr(CompiledEngine, "_compiled_update", _counting(CompiledEngine._compiled_update))
    monkeypatch.setattr(EagerEngine, "update_step", _counting(EagerEngine.update_step))


def _runs_clean(case, engine):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(case, engine, {"backend": "inductor"}, device="cuda", eval_dataset=None)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    return result


# defect 1 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_steps_without_a_sync_in_the_compiled_engine(opt_cls):
    case = mlp_case(trainer_cls=SyncsPerUpdate, epochs=1, create_scheduler_fn=None)
    case.optimizer = lambda m: opt_cls(m.parameters(), lr=1e-3, fused=True)
    result = _runs_clean(case, "compiled")
    trainer = result.trainer
    assert trainer._engine.active_engine == "compiled"
    group = trainer.optimizer.param_groups[0]
    # the update's hooks run uncompiled for a fused kernel (dynamo does not trace it), with the
    # groups' float learning rate and betas, which the kernel takes as arguments: no host read
    assert trainer._engine._hparams is None
    assert type(group["lr"]) is float and all(type(b) is float for b in group["betas"])
    assert trainer.syncs and set(trainer.syncs) == {0}


# defect 3 -------------------------------------------------------------------------------------
def _poisoned(case, rows):
    x, y = case.data().tensors
    x = x.clone()
    for row in rows:
        x[row, 1] = float("inf")
    return lambda: TensorDataset(x, y)


def test_plain_sgd_skip_is_captured_without_a_sync():
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite="skip"), epochs=2, create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)
    case.data = _poisoned(case, [58])
    eager = run(case, "eager", device="cuda", eval_dataset=None)
    graphed = _runs_clean(case, "cudagraph")
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 2
    case.trainer_cls = functools.partial(SyncsPerUpdate, nonfinite="skip")
    compiled = _runs_clean(case, "compiled")
    # masked from the first update: no host check, no synchronisation
    assert set(compiled.trainer.host_checks) == {False} and set(compiled.trainer.syncs) == {0}


# defect 6 -------------------------------------------------------------------------------------
class FallBackAfter(SyncsPerUpdate):
    fall_back_after = 3


def test_after_a_fallback_to_eager_the_skip_reads_the_host_once_per_update():
    case = mlp_case(trainer_cls=functools.partial(FallBackAfter, nonfinite="skip"), epochs=2,
                    create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)
    result = run(case, "compiled", {"backend": "inductor"}, device="cuda", eval_dataset=None)
    trainer = result.trainer
    assert trainer._engine.active_engine == "eager"
    assert trainer.optimizer.param_groups[0]["capturable"] is False
    # the first update is checked on the host (no state yet), the next two are masked, and after
    # the fallback each is checked on the host once (not once per parameter's step counter)
    assert trainer.host_checks[:4] == [True, False, False, True] and set(trainer.host_checks[3:]) == {True}
    assert trainer.syncs[:3] == [1, 0, 0]
    assert set(trainer.syncs[3:]) == {1}


# defect 9 -------------------------------------------------------------------------------------
def test_capture_waits_for_the_armed_skip_after_non_finite_warm_updates():
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite="skip"), epochs=2)
    case.data = _poisoned(case, [0, 17])  # the first two updates
    eager = run(case, "eager", device="cuda", eval_dataset=None)
    graphed = _runs_clean(case, "cudagraph")
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 4
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


# defect 7 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_a_checkpoint_from_a_gpu_engine_holds_floats_and_the_users_flags(tmp_path, engine):
    case = mlp_case(epochs=1)
    case.optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    result = _runs_clean(case, engine)
    trainer = result.trainer
    held = trainer.optimizer.param_groups[0]
    assert held["capturable"] is True and held_hyperparams(trainer)[0].device.type == "cuda"  # as the engine holds them
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)["optimizer_state_dict"]
    group = saved["param_groups"][0]
    assert group["capturable"] is False and type(group["lr"]) is float
    assert all(type(b) is float for b in group["betas"])
    assert all(s["step"].device.type == "cpu" for s in saved["state"].values())
    # loads into the user's optimizer on the CPU and steps there
    model = case.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(saved)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()


def test_plain_sgd_resumed_from_a_compiled_checkpoint_steps_without_a_sync(tmp_path):
    case = mlp_case(epochs=1, create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)
    _runs_clean(case, "compiled").trainer.save_checkpoint(tmp_path / "ckpt.pt")
    model = case.model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    resumed = Trainer(model, case.loss, optimizer, engine="eager", callbacks=())
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    assert type(optimizer.param_groups[0]["lr"]) is float
    torch.nn.functional.cross_entropy(model(torch.randn(4, 8, device="cuda")), torch.zeros(4, dtype=torch.long, device="cuda")).backward()
    with sync_mode("error"):
        optimizer.step()


# defect 4 -------------------------------------------------------------------------------------
def _strided_on_device(samples):
    # a batch built on the GPU as every other column of a wider buffer (non-dense strides, which
    # the move to the device keeps because the batch is already there)
    xs = torch.stack([s[0] for s in samples]).cuda()
    wide = torch.zeros(xs.size(0), 2 * xs.size(1), device="cuda")
    wide[:, ::2] = xs
    return wide[:, ::2], torch.stack([s[1] for s in samples]).cuda()


def test_strided_device_batches_are_captured_without_tracing_in_the_capture():
    from engine_cases import CountsCaptureFrames
    from fasttrain.engine import ENGINES, CudaGraphEngine

    class Counting(CountsCaptureFrames, CudaGraphEngine):
        frames_in_captures = []

    loader = {"shuffle": False, "num_workers": 0, "pin_memory": False}
    previous = ENGINES["cudagraph"]
    ENGINES["cudagraph"] = Counting
    try:
        case = mlp_case(epochs=2)
        eager = run(case, "eager", device="cuda", collate_fn=_strided_on_device, train_dataloader_kwargs=loader,
                    eval_dataset=None)
        graphed = _runs_clean_with(case, collate_fn=_strided_on_device, train_dataloader_kwargs=loader)
    finally:
        ENGINES["cudagraph"] = previous
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert engine._static.tree[0].stride() == (16, 2)
    # the non-update and update graphs, captured again after the partial batch's first run, and
    # the partial batch's own graph (two epochs, no evaluation): 2 + 2 + 1
    assert Counting.frames_in_captures == [0] * 5
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


def _runs_clean_with(case, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(case, "cudagraph", {"backend": "inductor"}, device="cuda", eval_dataset=None, **overrides)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    return result


# defects 5 and 8 ------------------------------------------------------------------------------
def _metric_run(engine, metrics, callback_cls=None, phases=("eval",), inputs=None):
    from fasttrain.callbacks import DeviceMetricsCallback

    torch.manual_seed(0)
    case = mlp_case(epochs=2)
    model = case.model().cuda()
    cb = (callback_cls or DeviceMetricsCallback)(metrics, phases=phases, inputs=inputs)
    trainer = Trainer(model, case.loss, case.optimizer(model), engine=engine, callbacks=[cb],
                      compile_options={"backend": "inductor"})
    data = case.data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(data, 2, eval_dataset=data, per_device_batch_size=8,
                      train_dataloader_kwargs={"shuffle": False, "num_workers": 0},
                      eval_dataloader_kwargs={"num_workers": 0})
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    return trainer


def test_kept_model_outputs_are_copies_under_the_graphed_engine():
    from torchmetrics.aggregation import CatMetric

    def metrics():
        return {"first_logit": CatMetric(nan_strategy="disable")}

    first_logit = lambda batch, out: (out["model_outputs"][:, 0],)  # noqa: E731
    eager = _metric_run("eager", metrics(), inputs=first_logit)
    graphed = _metric_run("cudagraph", metrics(), inputs=first_logit)
    assert graphed._engine._eval_graph is not None
    names = [n for n in eager.run_history.get_metric_names() if n.startswith("eval_first_logit_")]
    assert len(names) == 70
    for name in names:
        assert graphed.run_history.get_metric_values(name) == pytest.approx(
            eager.run_history.get_metric_values(name), rel=1e-4, abs=1e-5)


def test_the_documented_metrics_update_without_a_sync():
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
    from fasttrain.callbacks import DeviceMetricsCallback

    class NoSyncInUpdates(DeviceMetricsCallback):
        def on_train_step_end(self, trainer, **kwargs):
            with sync_mode("error"):
                super().on_train_step_end(trainer, **kwargs)

        def on_eval_step_end(self, trainer, **kwargs):
            with sync_mode("error"):
                super().on_eval_step_end(trainer, **kwargs)

    metrics = {"accuracy": MulticlassAccuracy(num_classes=3, validate_args=False),
               "f1": MulticlassF1Score(num_classes=3, average="macro", validate_args=False)}
    for engine in ("eager", "cudagraph"):
        trainer = _metric_run(engine, {k: v.clone() for k, v in metrics.items()}, NoSyncInUpdates, phases=("train", "eval"))
        assert len(trainer.run_history.get_metric_values("eval_accuracy_epoch")) == 2


# defect 2 -------------------------------------------------------------------------------------
def _peak_bytes(engine, steps=24, epochs=1, partial=0, keep=None, trace=False):
    """Peak device memory (allocated, reserved) of a training run whose logits dominate the
    activations (as GPT-2's do), with ``partial`` samples in a last, smaller batch. A graph's
    intermediates count as allocated only while it is captured; between replays the allocator
    sees them as free blocks of the graph's pool, so memory taken beside the pool shows in the
    reserved peak. ``trace``: record the allocator's history and note what was alive at the
    allocated peak (tests/memory_trace.py) in ``_MEMORY_NOTES[engine + " peak"]``."""
    if trace:
        notes = []
        try:
            with recorded_history(notes):
                return _peak_bytes(engine, steps, epochs, partial, keep)
        finally:
            _MEMORY_NOTES[f"{engine} peak"] = " ".join(notes)
    from engine_cases import TinyGPT

    torch.cuda.empty_cache()
    torch.manual_seed(0)
    vocab, seq, batch = 8192, 256, 16
    model = TinyGPT(vocab=vocab, seq=seq, d=128, heads=4).cuda()
    tokens = torch.randint(0, vocab, (steps * batch + partial, seq + 1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def loss(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    trainer = Trainer(model, loss, torch.optim.AdamW(model.parameters(), lr=1e-3), engine=engine,
                      compile_options=None if engine == "eager" else {"backend": "inductor"})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_reserved = torch.cuda.memory_reserved()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(data, epochs, per_device_batch_size=batch, train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    assert trainer.active_engine == engine
    torch.cuda.synchronize()
    _MEMORY_NOTES[engine] = _memory_note(trainer)
    if keep is not None:
        keep.append(trainer)
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved() - base_reserved


#: per engine, what the allocator held at the end of the last _peak_bytes run (for failure messages)
_MEMORY_NOTES = {}


def _memory_note(trainer) -> str:
    """Where the memory sits when a run ends: peaks of the allocator's counters that tell a pool
    beside the activations from fragmentation (free space inside segments that live tensors pin),
    the segments by pool (a graph's private pool or the default one) and stream, and what the live
    blocks of the large segments are (parameters, gradients, optimizer state or other tensors):
    long-lived tensors carved from the warm-up's freed activation blocks would keep those segments
    from being handed back before the graphs' pool is taken."""
    stats = torch.cuda.memory_stats()
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    peaks = {key: mib(stats.get(f"{key}.all.peak", 0)) for key in ("active_bytes", "inactive_split_bytes", "reserved_bytes")}
    snapshot = torch.cuda.memory_snapshot()
    segments = {}
    for segment in snapshot:
        key = (str(segment.get("segment_pool_id")), segment.get("stream"))
        total, used, count = segments.get(key, (0, 0, 0))
        segments[key] = (total + segment["total_size"], used + segment["allocated_size"], count + 1)
    held = "; ".join(f"pool {pool} stream {stream}: {count} segments, {mib(total)} MiB reserved, {mib(used)} MiB in use"
                     for (pool, stream), (total, used, count) in sorted(segments.items()))
    try:
        pinned = _large_segment_contents(trainer, snapshot)
    except Exception as exc:  # a diagnostic: it must not hide the assertion it explains
        pinned = f"(not read: {exc!r})"
    return f"peaks MiB {peaks}; at the end: {held}; segments of 32 MiB or more: {pinned}"


def _large_segment_contents(trainer, snapshot) -> str:
    kinds = {}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    for p in trainer.model.parameters():
        kinds[p.data_ptr()] = "parameter"
        if p.grad is not None:
            kinds[p.grad.data_ptr()] = "gradient"
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                kinds[value.data_ptr()] = "optimizer state"
    rows = []
    for segment in snapshot:
        if segment["total_size"] < 32 * 2**20:
            continue
        live = [b for b in segment.get("blocks", ()) if b.get("state") == "active_allocated"]
        found = {}
        for block in live:
            kind = kinds.get(block["address"], "other")
            found[kind] = found.get(kind, 0) + 1
        rows.append(f"pool {segment.get('segment_pool_id')} {mib_text(segment['total_size'])} MiB holding "
                    f"{mib_text(segment['allocated_size'])} MiB in {len(live)} blocks {found}")
    return "; ".join(rows) or "none"


def mib_text(n: int) -> str:
    return f"{n / 2**20:.1f}"


def test_peak_memory_of_the_compiled_and_graphed_engines_stays_near_eager():
    eager, _ = _peak_bytes("eager", trace=True)
    for engine in ("compiled", "cudagraph"):
        peak, _ = _peak_bytes(engine, trace=True)
        assert peak <= 1.2 * eager, (engine, peak / 2**20, eager / 2**20, _MEMORY_NOTES)


def test_the_partial_last_batch_takes_no_activations_beside_the_graph_pool():
    # three epochs with a last batch of 12 of 16 samples: its first run, then its own graph
    _, eager = _peak_bytes("eager", steps=8, epochs=3, partial=12, trace=True)
    _, graphed = _peak_bytes("cudagraph", steps=8, epochs=3, partial=12, trace=True)
    assert graphed <= 1.2 * eager, (graphed / 2**20, eager / 2**20, _MEMORY_NOTES)


def test_the_optimizer_state_and_gradients_sit_in_the_long_lived_pool():
    # what keeps the warm-up's activation segments free to go back before the graphs' pool is
    # taken (fasttrain/engine/long_lived.py): every large state and gradient tensor lives in the
    # engine's own pool, none in a segment of the default pool
    kept = []
    _peak_bytes("cudagraph", steps=8, keep=kept)
    trainer = kept.pop()
    pool = trainer._engine._long_lived_pool
    assert pool is not None
    segments = [(seg["address"], seg["address"] + seg["total_size"], tuple(seg.get("segment_pool_id") or ()))
                for seg in torch.cuda.memory_snapshot()]

    def pool_of(tensor):
        return next(pid for low, high, pid in segments if low <= tensor.data_ptr() < high)

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    large = [v for state in optimizer.state.values() for v in state.values()
             if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > 1 << 20]
    large += [p.grad for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None and p.grad.untyped_storage().nbytes() > 1 << 20]
    assert len(large) >= 3  # the embedding's gradient and its two Adam moments
    assert {pool_of(t) for t in large} == {tuple(pool.id)}, _MEMORY_NOTES

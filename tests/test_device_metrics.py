"""DeviceMetricsCallback: metrics updated on the device per step, computed at epoch ends."""

import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

torchmetrics = pytest.importorskip("torchmetrics")

from launching import finish, launch_env, start, torchrun_two  # noqa: E402

from fasttrain.callbacks import TrainerCallback  # noqa: E402
from fasttrain.callbacks.device_metrics import DeviceMetricsCallback  # noqa: E402
from fasttrain.trainer import Trainer  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


class _SyncsPerStep(TrainerCallback):
    def __init__(self, counts):
        self.counts, self.at_step_end = counts, []

    def on_train_step_end(self, trainer, **kwargs):
        self.at_step_end.append(self.counts["n"])


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_epoch_values_match_a_direct_computation_without_per_step_syncs(engine, sync_counter):
    from torchmetrics.aggregation import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    metrics = DeviceMetricsCallback(
        {"accuracy": MulticlassAccuracy(num_classes=3, average="micro", validate_args=False)},
        phases=("train", "eval"),
    )
    # nan_strategy="disable": the default checks the values for NaN, a host read per update
    mean_loss = MeanMetric(nan_strategy="disable")

    class LossMean(TrainerCallback):
        def on_train_step_end(self, trainer, batch_output, **kwargs):
            mean_loss.update(batch_output["loss"].detach())

    syncs = _SyncsPerStep(sync_counter)
    eval_set = _data(10, 2)
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[metrics, LossMean(), syncs], engine=engine, log_every_n_steps=100)
    trainer.train(_data(24, 1), num_epochs=1, eval_dataset=eval_set, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0})
    assert len(syncs.at_step_end) == 6
    assert syncs.at_step_end[0] == syncs.at_step_end[-1], "a host read happened between steps"
    history = trainer.run_history
    with torch.no_grad():
        expected = (trainer.get_model()(eval_set.tensors[0]).argmax(-1) == eval_set.tensors[1]).float().mean()
    assert history.get_metric_values("eval_accuracy_epoch") == [pytest.approx(expected.item(), abs=1e-7)]
    assert len(history.get_metric_values("train_accuracy_epoch")) == 1
    # equal batch sizes: the mean of the step losses is the epoch loss
    assert mean_loss.compute().item() == pytest.approx(history.get_latest_metric("train_loss_epoch"), abs=1e-6)


def test_evaluate_records_evaluation_values_and_vector_metrics_per_element():
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    cb = DeviceMetricsCallback({"acc": MulticlassAccuracy(num_classes=3, average=None, validate_args=False)})
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[cb], engine="eager")
    data = _data(9, 3)
    trainer.evaluate(data, per_device_batch_size=4, dataloader_kwargs={"num_workers": 0})
    with torch.no_grad():
        preds = model(data.tensors[0]).argmax(-1)
    for c in range(3):
        mask = data.tensors[1] == c
        want = (preds[mask] == c).float().mean().item() if mask.any() else 0.0
        assert trainer.run_history.get_metric_values(f"evaluation_acc_{c}") == [pytest.approx(want)]


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="non-empty"):
        DeviceMetricsCallback({})
    with pytest.raises(TypeError, match="torchmetrics.Metric"):
        DeviceMetricsCallback({"acc": lambda p, t: 0})
    with pytest.raises(ValueError, match="phases must be among"):
        DeviceMetricsCallback({"m": torchmetrics.MeanMetric()}, phases=("test",))


@pytest.mark.multiprocess
def test_two_gloo_processes_compute_over_all_samples(tmp_path):
    launch = start(torchrun_two(HERE / "dist" / "device_metrics_worker.py", tmp_path), tmp_path / "launch.log",
                   launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, time.monotonic() + 300, "the two processes", retry_s=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["num_processes"] == 2
    # each process saw part of the 13 evaluation samples per epoch; the metric covers all of them
    assert r0["local_eval_samples"] + r1["local_eval_samples"] == 2 * 13
    assert 0 < r0["local_eval_samples"] < 2 * 13
    assert r0["history"]["eval_samples_epoch"] == [13.0, 13.0]
    assert r0["history"]["eval_accuracy_epoch"][-1] == pytest.approx(r0["expected_accuracy"], abs=1e-7)
    assert r1["history"]["eval_accuracy_epoch"] == r0["history"]["eval_accuracy_epoch"]


# ---------------------------------------------------------------------- graphed engine, GPU syncs
class _FakeTrainer:
    """What the callback reads of a trainer, with the engine named as the test needs."""

    def __init__(self, engine):
        self.device = torch.device("cpu")
        self.active_engine = self.active_eval_engine = engine


def _step(cb, trainer, outputs, target):
    cb.on_train_step_end(trainer, batch=(None, target), batch_output={"model_outputs": outputs})


@pytest.mark.parametrize("engine", ["eager", "cudagraph"])
def test_metrics_that_keep_their_inputs_get_copies_only_under_the_graphed_engine(engine):
    import sys

    sys.path.insert(0, str(HERE))
    from host_reads import HostReads
    from torchmetrics.aggregation import CatMetric
    from torchmetrics.classification import MulticlassAccuracy

    cat = CatMetric(nan_strategy="disable")
    cb = DeviceMetricsCallback({"cat": cat, "acc": MulticlassAccuracy(num_classes=3, validate_args=False)},
                               phases=("train",), inputs=lambda batch, out: (out["model_outputs"][:, 0],))
    trainer = _FakeTrainer(engine)
    cb.on_training_run_start(trainer)
    cb.phase_metrics["train"]["acc"].update = lambda *args: None  # counters: no input kept
    outputs = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # a graph's output memory
    with HostReads() as ops:
        _step(cb, trainer, outputs, None)
    first = outputs[:, 0].clone()
    outputs.fill_(-1.0)  # the next replay writes the same memory
    _step(cb, trainer, outputs, None)
    kept = cb.compute("train")["cat"]
    if engine == "cudagraph":
        assert torch.equal(kept, torch.cat([first, torch.full((4,), -1.0)]))
        assert ops.ops["clone"] == 1  # one copy, of what the keeping metric asked for
    else:
        # no copy where nothing overwrites the outputs: the metric holds the step's own tensors
        assert ops.ops["clone"] == 0
        assert cat.value[0].data_ptr() == outputs.data_ptr()


def test_scatter_bincount_counts_as_bincount():
    from fasttrain.callbacks.sync_free_metrics import scatter_bincount

    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 7, (50,), generator=g)
    weights = torch.rand(50, generator=g)
    assert torch.equal(scatter_bincount(values, None, 9), torch.bincount(values, minlength=9))
    torch.testing.assert_close(scatter_bincount(values, weights, 9), torch.bincount(values, weights, minlength=9))


def test_on_a_gpu_the_metric_updates_use_no_op_that_syncs(monkeypatch):
    """torchmetrics' confusion-style updates call torch.bincount, which on CUDA reads the input's
    range back to the host every step; the callback's updates run without it, with the same
    values, and name a metric whose update still syncs."""
    import sys
    import warnings

    sys.path.insert(0, str(HERE))
    from host_reads import HostReads
    from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy, MulticlassF1Score

    from fasttrain.callbacks import device_metrics
    from fasttrain.callbacks.sync_free_metrics import SYNCING_OPS

    monkeypatch.setattr(device_metrics, "host_reads_matter", lambda device: True)  # as on a GPU
    def metrics():
        return {"acc": MulticlassAccuracy(num_classes=4, validate_args=False),
                "f1": MulticlassF1Score(num_classes=4, average="macro", validate_args=False)}
    cb = DeviceMetricsCallback(metrics(), phases=("train",))
    reference = metrics()
    trainer = _FakeTrainer("compiled")
    cb.on_training_run_start(trainer)
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(16, 4, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]
    with HostReads() as seen:
        for outputs, target in steps:
            _step(cb, trainer, outputs, target)
    for outputs, target in steps:
        for m in reference.values():
            m.update(outputs, target)
    assert not SYNCING_OPS & set(seen.ops), sorted(SYNCING_OPS & set(seen.ops))
    assert seen.reads == 0
    got = cb.compute("train")
    for name, m in reference.items():
        torch.testing.assert_close(got[name], m.compute())

    # a binary metric reads whether its predictions are probabilities, validate_args or not
    binary = DeviceMetricsCallback({"bin": BinaryAccuracy(validate_args=False)}, phases=("train",))
    binary.on_training_run_start(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _step(binary, trainer, torch.rand(8, generator=g), torch.randint(0, 2, (8,), generator=g))
    messages = [str(w.message) for w in caught if "fasttrain:" in str(w.message)]
    assert len(messages) == 1 and "'bin'" in messages[0] and "aten._local_scalar_dense" in messages[0]

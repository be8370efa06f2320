"""No full copies of the model are held while a compiled step's activations are (peak memory).

Until its first update has succeeded the compiled engine guards each micro-step with a snapshot,
so that a failure half way can be undone. The snapshot is taken in two parts: the forward part
copies only what a forward and backward change (buffers; gradients where a backward could fail
after accumulating), the update part (parameters, gradients, optimizer state) is taken after the
backward, when the activations are gone. Measured here on the CPU when each backward starts: the
bytes of every tensor alive in Python that holds a copy (same shape and values, another storage)
of a parameter or of a gradient.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback, get_default_callbacks

from engine_cases import mlp_case
from test_engine_graph_logic import AOT, host_graphs  # noqa: F401

WIDTH = 256


def copies_alive(originals) -> int:
    """Bytes of the tensors alive in Python that hold a copy of one of ``originals`` (same shape
    and values, another storage)."""
    own = {t.untyped_storage().data_ptr() for t in originals}
    by_shape = {}
    for t in originals:
        by_shape.setdefault((t.shape, t.dtype), []).append(t)
    counted, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, weakref.ProxyTypes):
            continue
        # plain tensors only: a trace leaves fake and functional tensor subclasses behind
        if type(obj) not in (torch.Tensor, nn.Parameter) or obj.device.type != "cpu":
            continue
        ptr = obj.untyped_storage().data_ptr()
        if ptr in own or ptr in counted:
            continue
        if any(torch.equal(obj, t) for t in by_shape.get((obj.shape, obj.dtype), ())):
            counted.add(ptr)
            total += obj.numel() * obj.element_size()
    return total


@pytest.fixture
def copies_at_backward(monkeypatch):
    """At the start of each ``loss.backward()`` (the activation peak): the bytes of live copies
    of the parameters and of the gradients."""
    seen = []
    original = torch.autograd.backward

    def measuring(*args, **kwargs):
        params = [p for p in MODEL[0].parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        seen.append((copies_alive(params), copies_alive(grads)))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", measuring)
    return seen


MODEL = [None]


def _run(engine, copies_at_backward, model_fn):
    torch.manual_seed(0)
    model = MODEL[0] = model_fn()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, WIDTH, generator=g)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=1e-3), engine=engine,
                      compile_options={"backend": "aot_eager"}, callbacks=())
    trainer.train(TensorDataset(x, x), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False})
    assert trainer.active_engine == engine
    return copies_at_backward


def _random_affine(model):
    # BatchNorm starts with weight == running_var (ones) and bias == running_mean (zeros): the
    # buffers' snapshot would look like a copy of those parameters
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    return model


@pytest.mark.parametrize("model_fn", [
    lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)),
    lambda: _random_affine(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH))),
], ids=["mlp", "batchnorm"])
def test_no_copy_of_the_parameters_is_held_during_the_first_micro_steps(copies_at_backward, model_fn):
    seen = _run("compiled", copies_at_backward, model_fn)
    # micro-steps 0 and 1 come before the first update (accumulation 2) and are snapshotted;
    # step 1 accumulates into the gradients of step 0. Neither holds a copy of the parameters or
    # of the gradients while its activations are alive.
    assert len(seen) == 4
    assert seen[:2] == [(0, 0), (0, 0)]


# ---------------------------------------------------------------------- graphed engine's outputs
class ReadsEvalOutputs(TrainerCallback):
    """A user callback with an eval step end: it may read the model outputs there."""

    def __init__(self):
        self.shapes = []

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.shapes.append(tuple(batch_output["model_outputs"].shape))


@pytest.mark.usefixtures("host_graphs")
@pytest.mark.parametrize("asked", ["none", "eval", "train"])
def test_graphs_keep_model_outputs_only_for_the_phases_a_callback_asks_for(asked):
    """A captured graph's model outputs (the logits: under bf16 upcast to fp32, 3.3 GB per graph
    for GPT-2 124M at 16x1024) stay allocated in graph memory as long as something references
    them; they are kept only for a phase whose outputs some callback reads."""
    callbacks = list(get_default_callbacks())  # the defaults read no outputs
    if asked == "eval":
        callbacks.append(ReadsEvalOutputs())
    elif asked == "train":
        from torchmetrics.aggregation import MeanMetric
        from fasttrain.callbacks import DeviceMetricsCallback

        callbacks.append(DeviceMetricsCallback({"mean": MeanMetric(nan_strategy="disable")}, phases=("train",),
                                               inputs=lambda batch, out: (out["model_outputs"].mean(),)))
    case = mlp_case(epochs=2)
    torch.manual_seed(0)
    model = case.model()
    trainer = Trainer(model, case.loss, case.optimizer(model), callbacks=callbacks, engine="cudagraph",
                      compile_options=AOT)
    data = case.data()
    trainer.train(data, 2, eval_dataset=data, per_device_batch_size=8, gradient_accumulation_steps=2,
                  train_dataloader_kwargs={"shuffle": False, "num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0})
    engine = trainer._engine
    assert engine.active_engine == engine.active_eval_engine == "cudagraph"
    kept_train = {update: "model_outputs" in g.batch_output for update, g in engine._train_graphs.items()}
    assert kept_train == {False: asked == "train", True: asked == "train"}
    assert ("model_outputs" in engine._eval_graph.batch_output) == (asked == "eval")
    if asked == "eval":  # every evaluation step, replayed or not, handed the outputs over
        assert callbacks[-1].shapes[:9] == [(8, 3)] * 8 + [(6, 3)]

"""Gradients that share one storage are clipped by the compiled engine exactly as eagerly.

FSDP2's gradient shards are views of one reduce-scatter output; DDP's ``gradient_as_bucket_view``
and flat gradient buffers make views of one bucket. Through inductor, the clipping kernels (custom
ops that mutate a list of tensors) would update those views through a clone of the whole storage,
which torch 2.11 fills from the wrong memory: wrong weights, no error. The clipper therefore runs
outside the compiled graph when it sees such a layout (``fasttrain.engine.clipping``).

Inductor is the backend here on purpose: ``aot_eager`` does not lower the clone and never showed
the fault.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fasttrain import Trainer
from fasttrain.engine.clipping import GradientClipper

from engine_cases import Case, assert_runs_match, run, vector_data


# fresh dynamo state and counters for every test (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("exact_cuda")


def _shared_gradients(seed: int = 0):
    """Three parameters whose gradients are views of one flat buffer, at offsets 0, 8 and 12,
    filled with values larger than the clip limits below."""
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(2, 4)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, 2))]
    flat = torch.randn(20, generator=g) * 3
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return params, flat


@pytest.mark.parametrize("limits", [dict(clip_value=0.5), dict(clip_norm=1.0), dict(clip_value=0.5, clip_norm=1.0)])
def test_a_compiled_clip_of_gradients_sharing_a_storage_equals_the_eager_clip(limits):
    params, flat = _shared_gradients()
    eager_params, eager_flat = _shared_gradients()
    eager_norm = GradientClipper(eager_params, **limits)()

    clipper = GradientClipper(params, **limits)
    clipper.note_gradient_layout()
    assert clipper.clips_outside_graphs
    norm = torch.compile(lambda: clipper(), backend="inductor")()

    torch.testing.assert_close(flat, eager_flat, rtol=0, atol=0)
    assert flat.abs().max() <= limits.get("clip_value", float("inf"))
    for p, eager in zip(params, eager_params):  # the gradients are still the views of the buffer
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        torch.testing.assert_close(p.grad, eager.grad, rtol=0, atol=0)
    if "clip_norm" in limits:
        torch.testing.assert_close(norm, eager_norm)
    else:
        assert norm is None and eager_norm is None


def test_gradients_in_storages_of_their_own_are_clipped_inside_the_graph():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    for p in params:
        p.grad = torch.ones_like(p) * 4
    clipper = GradientClipper(params, clip_value=1.0)
    clipper.note_gradient_layout()
    assert not clipper.clips_outside_graphs
    torch.compile(lambda: clipper(), backend="inductor")()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)


# ------------------------------------------------------------------------------------ engine
class FlatGradientTrainer(Trainer):
    """Every gradient is a view of one flat buffer for the whole run, as with a contiguous
    gradient buffer: backward accumulates into the views in place, and zeroing keeps them."""

    flat_grads = None

    def train_epoch_start(self):
        super().train_epoch_start()
        if self.flat_grads is None:
            params = list(self.model.parameters())
            self.flat_grads = torch.zeros(sum(p.numel() for p in params))
            offset = 0
            for p in params:
                p.grad = self.flat_grads[offset:offset + p.numel()].view_as(p)
                offset += p.numel()

    def optimizer_zero_grad(self):
        self.flat_grads.zero_()


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x):
        return self.net(x)


def test_the_compiled_engine_clips_gradients_of_one_buffer_as_the_eager_engine():
    case = Case(
        model=Small,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        data=lambda: vector_data(n=32),
        epochs=1,
        train_kwargs=dict(gradient_clip_value=0.05, gradient_clip_norm=0.1),
        trainer_cls=FlatGradientTrainer,
    )
    runs = {}
    for engine in ("eager", "compiled"):
        torch._dynamo.reset()
        runs[engine] = run(case, engine, {"backend": "inductor"})
    eager, compiled = runs["eager"], runs["compiled"]
    assert_runs_match(eager, compiled)
    assert compiled.trainer._engine.active_engine == "compiled"
    assert compiled.trainer._clipper.clips_outside_graphs
    # still views of the buffer at the end: the layout the test is about held for the whole run
    assert compiled.trainer.get_model().net[0].weight.grad.untyped_storage().data_ptr() == (
        compiled.trainer.flat_grads.untyped_storage().data_ptr()
    )

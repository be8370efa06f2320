"""The CUDA-graphed engine on a GPU: same results as eager, no host syncs, fresh inputs replayed.

Skipped without CUDA. TF32 is switched off so that eager and graphed matmuls round alike; the
tolerance is then the compiled engine's (see ``engine_cases.assert_runs_match``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fasttrain.schedulers import CosineLrScheduler

from engine_cases import (
    Case,
    GraphBreakTrainer,
    ConvNet,
    HostReadingTrainer,
    MeanPool,
    RaggedCollate,
    assert_runs_match,
    fasttrain_warnings,
    image_data,
    mlp_case,
    run,
    vector_data,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("exact_cuda"),
]


def _eager_and_graphed(case):
    """The case run eagerly and graphed on the GPU, with fasttrain's warnings of both runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", device="cuda")
        graphed = run(case, "cudagraph", device="cuda")
    return eager, graphed, fasttrain_warnings(caught)


@pytest.mark.parametrize(
    "case",
    [
        mlp_case(),
        Case(
            model=ConvNet,
            optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            data=image_data,
            epochs=3,
            train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_value=0.5),
        ),
    ],
    ids=["mlp-adamw-onecycle-norm", "convnet-bn-sgd-value"],
)
def test_graphed_matches_eager(case):
    eager, graphed, ours = _eager_and_graphed(case)
    assert not ours, ours
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "cudagraph"
    assert set(engine._train_graphs) == {False, True} and engine._eval_graph is not None
    assert_runs_match(eager, graphed)
    counts = graphed.recorder.counts_after_epoch
    assert counts[-1] == counts[0], counts  # capture and replay compile nothing new


def _device_batches(trainer, n):
    batches = []
    for batch in trainer._train_dataloader:
        batches.append(tuple(t.to("cuda") for t in batch))
        if len(batches) == n:
            return batches
    raise AssertionError("not enough batches")


@pytest.mark.parametrize("engine_name", ["compiled", "cudagraph"])
def test_steady_state_steps_never_sync(engine_name):
    # fasttrain's cosine schedule has no step limit, so extra steps after train() are fine
    case = mlp_case(create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1), epochs=2)
    result = run(case, engine_name, device="cuda")
    trainer, engine = result.trainer, result.trainer._engine
    assert engine.active_engine == engine_name
    batches = _device_batches(trainer, 2)  # full batches
    trainer.progress.step_in_epoch = 0  # not the last batch of an epoch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(8):
            engine.train_step(batches[i % 2], update=i % 2 == 1)
        trainer.model.eval()
        for i in range(4):
            engine.eval_step(batches[i % 2])
        trainer.model.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_replays_with_new_batch_contents_give_their_own_losses():
    result = run(mlp_case(create_scheduler_fn=CosineLrScheduler.create_scheduler_fn()), "cudagraph", device="cuda")
    trainer, engine = result.trainer, result.trainer._engine
    assert set(engine._train_graphs) == {False, True}
    model, loss_func = trainer.model, trainer.loss_func
    trainer.progress.step_in_epoch = 0
    g = torch.Generator(device="cuda").manual_seed(7)
    template = _device_batches(trainer, 1)[0]
    expected, views = [], []
    for _ in range(5):  # non-update micro-steps: the parameters stay as they are
        x = torch.randn(template[0].shape, device="cuda", generator=g)
        y = torch.randint(0, 3, template[1].shape, device="cuda", generator=g)
        with torch.no_grad():
            expected.append(loss_func(model(x), y))
        output = engine.train_step((x, y), update=False)
        views.append(output["loss"])  # a view into the ring, read only after all replays
    torch.testing.assert_close(torch.stack(views), torch.stack(expected).float(), rtol=1e-5, atol=1e-6)

    model.eval()
    expected, views = [], []
    for _ in range(3):
        x = torch.randn(template[0].shape, device="cuda", generator=g)
        y = torch.randint(0, 3, template[1].shape, device="cuda", generator=g)
        with torch.no_grad():
            expected.append(loss_func(model(x), y))
        views.append(engine.eval_step((x, y))["loss"])
    torch.testing.assert_close(torch.stack(views), torch.stack(expected).float(), rtol=1e-5, atol=1e-6)


def test_host_read_in_a_hook_falls_back_to_compiled_with_one_warning():
    eager, graphed, ours = _eager_and_graphed(mlp_case(HostReadingTrainer))
    assert len(ours) == 1, ours
    assert "'optimizer_step'" in ours[0] and "'compiled'" in ours[0]
    assert graphed.trainer._engine.active_engine == "compiled"
    assert graphed.trainer._engine.active_eval_engine == "cudagraph"
    assert_runs_match(eager, graphed)


def test_a_step_compiled_with_graph_breaks_is_captured_and_replayed():
    eager, graphed, ours = _eager_and_graphed(mlp_case(GraphBreakTrainer))
    assert len(ours) == 2 and all("graph breaks" in m for m in ours), ours
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "cudagraph"
    assert set(engine._train_graphs) == {False, True} and engine._eval_graph is not None
    assert graphed.trainer.compiled_graphs["calculate_train_batch_loss"].graphs >= 2
    assert_runs_match(eager, graphed)
    counts = graphed.recorder.counts_after_epoch
    assert counts[-1] == counts[0], counts  # capture and replay compile nothing new


def test_batches_that_change_shape_fall_back_to_compiled():
    case = Case(
        model=MeanPool,  # accepts any width
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        data=vector_data,
        epochs=2,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(case, "cudagraph", device="cuda", collate_fn=RaggedCollate(), eval_dataset=None)
    ours = fasttrain_warnings(caught)
    assert len(ours) == 1 and "dynamic shapes" in ours[0], ours
    assert result.trainer._engine.active_engine == "compiled"

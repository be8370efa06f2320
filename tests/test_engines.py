"""The compiled engine matches the eager one, compiles once, and falls back with one warning.

Each comparison trains the same model twice from the same seed, eagerly and compiled, and
compares every flushed loss (training and evaluation), every grad norm and the final weights.
The datasets leave a partial last batch, so the partial-batch path is always covered.

Backends: one run uses inductor, the default; the others use ``aot_eager``, which goes through the
same dynamo tracing, guards, graph breaks and AOTAutograd forward/backward split (everything the
engine is responsible for: what is compiled, when it recompiles, when it falls back) but runs the
graph eagerly instead of generating C++, which costs 20 to 50 s per model on two CPU cores.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from fasttrain import Trainer
from fasttrain import prepare
from fasttrain.engine import auto_engine_name, create_engine
from fasttrain.engine.compiled_functions import UPDATE, CompileSettings
from fasttrain.schedulers import CosineLrScheduler

from engine_cases import (
    MLP,
    Case,
    ConvNet,
    TinyGPT,
    assert_runs_match,
    dynamo_counts,
    finite,
    image_data,
    intentional_break,
    one_cycle,
    run,
    token_data,
    token_loss,
    vector_data,
)

AOT = {"backend": "aot_eager"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class EngineWarnings:
    """The engines' RuntimeWarnings (fallbacks) among everything recorded."""

    def __init__(self, caught):
        self._caught = caught

    def _ours(self):
        return [w for w in self._caught if issubclass(w.category, RuntimeWarning) and "fasttrain:" in str(w.message)]

    def __len__(self):
        return len(self._ours())

    def __getitem__(self, index):
        return self._ours()[index]

    def __iter__(self):
        return iter(self._ours())


@pytest.fixture
def engine_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield EngineWarnings(caught)


def assert_compiled_steady(result, epochs_checked=None):
    """Compiled throughout, nothing new compiled after the first epoch, and graph breaks only
    where torch's optimizers put them on purpose (the forward is traced with fullgraph=True)."""
    assert result.trainer.active_engine == "compiled"
    assert result.trainer.active_eval_engine == "compiled"
    counts = result.recorder.counts_after_epoch
    assert len(counts) >= 2
    assert counts[-1] == counts[0], f"recompiled after the first epoch: {counts}"
    breaks = [reason for reason in counters["graph_break"]]
    assert all(intentional_break(reason) for reason in breaks), breaks


# ----------------------------------------------------------------------------- eager == compiled
def compiled_matching_eager(case, compile_options):
    """Runs ``case`` eagerly and compiled, asserts that the runs match and that the compiled one is
    steady, and returns the compiled run."""
    eager = run(case, "eager")
    compiled = run(case, "compiled", compile_options)
    assert_runs_match(eager, compiled)
    assert_compiled_steady(compiled)
    return compiled


@pytest.mark.parametrize(
    "case, compile_options",
    [
        pytest.param(
            Case(
                model=MLP,
                optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
                data=vector_data,
                epochs=2,
                train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_value=0.05),
            ),
            None,  # default backend: inductor
            id="mlp-inductor-sgd-value-clipping-accumulation",
        ),
        pytest.param(
            # StepLR computes the next lr from group["lr"] itself, which is then a tensor
            Case(
                model=ConvNet,
                optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
                data=image_data,
                epochs=2,
                train_kwargs=dict(
                    gradient_accumulation_steps=2,
                    gradient_clip_value=0.5,
                    gradient_clip_norm=1.0,
                    create_scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                ),
            ),
            AOT,
            id="convnet-batchnorm-adam-both-clips-step-lr",
        ),
        pytest.param(
            Case(
                model=TinyGPT,
                optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
                data=token_data,
                loss=token_loss,
                epochs=2,
                train_kwargs=dict(
                    gradient_accumulation_steps=2,
                    gradient_clip_norm=1.0,
                    create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1, lr_min=1e-4),
                ),
            ),
            AOT,
            id="transformer-adamw-cosine-placeholders",
        ),
    ],
)
def test_compiled_matches_eager(case, compile_options, engine_warnings):
    compiled_matching_eager(case, compile_options)
    assert not engine_warnings


def test_mlp_adamw_one_cycle_norm_clipping_and_second_train(engine_warnings):
    # OneCycleLR also cycles AdamW's beta1 every update (cycle_momentum=True by default)
    case = Case(
        model=MLP,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
        data=vector_data,
        epochs=3,
        train_kwargs=dict(gradient_accumulation_steps=3, gradient_clip_norm=0.5, create_scheduler_fn=one_cycle()),
    )
    compiled = compiled_matching_eager(case, AOT)
    assert len(compiled.recorder.grad_norms) == 3 * 3 and finite(compiled.recorder.grad_norms)
    assert not engine_warnings

    # a second train() with the same shapes (a new scheduler, a new engine) compiles nothing
    before = dynamo_counts()
    trainer = compiled.trainer
    data = vector_data()
    trainer.train(
        data, 2, eval_dataset=data, per_device_batch_size=8, gradient_accumulation_steps=3,
        gradient_clip_norm=0.5, create_scheduler_fn=one_cycle(),
        train_dataloader_kwargs={"shuffle": False, "num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0},
    )
    assert dynamo_counts() == before
    assert trainer._engine.active_engine == "compiled"


def test_sgd_whose_momentum_a_scheduler_cycles_steps_as_eager_with_the_update_uncompiled(engine_warnings):
    """OneCycleLR cycles SGD's momentum, a float the compiled update holds as a constant: the
    update compiled once per value (to dynamo's recompile limit, then the whole step ran eagerly).
    At the third value the update runs uncompiled; the forward stays compiled, the weights are
    eager's, and the two warnings say which setting changes and what the engine did."""
    case = Case(
        model=MLP,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        data=vector_data,
        epochs=2,
        train_kwargs=dict(gradient_clip_norm=0.5, create_scheduler_fn=one_cycle()),
    )
    eager = run(case, "eager")
    compiled = run(case, "compiled", AOT)
    assert_runs_match(eager, compiled)
    assert compiled.trainer.active_engine == "compiled" and compiled.trainer._engine._eager_update
    messages = [str(w.message) for w in engine_warnings]
    assert len(messages) == 2, messages
    assert "['momentum']" in messages[0] and "cycle_momentum=False" in messages[0]
    assert "a setting the scheduler changes" in messages[1] and "runs uncompiled" in messages[1]


class CountingUpdatesTrainer(Trainer):
    """Counts updates in its own ``optimizer_step``: a Python number the compiled update would hold
    as a constant, new at every update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates_seen = 0

    def optimizer_step(self):
        # clipping by norm by hand, as scripts for the original do
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.updates_seen += 1
        super().optimizer_step()


def test_an_uncompiled_update_on_a_tied_transformer_with_a_final_norm_gives_eagers_weights(engine_warnings):
    """The update left uncompiled at a counter's third value, on a model shaped like users' (final
    LayerNorm, head tied to the embedding) with accumulation, norm clipping and a one-cycle
    schedule: every loss, grad norm and weight is eager's (the switch happens mid-epoch, with the
    tied weight's gradient summed from two uses), and the forward and backward stay compiled."""
    case = Case(
        model=TinyGPT,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
        data=token_data,
        loss=token_loss,
        epochs=2,
        train_kwargs=dict(gradient_accumulation_steps=2, create_scheduler_fn=one_cycle(3e-3)),
        trainer_cls=CountingUpdatesTrainer,
    )
    eager = run(case, "eager")
    compiled = run(case, "compiled", AOT)
    assert_runs_match(eager, compiled)
    trainer = compiled.trainer
    assert trainer.active_engine == "compiled" and trainer._engine._eager_update
    assert trainer.updates_seen == eager.trainer.updates_seen == 6  # 5 batches (the last partial), 3 updates an epoch
    assert trainer._engine._hparams is None  # the groups have their floats back
    assert type(trainer.optimizer.param_groups[0]["lr"]) is float
    messages = [str(w.message) for w in engine_warnings]
    assert len(messages) == 1 and "self.updates_seen" in messages[0] and "runs uncompiled" in messages[0], messages
    # the tied weight is one parameter, in the optimizer once, and still the head's
    model = trainer.get_model()
    assert sum(p is model.tok.weight for p in trainer.optimizer.param_groups[0]["params"]) == 1


def test_a_fused_optimizer_steps_uncompiled_as_in_eager(engine_warnings):
    """Dynamo does not trace torch's fused optimizer kernels: compiling the update would only add
    graph breaks and guard checks around the same eager kernel. The compiled engine calls the
    update's hooks uncompiled for them, so nothing of the update is compiled, the betas OneCycleLR
    cycles (fused kernels take them as floats) are no constants to recompile or warn about, and
    the weights are eager's."""
    case = Case(
        model=TinyGPT,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, fused=True),
        data=token_data,
        loss=token_loss,
        epochs=2,
        train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_norm=1.0, create_scheduler_fn=one_cycle(3e-3)),
    )
    eager = run(case, "eager")
    compiled = run(case, "compiled", AOT)
    assert_runs_match(eager, compiled)
    assert_compiled_steady(compiled)
    assert not list(engine_warnings), [str(w.message) for w in engine_warnings]
    engine = compiled.trainer._engine
    update_code = engine._functions.codes[UPDATE]
    assert _debug_get_cache_entry_list(update_code) == []
    assert engine._hparams is None  # the groups keep their floats: the fused kernel takes them
    group = compiled.trainer.optimizer.param_groups[0]
    assert type(group["lr"]) is float and all(type(b) is float for b in group["betas"])


# ----------------------------------------------------------------------------- fallbacks
class BranchOnItemTrainer(Trainer):
    """A loss hook with data-dependent Python: it reads the loss on the host and branches."""

    def calculate_train_batch_loss(self, batch):
        xb, yb = batch
        outputs = self.model(xb)
        loss = self.loss_func(outputs, yb)
        if loss.item() > 100.0:
            loss = loss * 0.5
        return {"loss": loss, "model_outputs": outputs, "batch_size": yb.size(0)}


def sgd_case(trainer_cls=Trainer, **train_kwargs):
    return Case(
        model=MLP,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        data=vector_data,
        epochs=2,
        train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_norm=0.5, **train_kwargs),
        trainer_cls=trainer_cls,
    )


def test_a_loss_hook_with_a_graph_break_runs_compiled_in_pieces_with_one_warning(engine_warnings):
    eager = run(sgd_case(BranchOnItemTrainer), "eager")
    counters.clear()
    compiled = run(sgd_case(BranchOnItemTrainer), "compiled", AOT)
    assert len(engine_warnings) == 1, [str(w.message) for w in engine_warnings]
    message = str(engine_warnings[0].message)
    assert "'calculate_train_batch_loss'" in message and "graph breaks" in message and "item()" in message
    assert compiled.trainer.active_engine == "compiled"
    assert compiled.trainer.active_eval_engine == "compiled"  # evaluation traced whole
    graphs = compiled.trainer.compiled_graphs
    train = graphs["calculate_train_batch_loss"]
    # before the .item() and after the branch: two graphs; dynamo records the break in the
    # hook's frame and again where the compiled function calls it
    assert train.graphs == 2 and train.breaks in (1, 2), train
    assert any("item()" in reason for reason in train.reasons), train.reasons
    assert f"{train.graphs} graph(s), {train.breaks} break(s)" in message
    assert graphs["calculate_eval_batch_loss"].graphs == 1 and graphs["calculate_eval_batch_loss"].breaks == 0
    # the failed whole trace ran nothing, the redo in pieces ran the step once
    assert_runs_match(eager, compiled)


def test_fullgraph_true_keeps_the_strict_fallback_to_eager(engine_warnings):
    eager = run(sgd_case(BranchOnItemTrainer), "eager")
    compiled = run(sgd_case(BranchOnItemTrainer), "compiled", {**AOT, "fullgraph": True})
    assert len(engine_warnings) == 1, [str(w.message) for w in engine_warnings]
    message = str(engine_warnings[0].message)
    assert "'calculate_train_batch_loss'" in message and "eager" in message and "item()" in message
    assert compiled.trainer.active_engine == "eager"
    assert compiled.trainer.active_eval_engine == "compiled"
    assert "calculate_train_batch_loss" not in compiled.trainer.compiled_graphs
    # the failed trace ran nothing, the eager redo ran the step once: same floats as eager
    assert compiled.recorder.train == eager.recorder.train
    assert_runs_match(eager, compiled)


def test_fullgraph_false_accepts_breaks_without_a_warning(engine_warnings):
    compiled = run(sgd_case(BranchOnItemTrainer), "compiled", {**AOT, "fullgraph": False})
    assert not engine_warnings, [str(w.message) for w in engine_warnings]
    assert compiled.trainer.active_engine == "compiled"
    assert compiled.trainer.compiled_graphs["calculate_train_batch_loss"].breaks >= 1


def _backend_that_fails(graph, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_hook_that_no_compile_takes_ends_eager(engine_warnings):
    # the whole trace stops at the .item() before any backend runs; the compile with breaks
    # then reaches the backend, which fails: eager is the last rung
    eager = run(sgd_case(BranchOnItemTrainer), "eager")
    compiled = run(sgd_case(BranchOnItemTrainer), "compiled", {"backend": _backend_that_fails})
    messages = [str(w.message) for w in engine_warnings]
    assert len(messages) == 2, messages  # training, then evaluation (traced whole, then failed)
    assert all("falls back to the 'eager' engine" in m and "BackendCompilerFailed" in m for m in messages), messages
    assert "'calculate_train_batch_loss'" in messages[0] and "'calculate_eval_batch_loss'" in messages[1]
    assert compiled.trainer.active_engine == "eager" and compiled.trainer.active_eval_engine == "eager"
    assert compiled.trainer.compiled_graphs == {}
    assert_runs_match(eager, compiled)


class FlakyUpdateTrainer(Trainer):
    """Fails once, after the optimizer step was applied: a failure half way through an update."""

    failures = 1

    def optimizer_step(self):
        super().optimizer_step()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("flaky optimizer_step")


def test_failure_after_the_update_ran_is_undone_not_applied_twice(engine_warnings):
    case = Case(
        model=ConvNet,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        data=image_data,
        epochs=1,
        train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_norm=0.5),
    )
    eager = run(case, "eager")
    case.trainer_cls = FlakyUpdateTrainer
    compiled = run(case, "compiled", AOT)
    assert len(engine_warnings) == 1
    assert "'optimizer_step'" in str(engine_warnings[0].message)
    assert compiled.trainer.active_engine == "eager"
    # restored parameters, BatchNorm statistics, gradients, Adam state and step count: an update
    # applied twice (or the first micro-step's gradients lost) would be off by ~1e-2
    assert_runs_match(eager, compiled)


class ItemEvalTrainer(Trainer):
    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            outputs = self.model(batch[0])
            loss = self.loss_func(outputs, batch[1])
            if loss.item() < 0:
                loss = -loss
        return {"loss": loss, "model_outputs": outputs, "batch_size": batch[1].size(0)}


@pytest.mark.parametrize("fullgraph", [None, True])
def test_evaluation_falls_back_on_its_own(engine_warnings, fullgraph):
    eager = run(sgd_case(ItemEvalTrainer), "eager")
    options = AOT if fullgraph is None else {**AOT, "fullgraph": fullgraph}
    compiled = run(sgd_case(ItemEvalTrainer), "compiled", options)
    assert len(engine_warnings) == 1
    assert "'calculate_eval_batch_loss'" in str(engine_warnings[0].message)
    assert compiled.trainer.active_engine == "compiled"
    # not given, fullgraph lets the hook run compiled with breaks; True sends it to eager
    assert compiled.trainer.active_eval_engine == ("eager" if fullgraph else "compiled")
    assert ("calculate_eval_batch_loss" in compiled.trainer.compiled_graphs) == (not fullgraph)
    assert_runs_match(eager, compiled)


def test_cudagraph_without_cuda_falls_back_to_compiled_once(engine_warnings):
    eager = run(sgd_case(), "eager")
    graphed = run(sgd_case(), "cudagraph", AOT)
    assert len(engine_warnings) == 1
    assert "CUDA" in str(engine_warnings[0].message) and "'compiled'" in str(engine_warnings[0].message)
    assert graphed.trainer.active_engine == "compiled"
    assert graphed.trainer.active_eval_engine == "compiled"
    assert_runs_match(eager, graphed)


def test_auto_takes_compiled_quietly_when_graphs_cannot_run(monkeypatch, engine_warnings):
    # pretend "auto" chose the graphed engine on this CUDA-less machine: that it cannot capture
    # here is then a choice between engines, not a failure worth a warning
    monkeypatch.setattr("fasttrain.engine.auto_engine_name", lambda device: "cudagraph")
    graphed = run(sgd_case(), "auto", AOT, num_epochs=1)
    assert not engine_warnings
    assert graphed.trainer._engine.name == "cudagraph"
    assert graphed.trainer.active_engine == "compiled"


# ----------------------------------------------------------------------------- setup
def test_auto_is_eager_on_the_cpu():
    assert auto_engine_name("cpu") == "eager"
    assert auto_engine_name("cuda:0") == "cudagraph"
    trainer = Trainer(MLP(), torch.nn.functional.cross_entropy, None, callbacks=[], engine="auto")
    assert create_engine("auto", prepare.step_context(trainer, Trainer)).name == "eager"
    with pytest.raises(TypeError, match="StepContext"):
        create_engine("auto", trainer)


def test_the_trainer_says_which_engine_runs():
    trainer = Trainer(MLP(), torch.nn.functional.cross_entropy, None, callbacks=[], engine="auto")
    assert trainer.active_engine is None and trainer.active_eval_engine is None  # not set up yet
    ran = run(sgd_case(), "auto", num_epochs=1)
    assert ran.trainer.active_engine == ran.trainer.active_eval_engine == "eager"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"modee": "max-autotune"}, "Unknown compile_options"),
        ({"mode": "max-autotune", "options": {"a": 1}}, "either 'mode' or 'options'"),
        ({"fullgraph": "yes"}, "fullgraph"),
        ({"dynamic": "auto"}, "dynamic"),
    ],
)
def test_compile_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        CompileSettings.from_options(options)


def test_compile_settings_defaults_and_hashing():
    settings = CompileSettings.from_options({"options": {"b": 2, "a": 1}})
    # fullgraph not given: traced whole first, graph breaks accepted where it cannot be
    assert settings.fullgraph is None and settings.dynamic is False
    assert settings.kwargs()["fullgraph"] is True
    assert settings.kwargs(fullgraph=False)["fullgraph"] is False
    assert settings.kwargs()["options"] == {"a": 1, "b": 2}
    assert hash(settings) == hash(CompileSettings.from_options({"options": {"a": 1, "b": 2}}))

"""A step whose hooks read Python values that change from step to step (a counter, the batch
index, Lightning's ``self.global_step``) on the graphed engine, on the CPU with the host
stand-ins of test_engine_graph_logic.

A CUDA graph replays the kernels its capture recorded: the Python that chose them does not run
again, so a value read on the host at capture would be replayed for good (a branch frozen, a
logged step number stuck), with no error. Dynamo guards on such values and compiles the hook again
when they change; the graphed engine sees that compilation inside the capture and does not keep
the graph: the step runs compiled (and, when every step compiles again, eagerly), with a warning
naming the guard that failed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback

from engine_cases import assert_runs_match, mlp_case, run
from test_engine_graph_logic import AOT, host_graphs  # noqa: F401


pytestmark = pytest.mark.usefixtures("dynamos_own_limits")


class CountSteps(TrainerCallback):
    def on_train_step_start(self, trainer, **kwargs):
        trainer.step_count += 1


class ScalesByStep(Trainer):
    """Scales each micro-step's loss by a factor that a callback changes on the host every step."""

    def __init__(self, *args, callbacks=(), **kwargs):
        super().__init__(*args, callbacks=[*callbacks, CountSteps()], **kwargs)
        self.step_count = 0

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        output["loss"] = output["loss"] * (1.0 + (self.step_count % 3) * 0.5)
        return output


def test_a_hook_reading_a_value_that_changes_every_step_is_not_replayed_stale():
    case = mlp_case(epochs=2, trainer_cls=ScalesByStep)
    eager = run(case, "eager", eval_dataset=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(case, "cudagraph", AOT, eval_dataset=None)
    ours = [str(w.message) for w in caught if str(w.message).startswith("fasttrain:")]
    assert graphed.trainer.active_engine != "cudagraph"
    # the capture compiled again (or, with the compiles the warm-up and a second capture took,
    # dynamo's limit came first): either way the warning quotes the guard on the counter
    assert ours and "cudagraph" in ours[0] and "ctx.trainer.step_count ==" in ours[0], ours
    assert "compiled again while it was captured" in ours[0] or "recompile_limit" in ours[0], ours
    assert_runs_match(eager, graphed)


def test_the_compiled_engine_names_the_guard_when_the_hook_compiles_again_every_step():
    # every step compiles the hook again, up to dynamo's limit; then the eager engine runs the
    # rest, and the warning says which value kept changing (not only dynamo's "hard failure")
    case = mlp_case(epochs=2, trainer_cls=ScalesByStep)
    eager = run(case, "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = run(case, "compiled", AOT)
    ours = [str(w.message) for w in caught if str(w.message).startswith("fasttrain:")]
    assert compiled.trainer.active_engine == "eager"
    assert len(ours) == 1, ours  # the evaluation, which compiled once, stays compiled
    assert "recompile_limit" in ours[0] and "last recompiled because ctx.trainer.step_count ==" in ours[0], ours
    assert "test_engine_step_values.py:" in ours[0] and "in calculate_train_batch_loss" in ours[0], ours
    assert "keep counters and other per-step state out of the compiled hooks" in ours[0], ours
    assert compiled.trainer._engine.active_eval_engine == "compiled"
    assert_runs_match(eager, compiled)


def test_only_compiles_for_the_hooks_values_count_as_a_changed_step(monkeypatch):
    # a capture context whose global state differed from the warm-up's would differ at every
    # capture: such compiles do not drop the graph; a guard on a value, or a first compile, does
    from fasttrain.engine import compile_events

    compiles, failures = [0], {}
    monkeypatch.setattr(compile_events, "compiles_so_far", lambda: compiles[0])
    monkeypatch.setattr(torch._dynamo.utils, "guard_failures", failures)
    code = (lambda: None).__code__

    def after(compiled, *reasons):
        mark = compile_events.CompileMark()
        compiles[0] += compiled
        failures.setdefault(code, []).extend(reasons)
        return mark.saw_changed_values()

    assert after(0) is False
    assert after(1) is True  # a frame compiled for the first time: a branch not taken before
    assert after(1, "0/1: ___check_global_state() against {'grad_mode': True}") is False
    assert after(1, "0/1: GLOBAL_STATE changed: grad_mode") is False
    assert after(1, "0/2: L['self'].step_count == 4", "0/2: GLOBAL_STATE changed: grad_mode") is True
    mark = compile_events.CompileMark()
    compiles[0] += 1
    failures[code].append("0/3:   ctx.trainer.step_count == 5     # loss * step  # hooks.py:3 in f")
    assert mark.guard_failures() == [("<lambda>", "0/3: ctx.trainer.step_count == 5 # loss * step # hooks.py:3 in f")]


class KeepsHyperparams(TrainerCallback):
    """Appends the optimizer's learning rate and beta1, and the scheduler's last rate, to the run
    history after every step, as scripts that plot their schedule do."""

    def on_train_step_end(self, trainer, **kwargs):
        group = trainer.optimizer.param_groups[0]
        trainer.run_history.update_metric("lr", group["lr"])
        trainer.run_history.update_metric("beta1", group["betas"][0])
        if trainer.scheduler is not None:
            trainer.run_history.update_metric("last_lr", trainer.scheduler.get_last_lr()[0])


@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_a_callback_keeping_the_learning_rate_records_each_steps_value_as_eager(engine, host_graphs):
    # the engines read the learning rate and betas as device tensors; outside their compiled
    # calls the groups hold the scheduler's floats, so what a callback keeps is that step's value
    # (a tensor written in place would leave every entry showing the last one, with no error)
    case = mlp_case(epochs=2)
    runs = {name: run(case, name, options, callbacks=[KeepsHyperparams()], eval_dataset=None).trainer
            for name, options in (("eager", None), (engine, AOT))}
    assert runs[engine].active_engine == engine
    for metric in ("lr", "beta1", "last_lr"):
        eager, ours = (runs[n].run_history.get_metric_values(metric) for n in ("eager", engine))
        assert all(type(value) is float for value in ours), ours[:3]
        assert ours == eager and len(set(eager)) > 5, (metric, ours[:5], eager[:5])
    group = runs[engine].optimizer.param_groups[0]
    assert group["lr"] == runs["eager"].optimizer.param_groups[0]["lr"] and type(group["lr"]) is float


class SchedulesInsideTheUpdate(Trainer):
    """Steps a scheduler of its own inside ``optimizer_step``, which the compiled engine compiles:
    the scheduler writes the learning rate tensor lent to the group in place."""

    def __init__(self, model, loss_func, optimizer, **kwargs):
        super().__init__(model, loss_func, optimizer, **kwargs)
        self.own_schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

    def optimizer_step(self):
        self.optimizer.step()
        self.own_schedule.step()


def test_a_scheduler_stepped_inside_the_compiled_update_moves_the_groups_rate_as_in_eager():
    case = mlp_case(epochs=2, trainer_cls=SchedulesInsideTheUpdate, create_scheduler_fn=None)
    runs = {name: run(case, name, options, callbacks=[KeepsHyperparams()], eval_dataset=None)
            for name, options in (("eager", None), ("compiled", AOT))}
    assert runs["compiled"].trainer.active_engine == "compiled"
    eager, ours = (runs[n].trainer.run_history.get_metric_values("lr") for n in ("eager", "compiled"))
    # the value written inside the compiled call is read back from the (CPU) tensor: float32
    assert ours == pytest.approx(eager, rel=1e-6) and all(type(v) is float for v in ours)
    assert len(set(eager)) > 5 and eager[-1] < eager[0]  # it did move
    for key, value in runs["eager"].state.items():
        torch.testing.assert_close(runs["compiled"].state[key], value, rtol=1e-4, atol=1e-5)

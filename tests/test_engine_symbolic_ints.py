"""The compiled engine takes a Python integer or float the hooks read that keeps changing as a
symbolic value (fasttrain/engine/symbolic_ints.py): one more compile instead of one per value and,
at dynamo's recompile limit, the eager engine."""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine.compiled_functions import TRAIN_HOOK
from fasttrain.engine.symbolic_ints import scalar_source

from engine_cases import assert_runs_match, eager_and, mlp_case
from test_engine_step_guards import WeighsItsLoss  # scales the loss by its float loss_weight

AOT_EAGER = {"backend": "aot_eager"}


@pytest.mark.parametrize("failure, source", [
    ("0/3: ctx.trainer.batch_idx == 3                # w = 1 + batch_idx  # f.py:15 in training_step",
     ("L['ctx'].trainer.batch_idx", False)),
    ("2/0: ctx.trainer.lt._module.seen == 0   # self.seen += 1  # m.py:9 in training_step (HINT: torch.compile "
     "considers integer attributes of the nn.Module to be static.)\nUser stack trace:\n  File ...",
     ("L['ctx'].trainer.lt._module.seen", False)),
    ("0/1: ctx.trainer.hparams['warmup'] == -5  # x", ("L['ctx'].trainer.hparams['warmup']", False)),
    ("0/0: ctx.trainer.loss_weight == 0.5  # a float", ("L['ctx'].trainer.loss_weight", True)),
    ("0/2: ctx.trainer.loss_weight == -2.5e-07  # a small float", ("L['ctx'].trainer.loss_weight", True)),
    ("0/2: ctx.trainer.scale == 1e+20  # a large float", ("L['ctx'].trainer.scale", True)),
    ("6/1: ___as_tensor(ctx.trainer.loss_weight).item() == 1.04  # (unknown source ___as_tensor(...",
     ("L['ctx'].trainer.loss_weight", True)),  # torch 2.11: a symbolic float specialized again
    ("6/0: ___as_tensor(ctx.trainer.loss_weight).item() <= 1.05  # a branch", None),
    ("0/0: ctx.trainer.flag == True  # a bool", None),
    ("0/0: ctx.trainer.loss_weight == inf  # specialized by dynamo", None),
    ("0/0: tensor 'batch[0]' size mismatch at index 0. expected 8, actual 6", None),
    ("0/0: ___check_obj_id(ctx.trainer.model, 1402)", None),
])
def test_a_number_guard_names_its_source_and_kind_as_dynamo_does(failure, source):
    assert scalar_source(failure) == source


class WeighsByItsStep(Trainer):
    """Scales the loss by the step index, an integer a callback sets before each step."""

    step_index = 0

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        output["loss"] = output["loss"] * (1.0 + 0.1 * self.step_index)
        return output


class SetsTheStep(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_training_run_start(self, trainer, **kwargs):
        self.steps = 0  # one instance serves the eager run and the compiled one

    def on_train_step_start(self, trainer, **kwargs):
        trainer.step_index = self.steps
        self.steps += 1


def _forward_graphs(trainer) -> int:
    functions = trainer._engine._functions
    copy = functions._symbolic.get(TRAIN_HOOK)
    codes = [functions.codes[TRAIN_HOOK]] + ([_code(copy)] if copy is not None else [])
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def _code(copy):
    return copy.fn.fn.compiled._torchdynamo_orig_callable.__code__


def test_an_integer_that_changes_every_step_is_compiled_once_more_and_trains_as_in_eager(dynamos_own_limits):
    # 18 values: three constant variants (the third value marks it), then one symbolic copy
    case = mlp_case(epochs=2, trainer_cls=WeighsByItsStep)
    eager, compiled, messages = eager_and(case, "compiled", AOT_EAGER, callbacks=[SetsTheStep()], eval_dataset=None)
    assert messages == []
    assert compiled.trainer.active_engine == "compiled"
    functions = compiled.trainer._engine._functions
    assert functions._symbolic[TRAIN_HOOK].sources == "L['ctx'].trainer.step_index"
    assert _forward_graphs(compiled.trainer) <= 5  # full batch 0, 1, 2, symbolic; the last batch
    assert_runs_match(eager, compiled)


class WeighsByItsStepModulo(WeighsByItsStep):
    def calculate_train_batch_loss(self, batch):
        output = Trainer.calculate_train_batch_loss(self, batch)
        output["loss"] = output["loss"] * (1.0 + 0.5 * (self.step_index % 3))
        return output


def test_a_copy_the_backend_cannot_compile_gives_way_to_the_constants(dynamos_own_limits):
    # torch's scalar pass has no modulo of a symbolic integer: the copy's compile fails before it
    # ran, the step runs with the constants again, and the engine meets dynamo's limit as before
    case = mlp_case(epochs=2, trainer_cls=WeighsByItsStepModulo)
    eager, compiled, messages = eager_and(case, "compiled", AOT_EAGER, callbacks=[SetsTheStep()], eval_dataset=None)
    functions = compiled.trainer._engine._functions
    if functions._no_symbolic:  # dropped: the constants then hit dynamo's limit
        assert compiled.trainer.active_engine == "eager"
        assert len(messages) == 1 and "recompile_limit" in messages[0], messages
    else:  # a torch whose backend takes it stays compiled
        assert compiled.trainer.active_engine == "compiled" and messages == []
    assert_runs_match(eager, compiled)


class AnnealsTheWeight(TrainerCallback):
    def on_training_run_start(self, trainer, **kwargs):
        self.steps = 0

    def on_train_step_start(self, trainer, **kwargs):
        trainer.loss_weight = 1.0 + 0.01 * self.steps
        self.steps += 1


@pytest.mark.parametrize("options", [AOT_EAGER, {}], ids=["aot_eager", "inductor"])
def test_a_float_that_changes_every_step_is_compiled_once_more_and_trains_as_in_eager(dynamos_own_limits, options):
    # 18 values: three constants (the third marks it), then the copy with a symbolic float
    case = mlp_case(epochs=2, trainer_cls=WeighsItsLoss)
    eager, compiled, messages = eager_and(case, "compiled", options, callbacks=[AnnealsTheWeight()], eval_dataset=None)
    assert messages == []
    assert compiled.trainer.active_engine == "compiled"
    functions = compiled.trainer._engine._functions
    assert functions._changing[TRAIN_HOOK].floats == {"L['ctx'].trainer.loss_weight"}
    assert functions._symbolic[TRAIN_HOOK].sources == ""  # no integer to name
    assert _forward_graphs(compiled.trainer) <= 5
    assert_runs_match(eager, compiled)


class BranchesOnTheWeight(WeighsItsLoss):
    def calculate_train_batch_loss(self, batch):
        output = Trainer.calculate_train_batch_loss(self, batch)
        output["loss"] = output["loss"] * (2.0 if self.loss_weight > 1.05 else 1.0)
        return output


class MakesATensorOfTheWeight(WeighsItsLoss):
    def calculate_train_batch_loss(self, batch):
        output = Trainer.calculate_train_batch_loss(self, batch)
        output["loss"] = output["loss"] * torch.tensor(self.loss_weight)
        return output


def test_a_branch_on_a_symbolic_float_guards_on_its_condition_only(dynamos_own_limits):
    case = mlp_case(epochs=2, trainer_cls=BranchesOnTheWeight)
    eager, compiled, messages = eager_and(case, "compiled", AOT_EAGER, callbacks=[AnnealsTheWeight()], eval_dataset=None)
    assert messages == [] and compiled.trainer.active_engine == "compiled"
    assert TRAIN_HOOK in compiled.trainer._engine._functions._symbolic
    assert _forward_graphs(compiled.trainer) <= 6  # three constants; each side of the branch; the last batch
    assert_runs_match(eager, compiled)


def test_a_copy_that_specializes_the_float_again_is_dropped_at_its_first_new_value(dynamos_own_limits):
    # torch.tensor(float) makes dynamo specialize the float it traced symbolic: the copy would
    # compile once per value too; the hook goes on with its constants, to dynamo's limit
    case = mlp_case(epochs=2, trainer_cls=MakesATensorOfTheWeight)
    eager, compiled, messages = eager_and(case, "compiled", AOT_EAGER, callbacks=[AnnealsTheWeight()], eval_dataset=None)
    functions = compiled.trainer._engine._functions
    assert TRAIN_HOOK in functions._no_symbolic and functions._copies == 1
    assert compiled.trainer.active_engine == "eager"
    assert len(messages) == 1 and "recompile_limit" in messages[0] and "loss_weight" in messages[0], messages
    assert_runs_match(eager, compiled)


class Mixup(Trainer):
    """Mixes each batch with its reverse by a coefficient drawn on the host (``random`` or numpy):
    a graph break, after which the coefficient is a local of the frame dynamo compiles on its own."""

    draw = staticmethod(lambda: random.betavariate(0.4, 0.4))

    def calculate_train_batch_loss(self, batch):
        x, y = batch[0], batch[1]
        lam = self.draw()
        mixed = lam * x + (1 - lam) * x.flip(0)
        out = self.model(mixed)
        loss = lam * self.loss_func(out, y) + (1 - lam) * self.loss_func(out, y.flip(0))
        return {"loss": loss, "model_outputs": out, "batch_size": x.size(0)}


class NumpyMixup(Mixup):
    draw = staticmethod(lambda: float(np.random.beta(0.4, 0.4)))


class SeedsTheDraws(TrainerCallback):
    def on_training_run_start(self, trainer, **kwargs):
        random.seed(0)
        np.random.seed(0)


@pytest.mark.parametrize("trainer_cls", [Mixup, NumpyMixup], ids=["random", "numpy"])
def test_a_coefficient_drawn_after_a_graph_break_stays_compiled_and_trains_as_in_eager(dynamos_own_limits,
                                                                                       trainer_cls):
    # both draw in one method, whose code (and the frames dynamo makes of it) the two share
    torch._dynamo.reset()
    case = mlp_case(epochs=2, trainer_cls=trainer_cls)
    eager, compiled, messages = eager_and(case, "compiled", AOT_EAGER, callbacks=[SeedsTheDraws()], eval_dataset=None)
    assert len(messages) == 1 and "compiled with graph breaks" in messages[0], messages  # the draw
    assert compiled.trainer.active_engine == "compiled"
    changing = compiled.trainer._engine._functions._changing[TRAIN_HOOK]
    assert changing.nested and all(code.co_name.startswith("torch_dynamo_resume_in_calculate_train_batch_loss")
                                   for code, _ in changing.nested), changing.nested
    assert not changing.specialized_again
    assert_runs_match(eager, compiled)


def _weighted(x, w):
    return x * w


def test_each_copy_of_a_function_has_a_code_object_unequal_to_the_others_under_the_same_name():
    from fasttrain.engine.compile_cache import with_own_dynamo_cache

    a, b = with_own_dynamo_cache(_weighted), with_own_dynamo_cache(_weighted)
    # dynamo files guard failures by code object as a dict key (equality by value)
    assert a.__code__ != b.__code__ and a.__code__ != _weighted.__code__
    # and keeps what it saw of each value under file, line and name
    for code in (a.__code__, b.__code__):
        assert (code.co_filename, code.co_firstlineno, code.co_name) == (
            _weighted.__code__.co_filename, _weighted.__code__.co_firstlineno, "_weighted")
    assert a(3, 2) == b(3, 2) == 6


def test_a_trainers_functions_count_only_the_guard_failures_of_their_own_compiles(dynamos_own_limits):
    # an earlier trainer whose step index kept changing: a later one reads no step index at all
    eager_and(mlp_case(epochs=1, trainer_cls=WeighsByItsStep), "compiled", AOT_EAGER, callbacks=[SetsTheStep()],
              eval_dataset=None)
    _, later, messages = eager_and(mlp_case(epochs=1), "compiled", AOT_EAGER, eval_dataset=None)
    assert messages == []
    functions = later.trainer._engine._functions
    assert functions._symbolic == {} and functions._copies == 0
    assert all(not changing.symbolic for changing in functions._changing.values())


def test_the_graphed_engine_keeps_its_constants():
    from fasttrain.engine.compiled import CompiledEngine
    from fasttrain.engine.cudagraph import CudaGraphEngine

    assert CompiledEngine.symbolic_ints and not CudaGraphEngine.symbolic_ints


# ---------------------------------------------------------------- an unchanged LightningModule
def _lightning():
    pytest.importorskip("lightning")
    sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))
    import lightning_modules

    return lightning_modules


def test_a_lightning_module_counting_and_annealing_by_the_step_stays_compiled(dynamos_own_limits):
    lm_helpers = _lightning()
    import lightning as L

    class CountsAndAnneals(lm_helpers.Classifier):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def training_step(self, batch, batch_idx):
            self.seen += 1
            loss = super().training_step(batch, batch_idx)
            return loss * min(1.0, (self.global_step + 1) / 10) * (1.0 + 0.01 * batch_idx)

    class GraphCount(L.Callback):
        def __init__(self):
            self.per_epoch = []

        def on_train_epoch_end(self, trainer, module):
            self.per_epoch.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    count = GraphCount()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = lm_helpers.fit_both(
            CountsAndAnneals, lm_helpers.train_loader, trainer_kwargs=dict(max_epochs=5, callbacks=[count]),
            fasttrain_kwargs=dict(engine="compiled", compile_options=AOT_EAGER),
        )
    assert ft.engine == "compiled"
    assert fm.seen == lm.seen == 30
    lm_helpers.assert_same_weights(lm, fm, atol=1e-5)
    # Lightning's run adds no graphs; fasttrain's compile in the first epochs only
    graphs = count.per_epoch[5:]
    assert graphs[-1] == graphs[-2] == graphs[-3]


def test_a_lightning_module_weighing_its_losses_by_a_float_it_anneals_stays_compiled(dynamos_own_limits):
    lm_helpers = _lightning()
    import torch.nn.functional as F

    class AnnealsAWeight(lm_helpers.Classifier):
        def __init__(self):
            super().__init__()
            self.loss_weight = 1.0

        def on_train_batch_start(self, batch, batch_idx):
            self.loss_weight = 1.0 + 0.05 * (self.global_step + 1)

        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * self.loss_weight

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_weighted", F.cross_entropy(self(x), y) * self.loss_weight)

    torch._dynamo.reset()
    lt, lm, ft, fm = lm_helpers.fit_both(
        AnnealsAWeight, lm_helpers.train_loader, val_factory=lm_helpers.val_loader,
        trainer_kwargs=dict(max_epochs=5),
        fasttrain_kwargs=dict(engine="compiled", compile_options=AOT_EAGER),
    )
    assert ft.engine == "compiled"
    assert fm.loss_weight == lm.loss_weight
    lm_helpers.assert_same_weights(lm, fm, atol=1e-5)
    lm_helpers.assert_same_metrics(lt.callback_metrics, ft.callback_metrics)


def test_a_lightning_module_mixing_up_its_batches_with_numpy_stays_compiled(dynamos_own_limits):
    lm_helpers = _lightning()
    import torch.nn.functional as F

    class MixesUp(lm_helpers.Classifier):
        def on_train_start(self):
            np.random.seed(0)  # the same draws in both fits

        def training_step(self, batch, batch_idx):
            x, y = batch
            lam = float(np.random.beta(0.4, 0.4))  # a graph break: numpy's sampler is not traced
            logits = self(lam * x + (1 - lam) * x.flip(0))
            loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y.flip(0))
            self.log("train_loss", loss)
            return loss

    torch._dynamo.reset()
    lt, lm, ft, fm = lm_helpers.fit_both(
        MixesUp, lm_helpers.train_loader, trainer_kwargs=dict(max_epochs=4),
        fasttrain_kwargs=dict(engine="compiled", compile_options=AOT_EAGER),
    )
    assert ft.engine == "compiled"
    lm_helpers.assert_same_weights(lm, fm, atol=1e-5)
    torch.testing.assert_close(ft.logged_metrics["train_loss"], lt.logged_metrics["train_loss"], atol=1e-5, rtol=0)

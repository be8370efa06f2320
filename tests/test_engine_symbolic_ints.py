"""The compiled engine takes a Python integer the hooks read that keeps changing as a symbolic
value (fasttrain/engine/symbolic_ints.py): one more compile instead of one per value and, at
dynamo's recompile limit, the eager engine."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine.compiled_functions import TRAIN_HOOK
from fasttrain.engine.symbolic_ints import int_source

from engine_cases import assert_runs_match, eager_and, mlp_case

AOT_EAGER = {"backend": "aot_eager"}


@pytest.mark.parametrize("failure, source", [
    ("0/3: ctx.trainer.batch_idx == 3                # w = 1 + batch_idx  # f.py:15 in training_step",
     "L['ctx'].trainer.batch_idx"),
    ("2/0: ctx.trainer.lt._module.seen == 0   # self.seen += 1  # m.py:9 in training_step (HINT: torch.compile "
     "considers integer attributes of the nn.Module to be static.)\nUser stack trace:\n  File ...",
     "L['ctx'].trainer.lt._module.seen"),
    ("0/1: ctx.trainer.hparams['warmup'] == -5  # x", "L['ctx'].trainer.hparams['warmup']"),
    ("0/0: ctx.trainer.loss_weight == 0.5  # a float", None),
    ("0/0: ctx.trainer.flag == True  # a bool", None),
    ("0/0: tensor 'batch[0]' size mismatch at index 0. expected 8, actual 6", None),
    ("0/0: ___check_obj_id(ctx.trainer.model, 1402)", None),
])
def test_an_integer_guard_names_its_source_as_dynamo_does(failure, source):
    assert int_source(failure) == source


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

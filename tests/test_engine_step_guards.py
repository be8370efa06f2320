"""The graphed engine checks dynamo's guards of the compiled code each graph was captured from
before replaying it (fasttrain/engine/step_guards.py): a step whose Python reads a value that
changed since its capture, to one whose compiled variant exists already (so nothing compiles), runs
compiled and is captured again, instead of replaying the captured value. CPU stand-ins for CUDA
graphs (test_engine_graph_logic), whose replays fail where they run other compiled code than the
capture did."""

from __future__ import annotations

import torch
from torch import nn

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine.step_guards import FramesRun, ReplayGuards, _arguments, _reads_nothing, _recorded, _users_code
from fasttrain.regional import compile_regions

from engine_cases import Case, assert_runs_match, eager_and, mlp_case, vector_data
from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: F401


class WeighsItsLoss(Trainer):
    """Scales the training and evaluation losses by ``loss_weight``, a float a callback sets."""

    loss_weight = 1.0

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        output["loss"] = output["loss"] * self.loss_weight
        return output

    def calculate_eval_batch_loss(self, batch):
        output = super().calculate_eval_batch_loss(batch)
        output["loss"] = output["loss"] * self.loss_weight
        return output


class AlternatingWeight(TrainerCallback):
    """Sets the trainer's loss weight at each epoch start, from a cycle of values."""

    def __init__(self, weights):
        self.weights = weights

    def on_train_epoch_start(self, trainer, **kwargs):
        epoch = trainer.run_history.current_epoch
        trainer.loss_weight = self.weights[(epoch - 1) % len(self.weights)]


class WeightPerStep(TrainerCallback):
    """Sets the trainer's loss weight before each training and evaluation step, from a cycle."""

    def __init__(self, weights):
        self.weights = weights
        self.steps = 0

    def _next(self, trainer):
        trainer.loss_weight = self.weights[self.steps % len(self.weights)]
        self.steps += 1

    def on_train_step_start(self, trainer, **kwargs):
        self._next(trainer)

    def on_eval_step_start(self, trainer, **kwargs):
        self._next(trainer)


def _replays() -> int:
    return sum(graph.replays for graph in HostGraphEngine.graphs)


def test_a_value_returning_to_one_seen_before_is_not_replayed_as_captured():
    # epochs 1 and 3 weigh 1.0, 2 and 4 weigh 0.5: from the third epoch on both variants are
    # compiled, so no capture compiles; where graphs from the epoch before are still held, the
    # guards of their variant fail at the first replay, and the engine captures again
    case = mlp_case(epochs=4, trainer_cls=WeighsItsLoss)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, callbacks=[AlternatingWeight((1.0, 0.5))])
    assert messages == []
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "cudagraph"
    assert engine._recaptures >= 1
    assert _replays() > 0
    assert_runs_match(eager, graphed)


def test_a_value_that_keeps_changing_moves_the_step_to_the_compiled_engine_with_the_guard_named():
    # three values in turn, one per step: after the first epoch each is compiled, and each
    # replay's guards fail; after MAX_RECAPTURES captures the steps run compiled
    case = mlp_case(epochs=5, trainer_cls=WeighsItsLoss)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, callbacks=[WeightPerStep((1.0, 0.5, 0.25))])
    engine = graphed.trainer._engine
    assert engine.active_engine == "compiled" and engine.active_eval_engine == "compiled"
    assert len(messages) == 2, messages
    for message, hook in zip(sorted(messages), ("calculate_eval_batch_loss", "calculate_train_batch_loss")):
        assert f"the '{hook}' hook cannot run in the 'cudagraph' engine" in message
        assert "trainer.loss_weight ==" in message and "4 times this run" in message, message
        assert "keep values such as the batch index" in message
    assert_runs_match(eager, graphed)


def _scaled(holder, x):
    return x * holder.k


class _Holder:
    k = 1


def _never_compiled():
    return None


def test_the_guards_of_the_variant_last_run_fail_for_another_value_and_name_it():
    holder, x = _Holder(), torch.ones(2)
    body = _scaled.__code__.replace()
    function = type(_scaled)(body, _scaled.__globals__, "_scaled")
    compiled = torch.compile(function, backend="eager", dynamic=False)
    for k in (1, 2, 1):
        holder.k = k
        compiled(holder, x)
    guards = ReplayGuards.taken([("hook", body, lambda: {"holder": holder, "x": x})])
    assert guards.failure() is None
    holder.k = 2  # compiled too, but not the variant the last call ran
    hook, guard = guards.failure()
    assert hook == "hook" and "holder'].k == 1" in guard
    # a function that never compiled has no guards to keep: nothing to check
    assert ReplayGuards.taken([("hook", _never_compiled.__code__, dict)]).failure() is None


class WeighsItsLossAfterABreak(WeighsItsLoss):
    """As WeighsItsLoss, reading the weight only after a graph break: the code after the break
    runs in a frame of its own (dynamo's resume function), whose guards hold the weight."""

    def calculate_train_batch_loss(self, batch):
        outputs = self.model(batch[0])
        torch._dynamo.graph_break()
        loss = self.loss_func(outputs, batch[1]) * self.loss_weight
        return {"loss": loss, "model_outputs": outputs, "batch_size": batch[1].size(0)}


class WeighsItsEvalLossAfterABreak(Trainer):
    """The evaluation loss weighed by ``eval_weight``, read after a graph break under no_grad."""

    eval_weight = 1.0

    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            outputs = self.model(batch[0])
            torch._dynamo.graph_break()
            loss = self.loss_func(outputs, batch[1]) * self.eval_weight
        return {"loss": loss, "model_outputs": outputs, "batch_size": batch[1].size(0)}


class AlternatingEvalWeight(TrainerCallback):
    def on_eval_epoch_start(self, trainer, **kwargs):
        trainer.eval_weight = (1.0, 0.5)[(trainer.run_history.current_epoch - 1) % 2]


def test_a_value_read_after_a_graph_break_is_checked_before_each_replay():
    # the weight returns to a value compiled before: no compile marks the capture stale, and the
    # hook's own frame reads nothing that changed; the frame after the break does, and its
    # guards are checked too (the stand-in's replay refused the third epoch's before)
    case = mlp_case(epochs=4, trainer_cls=WeighsItsLossAfterABreak)
    eager, graphed, messages = eager_and(
        case, "cudagraph", AOT, callbacks=[AlternatingWeight((1.0, 0.5))], eval_dataset=None
    )
    assert len(messages) == 1 and "cannot be traced as one graph" in messages[0], messages
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine._recaptures >= 1
    assert _replays() > 0
    assert_runs_match(eager, graphed)


def test_a_value_read_after_a_graph_break_in_evaluation_is_checked_before_each_replay():
    # as above, in the evaluation graph (the frame after the break runs under no_grad)
    case = mlp_case(epochs=4, trainer_cls=WeighsItsEvalLossAfterABreak)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, callbacks=[AlternatingEvalWeight()])
    assert len(messages) == 1 and "cannot be traced as one graph" in messages[0], messages
    engine = graphed.trainer._engine
    assert engine.active_eval_engine == "cudagraph" and engine._eval_recaptures >= 1
    assert _replays() > 0
    assert_runs_match(eager, graphed)


def _scaled_without_grad(holder, x):
    with torch.no_grad():
        y = x * 2
        torch._dynamo.graph_break()
        return y * holder.k


def _scaled_in_autocast(holder, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x * 2
        torch._dynamo.graph_break()
        return y * holder.k


def _frames_of(function, holder, x):
    """The compiled frames of ``function(holder, x)``'s second compiled call."""
    compiled = torch.compile(function, backend="eager", dynamic=False)
    compiled(holder, x)
    frames = FramesRun(lambda: "hook")
    frames.run(lambda: compiled(holder, x))
    return frames


def test_the_frames_after_a_break_are_checked_in_the_grad_mode_and_autocast_they_ran_in():
    for function in (_scaled_without_grad, _scaled_in_autocast):
        torch._dynamo.reset()
        holder, x = _Holder(), torch.ones(3, requires_grad=True)
        holder.k = 1
        frames = _frames_of(function, holder, x)
        names = [code.co_name for _, code, _, _, _ in frames.calls]
        assert names[0] == function.__name__ and "resume" in names[1], names
        # the hook's own frame is checked with the arguments its call gets (ReplayGuards.calls)
        guards = ReplayGuards.taken([("hook", frames.calls[0][1], lambda: {"holder": holder, "x": x})], frames)
        assert guards.failure() is None
        holder.k = 2
        hook, guard = guards.failure()
        assert hook == "hook" and "holder'].k == 1" in guard and "resume" in guard, guard
        # the host's grad mode and autocast are as they were
        assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_cache_enabled()


def test_the_recorded_tensors_keep_their_metadata_and_no_memory():
    base = torch.randn(4, 6, requires_grad=True)
    view, other = base[:, 1:5], base.t()
    recorded = _recorded({"a": [view, other], "b": (view,), "c": 3}, {})
    assert recorded["b"][0] is recorded["a"][0] and recorded["c"] == 3
    # once the capture ended: a tensor still alive is itself (dynamo guards some by identity),
    # one the step freed a stand-in, made for each check
    del view
    arguments = _arguments(recorded)
    first, second = arguments(), arguments()
    twin, twin_other = first["a"]
    # (no tensor comparison: a stand-in's data is never read, nor printed)
    assert twin_other is other and first["b"][0] is twin and second["a"][0] is not twin
    assert twin.shape == (4, 4) and twin.stride() == (6, 1) and twin.storage_offset() == 1
    assert twin.dtype == torch.float32 and twin.requires_grad and twin.device == other.device
    # on a storage of the original's size at a data pointer it does not own (0)
    assert twin.untyped_storage().nbytes() == base.untyped_storage().nbytes()
    assert twin.data_ptr() == 1 * twin.element_size()
    # views of one storage get stand-ins on one storage
    full = torch.randn(8)
    recorded = _recorded((full[:4], full[4:]), {})
    del full
    twins = _arguments({"t": recorded})()["t"]
    assert twins[0].untyped_storage()._cdata == twins[1].untyped_storage()._cdata
    # a parameter (long-lived, a subclass) is kept as it is
    parameter = torch.nn.Parameter(torch.ones(2))
    assert _recorded(parameter, {}) is parameter


class _Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class ScaledStack(nn.Module):
    """Blocks called in a loop, then a head whose output is scaled by ``scale``, a float a
    callback sets: with the blocks compiled as regions, dynamo runs this forward as written."""

    scale = 1.0

    def __init__(self, width=8, classes=3):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(3))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


class AlternatingModelScale(TrainerCallback):
    def on_train_epoch_start(self, trainer, **kwargs):
        trainer.model.scale = (1.0, 0.5)[(trainer.run_history.current_epoch - 1) % 2]


def _regional_runs(stack_class):
    """A stack of ``stack_class`` with its blocks compiled as regions, trained eagerly and on the
    graphed engine with its scale alternating by epoch: ``(eager, graphed, fasttrain's warnings)``."""

    def model():
        stack = stack_class()
        compile_regions(stack, _Block, backend="aot_eager")
        return stack

    case = Case(model=model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), data=vector_data, epochs=3)
    return eager_and(case, "cudagraph", AOT, callbacks=[AlternatingModelScale()], eval_dataset=None)


def test_a_forward_that_runs_uncompiled_inside_the_step_is_not_captured():
    # compile_regions breaks the graph at each block, inside the forward's loop, so dynamo runs
    # the forward as written: its scale would be replayed as the capture saw it (the stand-in's
    # replay refused the third epoch's before), and no guard holds it
    eager, graphed, messages = _regional_runs(ScaledStack)
    assert len(messages) == 1, messages
    assert "'calculate_train_batch_loss' hook cannot run in the 'cudagraph' engine" in messages[0]
    assert "ScaledStack.forward" in messages[0] and "runs uncompiled inside the captured step" in messages[0]
    assert "compile_regions makes one at each block" in messages[0] and "'compiled' engine" in messages[0]
    assert graphed.trainer.active_engine == "compiled" and _replays() == 0
    assert_runs_match(eager, graphed)


def test_the_users_code_is_told_from_the_libraries_that_run_the_step():
    assert _users_code(ScaledStack.forward.__code__)
    assert not _users_code(nn.Linear.forward.__code__) and not _users_code(Trainer.backward_step.__code__)
    assert not _users_code(compile("x = 1", "<eval_with_key>.3", "exec"))  # generated (an FX graph's)


def _returns_an_argument(a, b):
    c = a
    return c


def _reads_an_attribute(holder):
    return holder.k


def _branches(a):
    if a:
        return 1
    return 2


def test_a_function_that_reads_nothing_may_run_uncompiled():
    # dynamo skips a function it traced no operation in (torch 2.11: what is left of a hook
    # after its last graph break, `return None`): it reads nothing a replay would freeze
    assert _reads_nothing(_returns_an_argument.__code__)
    assert not _reads_nothing(_reads_an_attribute.__code__) and not _reads_nothing(_branches.__code__)
    assert not _reads_nothing(ScaledStack.forward.__code__)


class UnrolledScaledStack(ScaledStack):
    """The same blocks called one by one: dynamo resumes after each block's break, compiled."""

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[2](x)
        return self.head(x) * self.scale


def test_regions_called_one_by_one_keep_the_graphs_and_their_scale_is_checked():
    # every frame of the step is compiled (the code after each block a resume function): the
    # scale, read after the last block's break, is guarded there and checked before each replay
    eager, graphed, messages = _regional_runs(UnrolledScaledStack)
    assert messages == []
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and _replays() > 0
    assert_runs_match(eager, graphed)


def test_the_code_inductor_generates_is_not_taken_for_the_users():
    # Inductor's compiled graphs run from Python modules it writes to its cache directory: code
    # that runs uncompiled in every step by design (the other tests compile with aot_eager)
    case = mlp_case(epochs=2)
    eager, graphed, messages = eager_and(case, "cudagraph", None, eval_dataset=None)
    assert messages == []
    assert graphed.trainer.active_engine == "cudagraph" and _replays() > 0
    assert_runs_match(eager, graphed)



class _Scratch:
    """State a step keeps between two of its parts and clears at its end."""

    parts: list = []


def _through_scratch(output: dict) -> dict:
    _Scratch.parts = [output["loss"]]
    torch._dynamo.graph_break()
    output["loss"] = sum(_Scratch.parts) * 1.0
    _Scratch.parts = []
    return output


class KeepsScratchAcrossABreak(Trainer):
    def calculate_train_batch_loss(self, batch):
        return _through_scratch(super().calculate_train_batch_loss(batch))


class KeepsScratchAcrossABreakInEvaluation(Trainer):
    def calculate_eval_batch_loss(self, batch):
        return _through_scratch(super().calculate_eval_batch_loss(batch))


def test_a_frame_reading_state_the_step_sets_and_clears_is_refused_at_its_capture():
    # Its guards fail between steps (the list is empty then), so every replay would be refused
    # and captured again; the capture is refused at once instead, with the guard named, and
    # the step trains compiled, as eager does
    case = mlp_case(epochs=2, trainer_cls=KeepsScratchAcrossABreak)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, eval_dataset=None)
    engine = graphed.trainer._engine
    assert engine.active_engine == "compiled" and engine._recaptures == 0
    refusals = [m for m in messages if "sets and clears" in m]
    assert len(refusals) == 1 and "calculate_train_batch_loss" in refusals[0], messages
    assert "_Scratch" in refusals[0] and "parts" in refusals[0], refusals[0]
    assert_runs_match(eager, graphed)


def test_an_evaluation_frame_reading_state_the_step_sets_and_clears_is_refused_at_its_capture():
    case = mlp_case(epochs=2, trainer_cls=KeepsScratchAcrossABreakInEvaluation)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "compiled"
    assert engine._eval_recaptures == 0
    refusals = [m for m in messages if "sets and clears" in m]
    assert len(refusals) == 1 and "calculate_eval_batch_loss" in refusals[0], messages
    assert_runs_match(eager, graphed)

def test_plain_sgds_masked_skip_keeps_its_graphs_and_eagers_weights(monkeypatch):
    # The masked skip (a GPU's nonfinite="skip" for SGD, Adam, AdamW) keeps the parameters'
    # copies on itself during the optimizer's step; the frame after the step's graph break
    # guards on them. Checked between steps, that guard failed before every replay, and the
    # graphs were dropped and captured again at each first replay, without a warning.
    import functools

    from torch.utils.data import TensorDataset

    from fasttrain.engine import masked_step

    monkeypatch.setattr(masked_step, "host_read_is_free", lambda device: False)
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite="skip"), epochs=2, create_scheduler_fn=None)
    case.optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)
    x, y = case.data().tensors
    x = x.clone()
    x[58, 1] = float("inf")
    case.data = lambda: TensorDataset(x, y)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, eval_dataset=None)
    assert messages == []
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert engine._recaptures == 0 and _replays() > 0
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 2
    # the poisoned batches' losses are not finite in both runs
    e, a = eager.recorder, graphed.recorder
    torch.testing.assert_close(torch.tensor(a.train), torch.tensor(e.train), rtol=1e-4, atol=1e-5, equal_nan=True)
    assert sum(not torch.isfinite(torch.tensor(v)) for v in e.train) == 2
    assert eager.state.keys() == graphed.state.keys()
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)

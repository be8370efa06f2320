"""``callback_handler.callbacks`` is a public list: changing it in place or assigning a new one
changes which callbacks receive events from the next event on, also in the middle of an epoch
whose per-step handler lists the loops resolved at its start. The same scripts run under
pytorch-accelerated 0.1.61 deliver the same events."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import CallbackHandler, TrainerCallback

from tiny_regression import NO_WORKERS


def _callback_classes(base):
    """Callback classes on ``base`` (fasttrain's or the original's TrainerCallback) that record
    ``(name, event, detail)`` into a shared log."""

    class Logged(base):
        def __init__(self, name, log):
            self.name, self.log = name, log

        def on_train_step_end(self, trainer, batch=None, batch_output=None, step=None, **kwargs):
            self.log.append((self.name, "step_end", (trainer.run_history.current_epoch, step)))

        def on_train_epoch_end(self, trainer, **kwargs):
            self.log.append((self.name, "epoch_end", trainer.run_history.current_epoch))

    class EpochOnly(base):
        def __init__(self, name, log):
            self.name, self.log = name, log

        def on_train_epoch_end(self, trainer, **kwargs):
            self.log.append((self.name, "epoch_end", trainer.run_history.current_epoch))

    return Logged, EpochOnly


Logged, EpochOnly = _callback_classes(TrainerCallback)


def _named(cls, name, log):
    # one instance per class: the handler refuses two callbacks of the same class
    return type(f"{cls.__name__}_{name}", (cls,), {})(name, log)


def _dispatched(handler, event="on_train_step_end"):
    return [method.__self__.name for method in handler.handlers(event)]


# ----------------------------------------------------------------------------- the handler alone
MUTATIONS = {
    "append": lambda cbs, new: cbs.append(new),
    "insert": lambda cbs, new: cbs.insert(0, new),
    "extend": lambda cbs, new: cbs.extend([new]),
    "iadd": lambda cbs, new: cbs.__iadd__([new]),
    "remove": lambda cbs, new: cbs.remove(cbs[0]),
    "pop": lambda cbs, new: cbs.pop(0),
    "del": lambda cbs, new: cbs.__delitem__(0),
    "setitem": lambda cbs, new: cbs.__setitem__(1, new),
    "slice": lambda cbs, new: cbs.__setitem__(slice(0, 1), [new]),
    "reverse": lambda cbs, new: cbs.reverse(),
    "sort": lambda cbs, new: cbs.sort(key=lambda cb: cb.name, reverse=True),
    "clear": lambda cbs, new: cbs.clear(),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_list_mutator_updates_the_lists_the_loops_hold(mutation):
    log = []
    a, b, new = _named(Logged, "a", log), _named(Logged, "b", log), _named(Logged, "new", log)
    handler = CallbackHandler([a, b, _named(EpochOnly, "epoch_only", log)])
    held = handler.handlers("on_train_step_end")  # what train_epoch holds for the epoch
    assert _dispatched(handler) == ["a", "b"]
    MUTATIONS[mutation](handler.callbacks, new)
    expected = [cb.name for cb in handler.callbacks if isinstance(cb, Logged)]
    assert [m.__self__.name for m in held] == expected
    handler.call_methods(held, _FakeTrainer())
    assert [entry[0] for entry in log] == expected


def test_augmented_assignment_through_the_attribute_rebuilds_once_and_keeps_the_list():
    log = []
    handler = CallbackHandler([_named(Logged, "a", log)])
    kept = handler.callbacks
    held = handler.handlers("on_train_step_end")
    handler.callbacks += [_named(Logged, "b", log)]
    assert handler.callbacks is kept
    assert [m.__self__.name for m in held] == ["a", "b"]


def test_assigning_a_new_list_replaces_the_callbacks():
    log = []
    a, b, c = (_named(Logged, n, log) for n in "abc")
    handler = CallbackHandler([a, b])
    held = handler.handlers("on_train_step_end")
    epoch_end = handler.handlers("on_train_epoch_end")
    given = [c]
    handler.callbacks = given
    assert list(handler.callbacks) == [c] and list(handler) == [c] and len(handler) == 1
    assert [m.__self__ for m in held] == [c] and [m.__self__ for m in epoch_end] == [c]
    # the handler keeps a copy: the caller's list is its own
    given.append(a)
    assert [m.__self__ for m in held] == [c]
    handler.callbacks.append(a)
    assert [m.__self__ for m in held] == [c, a]


def test_clear_callbacks_leaves_a_list_taken_before_it_alone():
    log = []
    a = _named(Logged, "a", log)
    handler = CallbackHandler([a])
    before = handler.callbacks
    held = handler.handlers("on_train_step_end")
    handler.clear_callbacks()
    assert before == [a] and handler.callbacks == [] and held == []
    before.append(_named(Logged, "b", log))  # no longer the handler's list
    assert held == [] and handler.callbacks == []


def test_a_copied_handler_still_tracks_changes_to_its_list():
    log = []
    handler = CallbackHandler([_named(Logged, "a", log)])
    clone = copy.deepcopy(handler)
    held = clone.handlers("on_train_step_end")
    clone.callbacks.append(_named(Logged, "b", log))
    assert [m.__self__.name for m in held] == ["a", "b"]
    assert _dispatched(handler) == ["a"]


def test_a_shallow_copy_does_not_share_the_lists_the_loops_hold():
    log = []
    handler = CallbackHandler([_named(Logged, "a", log)])
    held = handler.handlers("on_train_step_end")
    clone = copy.copy(handler)
    clone.callbacks.clear()
    assert [m.__self__.name for m in held] == ["a"] and _dispatched(handler) == ["a"]
    assert clone.handlers("on_train_step_end") == []


class _FakeTrainer:
    class run_history:
        current_epoch = 1


# ----------------------------------------------------------------------------- during training
def _dataset(n=12):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _run(trainer_cls, callbacks, num_epochs=2, **trainer_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = trainer_cls(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                          callbacks=callbacks, **trainer_kwargs)
    # 12 samples in batches of 4: steps 0, 1, 2 in each epoch
    trainer.train(_dataset(), num_epochs=num_epochs, per_device_batch_size=4,
                  train_dataloader_kwargs=dict(NO_WORKERS))
    return trainer


def _scenarios(base):
    """Callback lists, built on ``base``, whose callbacks change ``trainer.callback_handler
    .callbacks`` during training; each returns ``(callbacks, log)``."""
    Logged, EpochOnly = _callback_classes(base)

    def named(cls, name, log):
        return type(f"{cls.__name__}_{name}", (cls,), {})(name, log)

    def step_end_remover(victim):
        class Remover(base):
            def on_train_step_end(self, trainer, step=None, **kwargs):
                if trainer.run_history.current_epoch == 1 and step == 1:
                    trainer.callback_handler.callbacks.remove(victim)

        return Remover()

    def remove_later_at_step_end():
        log = []
        victim = named(Logged, "victim", log)
        return [step_end_remover(victim), victim, named(EpochOnly, "watcher", log)], log

    def remove_earlier_at_step_end():
        log = []
        victim = named(Logged, "victim", log)
        # the victim runs before the remover: it has already had this step's event
        return [victim, step_end_remover(victim), named(Logged, "after", log)], log

    def remove_at_epoch_end():
        log = []
        victim = named(Logged, "victim", log)

        class Remover(base):
            def on_train_epoch_end(self, trainer, **kwargs):
                if victim in trainer.callback_handler.callbacks:
                    trainer.callback_handler.callbacks.remove(victim)

        return [Remover(), victim, named(Logged, "kept", log)], log

    def append_and_reassign_mid_epoch():
        log = []
        late = named(Logged, "late", log)
        kept = named(Logged, "kept", log)

        class Changer(base):
            def on_train_step_end(self, trainer, step=None, **kwargs):
                epoch = trainer.run_history.current_epoch
                if epoch == 1 and step == 0:
                    trainer.callback_handler.callbacks.append(late)
                elif epoch == 2 and step == 1:
                    trainer.callback_handler.callbacks = [self, late]

        return [Changer(), kept], log

    return {
        "remove_later_at_step_end": remove_later_at_step_end,
        "remove_earlier_at_step_end": remove_earlier_at_step_end,
        "remove_at_epoch_end": remove_at_epoch_end,
        "append_and_reassign_mid_epoch": append_and_reassign_mid_epoch,
    }


EXPECTED = {
    # removed during step 1's event, before its turn: no event from then on
    "remove_later_at_step_end": [
        ("victim", "step_end", (1, 0)),
        ("watcher", "epoch_end", 1),
        ("watcher", "epoch_end", 2),
    ],
    # removed after its own turn in step 1's event: the list shifts under that delivery, so the
    # callback after the remover misses step 1 (the CallbackHandler docstring says so)
    "remove_earlier_at_step_end": [
        ("victim", "step_end", (1, 0)), ("after", "step_end", (1, 0)),
        ("victim", "step_end", (1, 1)),
        ("after", "step_end", (1, 2)), ("after", "epoch_end", 1),
        ("after", "step_end", (2, 0)), ("after", "step_end", (2, 1)),
        ("after", "step_end", (2, 2)), ("after", "epoch_end", 2),
    ],
    # removed in the first epoch-end event, before its turn: the second epoch's steps go without it
    "remove_at_epoch_end": [
        ("victim", "step_end", (1, 0)), ("kept", "step_end", (1, 0)),
        ("victim", "step_end", (1, 1)), ("kept", "step_end", (1, 1)),
        ("victim", "step_end", (1, 2)), ("kept", "step_end", (1, 2)),
        ("kept", "epoch_end", 1),
        ("kept", "step_end", (2, 0)), ("kept", "step_end", (2, 1)),
        ("kept", "step_end", (2, 2)), ("kept", "epoch_end", 2),
    ],
    # appended at the end of the list during step 0's event: it joins that event already
    "append_and_reassign_mid_epoch": [
        ("kept", "step_end", (1, 0)), ("late", "step_end", (1, 0)),
        ("kept", "step_end", (1, 1)), ("late", "step_end", (1, 1)),
        ("kept", "step_end", (1, 2)), ("late", "step_end", (1, 2)),
        ("kept", "epoch_end", 1), ("late", "epoch_end", 1),
        ("kept", "step_end", (2, 0)), ("late", "step_end", (2, 0)),
        ("late", "step_end", (2, 1)),
        ("late", "step_end", (2, 2)), ("late", "epoch_end", 2),
    ],
}


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_changes_made_during_training_apply_from_the_next_event(scenario):
    callbacks, log = _scenarios(TrainerCallback)[scenario]()
    _run(Trainer, callbacks, seed=0)
    assert log == EXPECTED[scenario]


# The one difference: an assignment to ``callbacks`` made while an event is being delivered. The
# original's delivery goes on over the list it started with (its loop holds the old list object),
# so "kept" still gets step (2, 1); fasttrain updates the delivery in progress as for an in-place
# change, so a callback assigned away gets no further call. Both apply the new list from the next
# event on, which is what scripts depend on.
EXPECTED_ORIGINAL = dict(EXPECTED)
_reassigned = list(EXPECTED["append_and_reassign_mid_epoch"])
_reassigned.insert(_reassigned.index(("late", "step_end", (2, 1))), ("kept", "step_end", (2, 1)))
EXPECTED_ORIGINAL["append_and_reassign_mid_epoch"] = _reassigned


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_pytorch_accelerated_delivers_the_same_events(scenario):
    pa_trainer = pytest.importorskip("pytorch_accelerated.trainer")
    pa_callbacks = pytest.importorskip("pytorch_accelerated.callbacks")
    callbacks, log = _scenarios(pa_callbacks.TrainerCallback)[scenario]()
    _run(pa_trainer.Trainer, callbacks)
    assert log == EXPECTED_ORIGINAL[scenario]


def test_a_step_callback_removed_mid_epoch_leaves_the_eval_loop_too():
    log = []

    class EvalLogged(TrainerCallback):
        def on_eval_step_end(self, trainer, **kwargs):
            log.append("eval_step")

    watcher = EvalLogged()

    class Remover(TrainerCallback):
        def on_eval_step_end(self, trainer, **kwargs):
            if len(log) == 2:
                trainer.callback_handler.callbacks.remove(watcher)

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[Remover, watcher], seed=0)
    trainer.evaluate(_dataset(), per_device_batch_size=4, dataloader_kwargs=dict(NO_WORKERS))
    assert log == ["eval_step", "eval_step"]  # three eval steps; removed during the third

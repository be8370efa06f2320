"""Values a scheduler factory may ask for before the trainer knows them.

A learning-rate scheduler often needs the number of epochs or of optimizer updates per epoch, which
are only known once ``Trainer.train`` has built its dataloaders. A script therefore writes a
placeholder into the keyword arguments of a ``functools.partial``::

    from functools import partial
    from torch.optim.lr_scheduler import OneCycleLR
    from fasttrain import TrainerPlaceholderValues as P

    create_scheduler_fn = partial(
        OneCycleLR,
        max_lr=0.01,
        epochs=P.NUM_EPOCHS,
        steps_per_epoch=P.NUM_UPDATE_STEPS_PER_EPOCH,
    )

and the trainer calls :func:`resolve_placeholders` once the numbers exist. A placeholder may be
scaled or shifted once, ``P.NUM_EPOCHS * 2`` or ``P.NUM_EPOCHS + 1``; the result is a
:class:`DerivedPlaceholder`, computed arithmetically at resolution (never with ``eval``).
"""

from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping, Tuple, Union

__all__ = [
    "TrainerPlaceholderValues",
    "DerivedPlaceholder",
    "is_placeholder",
    "resolve_placeholder",
    "resolve_placeholders",
]

_OPERATORS = {"*": operator.mul, "+": operator.add}


def _check_operand(placeholder_name: str, symbol: str, other: Any) -> None:
    if isinstance(other, (TrainerPlaceholderValues, DerivedPlaceholder)):
        raise TypeError(
            f"Cannot combine two placeholders ({placeholder_name} {symbol} {other!r}); "
            "the operand must be a number, such as TrainerPlaceholderValues.NUM_EPOCHS * 2."
        )
    if not isinstance(other, numbers.Real):
        raise TypeError(
            f"A placeholder can only be combined with a number, got {type(other).__name__} "
            f"({other!r}) in {placeholder_name} {symbol} ..."
        )


def _no_subtraction(name: str, other: Any):
    raise NotImplementedError(
        f"Subtraction is not supported for placeholders: instead of {name} - {other!r}, "
        f"write {name} + (-{other!r})."
    )


def _reflected(name: str, symbol: str, other: Any):
    raise TypeError(
        f"Write the placeholder first: use {name} {symbol} {other!r} instead of "
        f"{other!r} {symbol} {name}."
    )


class TrainerPlaceholderValues(Enum):
    """Run quantities that are filled in once the trainer has created its dataloaders.

    Members are resolved by name; the trainer supplies, per member:

    - ``NUM_EPOCHS``: epochs in the run (derived from ``max_num_train_steps`` when given);
    - ``NUM_UPDATE_STEPS_PER_EPOCH``: optimizer updates per epoch, as counted on the
      training dataloader after it is prepared for distribution;
    - ``PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH``: the same, per process;
    - ``TRAIN_DATALOADER_LEN`` and ``EVAL_DATALOADER_LEN``: batches per epoch of each dataloader.
    """

    NUM_EPOCHS = "num_epochs"
    NUM_UPDATE_STEPS_PER_EPOCH = "num_update_steps_per_epoch"
    PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH = "num_local_update_steps_per_epoch"
    TRAIN_DATALOADER_LEN = "train_dataloader_len"
    EVAL_DATALOADER_LEN = "eval_dataloader_len"

    @classmethod
    def placeholder_set(cls) -> set:
        """Return the names of all members."""
        return {member.name for member in cls}

    def resolve(self, values: Mapping[str, Union[int, float]]):
        """Return the number ``values`` gives for this member."""
        return _lookup(self.name, values)

    def __mul__(self, other) -> "DerivedPlaceholder":
        _check_operand(self.name, "*", other)
        return DerivedPlaceholder(self, (("*", other),))

    def __add__(self, other) -> "DerivedPlaceholder":
        _check_operand(self.name, "+", other)
        return DerivedPlaceholder(self, (("+", other),))

    def __sub__(self, other):
        _no_subtraction(self.name, other)

    def __rsub__(self, other):
        _no_subtraction(self.name, other)

    def __rmul__(self, other):
        _reflected(self.name, "*", other)

    def __radd__(self, other):
        _reflected(self.name, "+", other)


@dataclass(frozen=True)
class DerivedPlaceholder:
    """A placeholder followed by arithmetic, such as ``NUM_UPDATE_STEPS_PER_EPOCH * 5``.

    ``operations`` is a tuple of ``(symbol, number)`` pairs applied left to right to the
    resolved base value. ``name`` is the base member's name, so code that identifies
    placeholders by ``.name`` (as pytorch-accelerated does) keeps working.
    """

    base: TrainerPlaceholderValues
    operations: Tuple[Tuple[str, Union[int, float]], ...]

    @property
    def name(self) -> str:
        return self.base.name

    def resolve(self, values: Mapping[str, Union[int, float]]):
        """Return the base member's number with the operations applied in order."""
        result = self.base.resolve(values)
        for symbol, operand in self.operations:
            result = _OPERATORS[symbol](result, operand)
        return result

    def _chain_error(self, symbol: str, other: Any):
        # pytorch-accelerated 0.1.61 rejects a second operation too; allowing it here would let
        # scripts written for fasttrain fail when run on the original.
        raise TypeError(
            f"A placeholder supports a single '* n' or '+ n' ({self!r} {symbol} {other!r} "
            "applies a second one). Compute the combined value inside your scheduler factory, "
            "or pass two keyword arguments and combine them there."
        )

    def __mul__(self, other):
        self._chain_error("*", other)

    def __add__(self, other):
        self._chain_error("+", other)

    def __sub__(self, other):
        _no_subtraction(repr(self), other)

    def __rsub__(self, other):
        _no_subtraction(repr(self), other)

    def __rmul__(self, other):
        _reflected(repr(self), "*", other)

    def __radd__(self, other):
        _reflected(repr(self), "+", other)

    def __repr__(self) -> str:
        text = f"TrainerPlaceholderValues.{self.base.name}"
        for symbol, operand in self.operations:
            text = f"{text} {symbol} {operand!r}"
        return text


def _lookup(name: str, values: Mapping[str, Union[int, float]]):
    value = values.get(name)
    if value is None:
        known = sorted(k for k, v in values.items() if v is not None)
        raise ValueError(
            f"No value is available for the placeholder {name} in this run (known: {known}). "
            "EVAL_DATALOADER_LEN needs an eval_dataset; otherwise check the trainer's "
            "placeholder values."
        )
    return value


def is_placeholder(value: Any) -> bool:
    """Return True for a placeholder member or a placeholder with arithmetic applied."""
    return isinstance(value, (TrainerPlaceholderValues, DerivedPlaceholder))


def resolve_placeholder(value: Any, values: Mapping[str, Union[int, float]]):
    """Return ``value`` with a placeholder replaced by its number; other values unchanged."""
    if is_placeholder(value):
        return value.resolve(values)
    return value


def resolve_placeholders(
    create_scheduler_fn: Callable, values: Mapping[str, Union[int, float]]
) -> Callable:
    """Replace the placeholders in a scheduler factory by the numbers of this run.

    :param create_scheduler_fn: the factory given to ``Trainer.train``. When it is a
        ``functools.partial``, a new partial is returned whose placeholder keyword values are
        replaced; any other callable is returned unchanged.
    :param values: maps a member name (``"NUM_EPOCHS"``, ...) to its number.
    :raises ValueError: a placeholder is a positional argument of the partial, or was passed
        instead of a callable; placeholders are only read from keyword arguments.
    :raises TypeError: ``create_scheduler_fn`` is not callable.
    """
    if is_placeholder(create_scheduler_fn):
        raise ValueError(
            f"create_scheduler_fn is the placeholder {create_scheduler_fn!r}, not a factory. "
            "Pass the placeholder as a keyword argument of functools.partial, e.g. "
            "partial(MyScheduler, total_num_epochs=TrainerPlaceholderValues.NUM_EPOCHS)."
        )
    if not callable(create_scheduler_fn):
        raise TypeError(
            f"create_scheduler_fn must be a callable that takes the optimizer and returns a "
            f"scheduler (for example a functools.partial), got {type(create_scheduler_fn).__name__}: "
            f"{create_scheduler_fn!r}."
        )
    if not isinstance(create_scheduler_fn, functools.partial):
        return create_scheduler_fn

    for position, arg in enumerate(create_scheduler_fn.args):
        if is_placeholder(arg):
            raise ValueError(
                f"The placeholder {arg!r} is positional argument {position} of the "
                "functools.partial given as create_scheduler_fn; placeholders are only "
                "replaced in keyword arguments. Pass it as a keyword argument of "
                "functools.partial, e.g. partial(MyScheduler, total_num_epochs=...)."
            )

    keywords = {
        key: resolve_placeholder(value, values)
        for key, value in create_scheduler_fn.keywords.items()
    }
    return functools.partial(create_scheduler_fn.func, *create_scheduler_fn.args, **keywords)

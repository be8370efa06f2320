"""Placeholders: arithmetic, resolution in functools.partial, parity with pytorch-accelerated."""

import ast
import pathlib
from functools import partial
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fasttrain.placeholders as placeholders_module
from fasttrain.placeholders import (
    DerivedPlaceholder,
    TrainerPlaceholderValues as P,
    is_placeholder,
    resolve_placeholders,
)

MEMBER_NAMES = [
    "NUM_EPOCHS",
    "NUM_UPDATE_STEPS_PER_EPOCH",
    "PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH",
    "TRAIN_DATALOADER_LEN",
    "EVAL_DATALOADER_LEN",
]


def record(**kwargs):
    return kwargs


def original_resolution(keywords, values):
    """Resolve ``keywords`` (holding the original's placeholders) the way pytorch-accelerated's
    trainer does, against a stand-in trainer carrying ``values``."""
    trainer_module = pytest.importorskip("pytorch_accelerated.trainer")
    trainer = SimpleNamespace(
        run_config=SimpleNamespace(
            num_epochs=values["NUM_EPOCHS"],
            num_update_steps_per_epoch=values["NUM_UPDATE_STEPS_PER_EPOCH"],
            num_local_update_steps_per_epoch=values["PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH"],
        ),
        _train_dataloader=[None] * values["TRAIN_DATALOADER_LEN"],
        _eval_dataloader=[None] * values["EVAL_DATALOADER_LEN"],
    )
    factory = trainer_module.replace_trainer_placeholder_values(trainer, partial(record, **keywords))
    return factory()


values_strategy = st.fixed_dictionaries({name: st.integers(1, 10_000) for name in MEMBER_NAMES})
operand = st.one_of(st.integers(-1000, 1000), st.sampled_from([0.5, 1.5, 2.25]))


def test_members_and_placeholder_set_match_original():
    original = pytest.importorskip("pytorch_accelerated")
    assert [m.name for m in P] == MEMBER_NAMES
    assert P.placeholder_set() == original.TrainerPlaceholderValues.placeholder_set()


@settings(max_examples=150, deadline=None, database=None)
@given(values_strategy, st.sampled_from(MEMBER_NAMES), st.sampled_from(["*", "+", None]), operand)
def test_arithmetic_equals_integer_arithmetic_and_the_original(values, name, op, number):
    original = pytest.importorskip("pytorch_accelerated")
    ours, theirs = P[name], original.TrainerPlaceholderValues[name]
    expected = values[name]
    if op == "*":
        ours, theirs, expected = ours * number, theirs * number, expected * number
    elif op == "+":
        ours, theirs, expected = ours + number, theirs + number, expected + number
    assert is_placeholder(ours)
    assert ours.name == name
    resolved = resolve_placeholders(partial(record, value=ours), values)()["value"]
    assert resolved == expected and type(resolved) is type(expected)
    assert original_resolution({"value": theirs}, values)["value"] == resolved


def test_derived_placeholder_structure():
    derived = P.NUM_UPDATE_STEPS_PER_EPOCH * 5
    assert isinstance(derived, DerivedPlaceholder)
    assert derived.base is P.NUM_UPDATE_STEPS_PER_EPOCH
    assert derived.operations == (("*", 5),)
    assert derived == P.NUM_UPDATE_STEPS_PER_EPOCH * 5
    assert derived != P.NUM_UPDATE_STEPS_PER_EPOCH * 6
    assert repr(P.NUM_EPOCHS + 2) == "TrainerPlaceholderValues.NUM_EPOCHS + 2"
    assert derived.resolve({"NUM_UPDATE_STEPS_PER_EPOCH": 7}) == 35


def test_chaining_and_reflected_operations_are_rejected_like_the_original():
    original = pytest.importorskip("pytorch_accelerated")
    OP = original.TrainerPlaceholderValues
    for expression in (
        lambda p: (p.NUM_EPOCHS + 1) * 2,
        lambda p: (p.NUM_EPOCHS * 2) + 1,
        lambda p: 2 * p.NUM_EPOCHS,
        lambda p: 1 + p.NUM_EPOCHS,
    ):
        with pytest.raises(TypeError):
            expression(OP)
        with pytest.raises(TypeError, match="placeholder"):
            expression(P)


def test_subtraction_raises_a_clear_error_like_the_original():
    original = pytest.importorskip("pytorch_accelerated")
    with pytest.raises(NotImplementedError):
        original.TrainerPlaceholderValues.NUM_EPOCHS - 1
    with pytest.raises(NotImplementedError, match=r"NUM_EPOCHS \+ \(-1\)"):
        P.NUM_EPOCHS - 1
    with pytest.raises(NotImplementedError, match="Subtraction"):
        (P.NUM_EPOCHS * 2) - 1
    with pytest.raises(NotImplementedError, match="Subtraction"):
        10 - P.NUM_EPOCHS


@pytest.mark.parametrize("operand", ["2", None, [1], P.NUM_EPOCHS, P.NUM_EPOCHS * 2])
def test_non_number_operands_are_rejected(operand):
    with pytest.raises(TypeError, match="number|placeholders"):
        P.NUM_EPOCHS * operand
    with pytest.raises(TypeError, match="number|placeholders"):
        P.NUM_EPOCHS + operand


def test_resolution_replaces_keywords_only_and_keeps_other_arguments():
    factory = partial(
        record,
        epochs=P.NUM_EPOCHS,
        steps=P.NUM_UPDATE_STEPS_PER_EPOCH,
        warmup=P.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH * 3,
        eval_len=P.EVAL_DATALOADER_LEN + 1,
        lr=0.1,
        name="cosine",
    )
    values = dict(zip(MEMBER_NAMES, (4, 10, 5, 40, 8)))
    resolved = resolve_placeholders(factory, values)
    assert isinstance(resolved, partial) and resolved is not factory
    assert resolved() == dict(epochs=4, steps=10, warmup=15, eval_len=9, lr=0.1, name="cosine")
    assert factory.keywords["epochs"] is P.NUM_EPOCHS  # the user's partial is not modified

    positional = partial(lambda a, b, **kw: (a, b, kw), 1, 2, epochs=P.NUM_EPOCHS)
    assert resolve_placeholders(positional, values)() == (1, 2, {"epochs": 4})


def test_resolution_matches_the_original_for_every_member():
    original = pytest.importorskip("pytorch_accelerated")
    OP = original.TrainerPlaceholderValues
    values = dict(zip(MEMBER_NAMES, (3, 17, 9, 68, 11)))
    ours = {name.lower(): P[name] for name in MEMBER_NAMES}
    theirs = {name.lower(): OP[name] for name in MEMBER_NAMES}
    ours.update(scaled=P.NUM_EPOCHS * 2.5, shifted=P.TRAIN_DATALOADER_LEN + -4, plain=7)
    theirs.update(scaled=OP.NUM_EPOCHS * 2.5, shifted=OP.TRAIN_DATALOADER_LEN + -4, plain=7)
    assert resolve_placeholders(partial(record, **ours), values)() == original_resolution(theirs, values)


def test_positional_placeholder_is_an_error_naming_the_fix():
    factory = partial(record.__call__, P.NUM_EPOCHS)
    with pytest.raises(ValueError, match="keyword argument of functools.partial"):
        resolve_placeholders(factory, {"NUM_EPOCHS": 2})


@pytest.mark.parametrize("bare", [P.NUM_EPOCHS, P.NUM_EPOCHS * 2])
def test_bare_placeholder_instead_of_a_factory_is_an_error(bare):
    with pytest.raises(ValueError, match="keyword argument of functools.partial"):
        resolve_placeholders(bare, {"NUM_EPOCHS": 2})


@pytest.mark.parametrize("not_callable", [3, "cosine", None, [1, 2]])
def test_non_callable_factory_is_a_type_error_naming_it(not_callable):
    with pytest.raises(TypeError, match=type(not_callable).__name__) as info:
        resolve_placeholders(not_callable, {})
    assert "callable" in str(info.value) and repr(not_callable) in str(info.value)


def test_plain_callables_are_returned_unchanged():
    def factory(optimizer):
        return optimizer

    assert resolve_placeholders(factory, {}) is factory


def test_missing_value_is_a_clear_error():
    factory = partial(record, n=P.EVAL_DATALOADER_LEN)
    with pytest.raises(ValueError, match="EVAL_DATALOADER_LEN"):
        resolve_placeholders(factory, {"NUM_EPOCHS": 1, "EVAL_DATALOADER_LEN": None})


def _called_names(path):
    tree = ast.parse(pathlib.Path(path).read_text())
    return {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }, tree


def test_module_uses_no_eval_and_does_not_import_the_trainer():
    called, tree = _called_names(placeholders_module.__file__)
    assert not called & {"eval", "exec", "compile", "__import__"}
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.startswith("fasttrain") for name in imported)

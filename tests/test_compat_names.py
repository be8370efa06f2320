"""Every public name of pytorch-accelerated 0.1.61 resolves under the same module path in
fasttrain, with a compatible kind and call signature, so that a script changes only its import."""

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

pa = pytest.importorskip("pytorch_accelerated")


def _original_modules():
    names = ["pytorch_accelerated"]
    for info in pkgutil.walk_packages(pa.__path__, prefix="pytorch_accelerated."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return names


def _is_library_name(value) -> bool:
    """Whether ``value`` is something a user could import from the original's module: not a
    module the original imports for itself, nor a standard-library helper it happens to use."""
    if inspect.ismodule(value):
        return False
    module = getattr(value, "__module__", None) or type(value).__module__ or ""
    root = module.split(".")[0]
    return root not in sys.stdlib_module_names and root != "builtins"


def _public_names():
    for module_name in _original_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if not name.startswith("_") and _is_library_name(value):
                yield module_name, name, value


PUBLIC_NAMES = list(_public_names())


def test_walk_finds_the_names_scripts_use():
    found = {(module, name) for module, name, _ in PUBLIC_NAMES}
    assert ("pytorch_accelerated", "set_seed") in found
    assert ("pytorch_accelerated.trainer", "TerminateOnNaNCallback") in found
    assert ("pytorch_accelerated.callbacks", "ModelEma") in found
    assert ("pytorch_accelerated.schedulers", "WSDLrScheduler") in found
    assert len(PUBLIC_NAMES) > 80


def _positional_parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]


@pytest.mark.parametrize(
    "module_name,name,original",
    PUBLIC_NAMES,
    ids=[f"{module}.{name}" for module, name, _ in PUBLIC_NAMES],
)
def test_public_name_resolves_in_fasttrain(module_name, name, original):
    module = importlib.import_module(module_name.replace("pytorch_accelerated", "fasttrain", 1))
    assert hasattr(module, name), f"{module.__name__} lacks {name}"
    ours = getattr(module, name)
    assert inspect.isclass(ours) == inspect.isclass(original)
    assert callable(ours) == callable(original)
    theirs = _positional_parameters(original) if callable(original) else None
    if theirs is not None and getattr(original, "__module__", "").startswith("pytorch_accelerated"):
        # arguments passed by position in the original land on the same parameter here
        assert _positional_parameters(ours)[: len(theirs)] == theirs


# ----------------------------------------------------------------------------- methods
# Underscore methods that are part of the surface: the original's own methods call them, so a
# subclass overrides them to change what the class does (or the migration guide lists them as
# private names kept for compatibility).
TRAINER_SEAMS = (
    "_create_accelerator", "_create_callback_handler", "_perform_forward_and_backward_passes",
    "_prepare_model_optimizer_and_dataloaders", "_create_run_config", "_check_eval_batch_size",
    "_run_training", "_run_evaluation", "_run_train_epoch", "_run_eval_epoch", "_clip_gradients",
)
EXTENSION_POINTS = {
    "LogMetricsCallback": ("_log_latest_metrics", "_get_latest_metrics"),
    "MoveModulesToDeviceCallback": ("_get_modules", "_move_modules_to_device"),
    "SaveTrainingStateCallback": ("_save", "_cleanup_old_checkpoints"),
    "WSDCheckpointCallback": (
        "_get_export_checkpoint_path", "_get_training_state_path", "_save_pre_decay", "_save_post_decay",
    ),
    "Trainer": TRAINER_SEAMS,
    "TrainerWithTimmScheduler": TRAINER_SEAMS,
    "ModelFreezer": ("_convert_idxs",),
    "WSDLrScheduler": ("_get_checkpoint_info",),
}

# (class, method): why fasttrain's parameters differ from the original's on purpose
DELIBERATE = {
    ("SaveBestModelCallback", "on_training_run_start"): (
        "the original names the trainer parameter `args`; every event gets the trainer as its "
        "first positional argument, named `trainer` as in TrainerCallback"
    ),
    ("EarlyStoppingCallback", "on_training_run_start"): (
        "the original names the trainer parameter `args`; every event gets the trainer as its "
        "first positional argument, named `trainer` as in TrainerCallback"
    ),
    ("TerminateOnNaNCallback", "on_train_step_end"): (
        "fasttrain's callback checks at flushes and keeps TrainerCallback's no-op per-step "
        "events, so the per-step dispatch skips it; a subclass that overrides "
        "check_for_nan_after_batch gets handlers with the original's parameters (checked below)"
    ),
    ("TerminateOnNaNCallback", "on_eval_step_end"): (
        "as on_train_step_end: no per-step handler unless a subclass asks for the per-step check"
    ),
    ("ModelFreezer", "_convert_idxs"): (
        "named like freeze/unfreeze's from_index, to_index; the original calls it positionally, "
        "and so do the scripts that reach it"
    ),
}

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _original_classes():
    """Every class the original defines, once, with the module a script imports it from."""
    seen = {}
    for module_name, name, value in PUBLIC_NAMES:
        if inspect.isclass(value) and value.__module__.startswith("pytorch_accelerated"):
            seen.setdefault(value, (module_name, name))
    return [(module_name, name, cls) for cls, (module_name, name) in seen.items()]


def _defined_by_original(cls, attr) -> bool:
    owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
    return owner is not None and owner.__module__.startswith("pytorch_accelerated")


def _unwrap(raw):
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _members():
    """``(module, class, attribute)`` for the public attributes, and the extension points, that
    the original's classes define themselves (not those inherited from object, ABC, Enum...)."""
    for module_name, name, cls in _original_classes():
        attrs = [a for a in dir(cls) if not a.startswith("_")] + ["__init__"]
        attrs += [a for a in EXTENSION_POINTS.get(name, ()) if a not in attrs]
        for attr in attrs:
            if _defined_by_original(cls, attr):
                yield module_name, name, attr


MEMBERS = list(_members())


def _params(function):
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def _fasttrain_only(theirs, ours):
    """The parameters fasttrain adds, when the rest equal the original's in name, kind and order;
    None when they do not."""
    extra = [p for p in ours if p not in theirs]
    kept = [p for p in ours if p in theirs]
    return extra if kept == theirs else None


def _fasttrain_class(module_name, name):
    return getattr(importlib.import_module(module_name.replace("pytorch_accelerated", "fasttrain", 1)), name)


def test_walk_finds_the_methods_scripts_call():
    found = {(cls, attr) for _, cls, attr in MEMBERS}
    for member in [
        ("StatefulSchedulerBase", "load_state_dict"),
        ("CosineLrScheduler", "create_scheduler_fn"),
        ("LogMetricsCallback", "_get_latest_metrics"),
        ("LogMetricsCallback", "log_metrics"),
        ("CallbackHandler", "add_callback"),
        ("Trainer", "train"),
        ("Trainer", "__init__"),
        ("InMemoryRunHistory", "get_latest_metric"),
    ]:
        assert member in found
    assert set(DELIBERATE) <= found
    assert len(MEMBERS) > 250


@pytest.mark.parametrize(
    "module_name,name,attr", MEMBERS, ids=[f"{module}.{cls}.{attr}" for module, cls, attr in MEMBERS]
)
def test_methods_take_the_original_parameters(module_name, name, attr):
    original = getattr(importlib.import_module(module_name), name)
    ours = _fasttrain_class(module_name, name)
    theirs_raw = inspect.getattr_static(original, attr)
    ours_raw = inspect.getattr_static(ours, attr, None)
    assert ours_raw is not None, f"{ours.__qualname__} lacks {attr}"
    theirs_fn, ours_fn = _unwrap(theirs_raw), _unwrap(ours_raw)
    if not inspect.isfunction(theirs_fn):
        return  # a property, a constant or an enum member: present is what counts
    assert isinstance(ours_raw, classmethod) == isinstance(theirs_raw, classmethod)
    assert isinstance(ours_raw, staticmethod) == isinstance(theirs_raw, staticmethod)
    assert callable(ours_fn)
    theirs, mine = _params(theirs_fn), _params(ours_fn)
    extra = _fasttrain_only(theirs, mine)
    if (name, attr) in DELIBERATE:
        assert extra is None or extra, f"{name}.{attr} now matches the original: drop it from DELIBERATE"
        return
    assert extra is not None, (
        f"{name}.{attr}: the original takes {theirs_fn.__name__}{inspect.signature(theirs_fn)}, "
        f"fasttrain {inspect.signature(ours_fn)}; give it the original's parameter names and kinds"
    )
    # fasttrain's own parameters come after the original's, keyword-only with a default
    parameters = inspect.signature(ours_fn).parameters
    for param_name, kind in extra:
        assert kind is inspect.Parameter.KEYWORD_ONLY, f"{name}.{attr}: make {param_name} keyword-only"
        assert parameters[param_name].default is not inspect.Parameter.empty


def _documented(word: str) -> bool:
    return any(f"`{word}`" in text or f"{word}=" in text for text in (p.read_text() for p in DOCS.glob("*.md")))


def test_fasttrain_only_parameters_are_documented():
    undocumented = []
    for module_name, name, attr in MEMBERS:
        original = getattr(importlib.import_module(module_name), name)
        theirs_fn = _unwrap(inspect.getattr_static(original, attr))
        if not inspect.isfunction(theirs_fn) or (name, attr) in DELIBERATE:
            continue
        ours_fn = _unwrap(inspect.getattr_static(_fasttrain_class(module_name, name), attr))
        extra = _fasttrain_only(_params(theirs_fn), _params(ours_fn)) or []
        undocumented += [(name, attr, p) for p, _ in extra if not _documented(p)]
    assert undocumented == []


def test_the_per_step_nan_check_of_a_subclass_takes_the_original_parameters():
    from pytorch_accelerated.callbacks import TerminateOnNaNCallback as Original

    from fasttrain.callbacks import TerminateOnNaNCallback

    with pytest.warns(UserWarning, match="check_for_nan_after_batch"):
        class Checked(TerminateOnNaNCallback):
            def check_for_nan_after_batch(self, batch_output, step=None):
                pass

    for event in ("on_train_step_end", "on_eval_step_end"):
        assert _params(getattr(Checked, event)) == _params(getattr(Original, event))

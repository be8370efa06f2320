"""Every public name of pytorch-accelerated 0.1.61 resolves under the same module path in
fasttrain, with a compatible kind and call signature, so that a script changes only its import."""

import importlib
import inspect
import pkgutil
import sys

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

"""The blocks a per-block transform applies to.

Activation checkpointing (:mod:`fasttrain.checkpoint_activations`) and regional compilation
(:mod:`fasttrain.regional`) both take module classes and replace the forward of the outermost
submodules of those classes; both choose them, and refuse what cannot be meant, here.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Type, Union

from torch import nn

ModuleTypes = Union[Type[nn.Module], Sequence[Type[nn.Module]]]


def as_module_types(module_types, option: str) -> Tuple[Type[nn.Module], ...]:
    """``module_types`` (one class or several) as a tuple of ``nn.Module`` subclasses; anything
    else is a ``TypeError`` that names ``option``."""
    types = (module_types,) if isinstance(module_types, type) else tuple(module_types or ())
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad or not types:
        raise TypeError(
            f"{option} takes nn.Module subclasses (e.g. {option}=MyBlock or (BlockA, BlockB)); "
            f"got {module_types!r}"
        )
    return types


def outermost_blocks(
    model: nn.Module, types: Tuple[Type[nn.Module], ...], option: str, whole_model: str
) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of each submodule of ``model`` whose class is in ``types``, in
    ``named_modules`` order, leaving out those inside another one (the outer block's transform
    covers them). A ``ValueError`` naming ``option`` when one of ``types`` is the model's own
    class (``whole_model`` says why that is not what to ask for) or when none is found."""
    chosen: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, types) or any(name.startswith(outer + ".") for outer, _ in chosen):
            continue
        if name == "":
            raise ValueError(f"{option} names the model's own class: {whole_model}; name its blocks")
        chosen.append((name, module))
    if not chosen:
        raise ValueError(f"{option}: the model has no submodule of type {[t.__name__ for t in types]}")
    return chosen

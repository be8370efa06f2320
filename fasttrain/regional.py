"""Regional compilation: compile each repeated block of a model instead of the whole model.

A transformer is a stack of identical blocks. Compiled whole, Dynamo traces and Inductor
optimises every block again, so compile time grows with depth. Compiled per block with
``nn.Module.compile``, the blocks share one graph: Dynamo treats a built-in module's parameters
as graph inputs (``inline_inbuilt_nn_modules``, torch's default), so the second and later blocks
of the same class hit the first block's cache entry instead of compiling. The first step then
costs about one block's compile, whatever the depth. The code between blocks (embedding, head,
loss) stays eager.

``Trainer(compile_regions=...)`` applies this to the model once, at construction. It is meant for
``engine="eager"`` (the compiled engine already compiles the whole forward, and tracing it inlines
the compiled blocks, so regional compilation adds nothing there; it stays correct).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple, Type, Union

from torch import nn

__all__ = ["compile_regions", "find_repeated_blocks"]

ModuleTypes = Union[Type[nn.Module], Sequence[Type[nn.Module]]]


def find_repeated_blocks(model: nn.Module) -> Tuple[Type[nn.Module], ...]:
    """The classes of the blocks that ``model`` stacks: the children of an ``nn.ModuleList`` or
    ``nn.Sequential`` that holds at least two modules of one class. Built-in torch modules
    (``Linear``, ``ReLU``...) are not blocks: compiling each separately saves nothing."""
    found: List[Type[nn.Module]] = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        classes = [type(child) for child in module.children()]
        for cls in dict.fromkeys(classes):
            if classes.count(cls) >= 2 and not cls.__module__.startswith("torch.") and cls not in found:
                found.append(cls)
    return tuple(found)


def _as_types(module_types, option: str) -> Tuple[Type[nn.Module], ...]:
    types = (module_types,) if isinstance(module_types, type) else tuple(module_types)
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad or not types:
        raise TypeError(
            f"{option} takes nn.Module subclasses (e.g. {option}=MyBlock or (BlockA, BlockB)); "
            f"got {module_types!r}"
        )
    return types


def compile_regions(
    model: nn.Module,
    module_types: Optional[ModuleTypes] = None,
    **compile_kwargs,
) -> List[str]:
    """Compile, in place, every submodule of ``model`` whose class is in ``module_types`` (by
    default the classes :func:`find_repeated_blocks` finds). ``compile_kwargs`` go to
    ``torch.compile`` (``fullgraph``, ``dynamic``, ``mode``, ``backend``, ``options``).

    Returns the names of the compiled submodules. Parameter names, ``state_dict`` keys and the
    module tree do not change, so checkpoints load into the model with or without it. A block
    inside another chosen block is left to its parent's compilation."""
    if module_types is None:
        types = find_repeated_blocks(model)
        if not types:
            raise ValueError(
                "compile_regions found no repeated blocks (an nn.ModuleList or nn.Sequential with "
                "two or more modules of one class of your own); name the block class instead, "
                "e.g. compile_regions(model, MyBlock)"
            )
    else:
        types = _as_types(module_types, "compile_regions")
    compiled: List[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, types):
            continue
        if any(name.startswith(prefix + ".") for prefix in compiled):
            continue  # inside a block already compiled
        module.compile(**compile_kwargs)
        compiled.append(name)
    if not compiled:
        raise ValueError(
            f"compile_regions: the model has no submodule of type {[t.__name__ for t in types]}"
        )
    return compiled


def compiled_region_names(model: nn.Module) -> Iterable[str]:
    """Names of the submodules that ``nn.Module.compile`` has compiled."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]

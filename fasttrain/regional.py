"""Regional compilation: compile each repeated block of a model instead of the whole model.

A transformer is a stack of identical blocks. Compiled whole, Dynamo traces and Inductor
optimises every block again, so compile time grows with depth. :func:`compile_regions` gives each
chosen block a forward compiled once for all blocks of its class, and run in two ways:

* called eagerly (``engine="eager"``), the block runs through ``torch.compile`` of its forward.
  Dynamo treats a built-in module's parameters as graph inputs (``inline_inbuilt_nn_modules``,
  torch's default), so the second and later blocks hit the first block's cache entry instead of
  compiling; the code between blocks (embedding, head, loss) stays eager. On the CPU the block
  compiles with Inductor's C++ wrapper (:func:`cpp_wrapper_options`) unless the compile settings
  say otherwise, and falls back to the Python wrapper, with a warning, where that fails;
* traced by an enclosing ``torch.compile`` (``engine="compiled"`` / ``"cudagraph"``, which
  compile the whole step, or the user's own compile), the graph breaks at each block and the
  block runs that same compiled forward. The step then is several graphs: the code before the
  first block, each block's shared graph, the code between blocks, and what follows the last
  (where the blocks are called in a loop, dynamo cannot resume inside it after a break and runs
  the rest of that forward uncompiled).

Either way the first step costs about one block's compile plus what surrounds the blocks, whatever
the depth.

Why not ``torch.compiler.nested_compile_region``, which keeps the step one graph and compiles a
block once inside it: in torch 2.13 with Inductor, blocks nested that way and followed by a
LayerNorm (a causal transformer's final norm before its head) get wrong gradients, up to several
times too large in the first block (exact with ``aot_eager``, right without the final norm;
``tests/test_regional.py`` trains such a model against eager). A graph break per block costs a
little Python per block and step and no fusion across block edges; it computes what eager does.

The marked function takes the block as an argument: marking each block's bound ``forward``
instead gave wrong losses in torch 2.13.
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Tuple, Type

import torch
from torch import nn

from fasttrain.blocks import ModuleTypes, as_module_types, outermost_blocks
from fasttrain.engine.compile_cache import with_own_dynamo_cache

__all__ = ["compile_regions", "compiled_region_names", "cpp_wrapper_options", "find_repeated_blocks"]


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


_MARK = "_fasttrain_compiled_region"


def _call_block(block: nn.Module, *args, **kwargs):
    return getattr(block, _MARK).forward(*args, **kwargs)


class _Region:
    """The compiled forms of one block class's forward, shared by all blocks of that class."""

    def __init__(self, compile_kwargs: dict):
        backend = _cpu_region_backend(compile_kwargs)
        if backend is not None:
            compile_kwargs = {key: value for key, value in compile_kwargs.items() if key not in ("mode", "options")}
            compile_kwargs["backend"] = backend
        # a cache per block class
        self.compiled = torch.compile(with_own_dynamo_cache(_call_block), **compile_kwargs)
        # inside an enclosing compile: a graph break, then this compiled forward (an inner
        # torch.compile would only be inlined into the enclosing trace otherwise). disable()
        # unwraps a compiled function to its source, so it is given a caller of it.
        compiled = self.compiled

        def run_compiled_block(block, *args, **kwargs):
            return compiled(block, *args, **kwargs)

        self.outside_trace = torch.compiler.disable(run_compiled_block)


def cpp_wrapper_options() -> dict:
    """The Inductor options regions compile with on the CPU: the C++ wrapper, built apart from
    the kernels where this torch can (``cpp_wrapper_build_separate``: the calling code then
    compiles without the kernels' optimisation work)."""
    from torch._inductor import config as inductor_config

    options = {"cpp_wrapper": True}
    if hasattr(inductor_config, "cpp_wrapper_build_separate"):
        options["cpp_wrapper_build_separate"] = True
    return options


class _InductorCppWrapperOnCpu:
    """Inductor as ``torch.compile(backend="inductor", options=options)`` would run it, with
    :func:`cpp_wrapper_options` added for graphs whose tensors are all on the CPU.

    On the CPU Inductor builds every distinct kernel into a shared library of its own with the
    C++ compiler, about a second each, and that is most of a block's compile time. With the C++
    wrapper a graph's kernels and the code calling them are built together (two builds per block:
    forward and backward), which costs a block a fraction of the compiler time, and its steps run
    no slower (benchmarks/results/2026-11-23-cpu-regional-compile.md). A whole model's graph calls
    its kernels once per block, so there the C++ code grows with depth: regions gain most from it.

    The C++ wrapper does not generate every operation. The backward graph is lowered with the
    forward (not at the first ``backward()``), so that a failure in either shows here: the graph
    is then compiled with the Python wrapper, with a warning, and so are the later ones."""

    def __init__(self, options: dict):
        self.options = options
        self.cpp_wrapper_failed = False

    def __call__(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        if self.cpp_wrapper_failed or not _all_on_cpu(example_inputs):
            return compile_fx(graph, example_inputs, config_patches=dict(self.options))
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return compile_fx(graph, example_inputs, config_patches={**cpp_wrapper_options(), **self.options})
        except Exception as error:  # noqa: BLE001 - any failure: the Python wrapper's compile decides
            if isinstance(error, torch._dynamo.exc.TorchDynamoException) and not isinstance(
                error, torch._dynamo.exc.BackendCompilerFailed
            ):
                raise  # Dynamo's own signals (restart the analysis, skip the frame...): not ours
            compiled = compile_fx(graph, example_inputs, config_patches=dict(self.options))
            self.cpp_wrapper_failed = True
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            warnings.warn(
                f"compile_regions: Inductor's C++ wrapper could not compile a block ({reason}); "
                "its blocks are compiled with the Python wrapper instead. Pass "
                "options={'cpp_wrapper': False} to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            return compiled


def _cpu_region_backend(compile_kwargs: dict) -> Optional[_InductorCppWrapperOnCpu]:
    """The backend that compiles CPU blocks with the C++ wrapper, or None where the user's
    settings leave no room for it: another backend, a ``mode`` (torch.compile takes a mode or
    options, not both), or an explicit ``cpp_wrapper`` option."""
    if compile_kwargs.get("backend", "inductor") != "inductor" or compile_kwargs.get("mode") not in (None, "default"):
        return None
    options = dict(compile_kwargs.get("options") or {})
    if "cpp_wrapper" in options:
        return None
    return _InductorCppWrapperOnCpu(options)


def _all_on_cpu(example_inputs) -> bool:
    tensors = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    return bool(tensors) and all(tensor.device.type == "cpu" for tensor in tensors)


class _BlockRegion:
    """What a compiled block keeps: its own forward (as it was, e.g. under activation
    checkpointing) and its class's :class:`_Region`."""

    def __init__(self, forward, region: _Region):
        self.forward = forward
        self.region = region


def _region_forward(block: nn.Module, *args, **kwargs):
    region = getattr(block, _MARK).region
    if torch.compiler.is_compiling():
        return region.outside_trace(block, *args, **kwargs)
    return region.compiled(block, *args, **kwargs)


def compile_regions(
    model: nn.Module,
    module_types: Optional[ModuleTypes] = None,
    **compile_kwargs,
) -> List[str]:
    """Compile, in place, every submodule of ``model`` whose class is in ``module_types`` (by
    default the classes :func:`find_repeated_blocks` finds). ``compile_kwargs`` go to
    ``torch.compile`` of the blocks run eagerly (``fullgraph``, ``dynamic``, ``mode``,
    ``backend``, ``options``); inside an enclosing ``torch.compile`` its settings apply.

    Returns the names of the compiled submodules. Parameter names, ``state_dict`` keys and the
    module tree do not change (the forward is replaced on each instance), so checkpoints load
    into the model with or without it. Module hooks stay outside the compiled region. A block
    inside another chosen block is left to its parent's compilation; calling this twice changes
    nothing."""
    if module_types is None:
        types_ = find_repeated_blocks(model)
        if not types_:
            raise ValueError(
                "compile_regions found no repeated blocks (an nn.ModuleList or nn.Sequential with "
                "two or more modules of one class of your own); name the block class instead, "
                "e.g. compile_regions(model, MyBlock)"
            )
    else:
        types_ = as_module_types(module_types, "compile_regions")
    blocks = outermost_blocks(
        model, types_, "compile_regions", "that is whole-model compilation (torch.compile(model) or engine='compiled')"
    )
    regions = {}
    for _, module in blocks:
        if getattr(module, _MARK, None) is not None:
            continue
        region = regions.get(type(module))
        if region is None:
            region = regions[type(module)] = _Region(compile_kwargs)
        setattr(module, _MARK, _BlockRegion(module.forward, region))
        # an instance attribute shadows the class's forward, as activation checkpointing does
        module.forward = functools.partial(_region_forward, module)
    return [name for name, _ in blocks]


def compiled_region_names(model: nn.Module) -> List[str]:
    """Names of the submodules that :func:`compile_regions` has compiled."""
    return [name for name, m in model.named_modules() if getattr(m, _MARK, None) is not None]

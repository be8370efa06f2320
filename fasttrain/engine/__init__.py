"""Step engines: how one training micro-step runs (eager, compiled, CUDA-graphed)."""

import torch

from fasttrain.engine.base import StepEngine
from fasttrain.engine.compiled import CompiledEngine
from fasttrain.engine.context import StepContext
from fasttrain.engine.cudagraph import CudaGraphEngine
from fasttrain.engine.eager import EagerEngine

ENGINES = {"eager": EagerEngine, "compiled": CompiledEngine, "cudagraph": CudaGraphEngine}


def auto_engine_name(device) -> str:
    """What ``engine="auto"`` runs on ``device``: on CUDA the CUDA-graphed engine (which falls
    back to the compiled one, then to eager, with a warning, when it cannot capture); elsewhere
    eager, since compiling does not pay for itself on the CPU for the small per-step work of
    typical CPU runs and costs seconds to minutes of compile time."""
    return "cudagraph" if torch.device(device).type == "cuda" else "eager"


def create_engine(name: str, ctx: StepContext) -> StepEngine:
    """The engine called ``name`` for the step described by ``ctx``; ``"auto"`` picks the
    fastest that works on the trainer's device."""
    if not isinstance(ctx, StepContext):
        raise TypeError(
            f"create_engine needs a StepContext (fasttrain.engine.context), got {type(ctx).__name__}; "
            "a Trainer builds one with fasttrain.prepare.step_context"
        )
    auto = name == "auto"
    if auto:
        name = auto_engine_name(ctx.trainer.device)
    try:
        engine_cls = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"Unknown engine {name!r}; choose one of {sorted(ENGINES) + ['auto']}"
        ) from None
    engine = engine_cls(ctx)
    if auto:
        # "auto" asked for the fastest engine that works: when the graphed one cannot run here
        # at all (DDP, fp16 scaling, another optimizer), taking the compiled one is the choice,
        # not a failure to warn about. Hooks that fail later still warn.
        engine.quiet_setup_fallback = True
    return engine


__all__ = [
    "StepEngine",
    "EagerEngine",
    "CompiledEngine",
    "CudaGraphEngine",
    "auto_engine_name",
    "create_engine",
    "StepContext",
    "ENGINES",
]

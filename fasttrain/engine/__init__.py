"""Step engines: how one training micro-step runs (eager, compiled, CUDA-graphed)."""

from fasttrain.engine.base import StepEngine
from fasttrain.engine.eager import EagerEngine

ENGINES = {"eager": EagerEngine}


def create_engine(name: str, trainer) -> StepEngine:
    """The engine called ``name`` for ``trainer``; ``"auto"`` picks the fastest that works on
    the trainer's device."""
    if name == "auto":
        name = "eager"
    try:
        engine_cls = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"Unknown engine {name!r}; choose one of {sorted(ENGINES) + ['auto']}"
        ) from None
    return engine_cls(trainer)


__all__ = ["StepEngine", "EagerEngine", "create_engine", "ENGINES"]

"""compile_options modes that add inductor's own CUDA graphs: mapped or refused, never run."""

from __future__ import annotations

import pytest
import torch

from fasttrain import Trainer, prepare
from fasttrain.engine import CompiledEngine, CudaGraphEngine
from fasttrain.engine.compiled_functions import CompileSettings, settings_for_engine

from engine_cases import MLP


def _settings(**options):
    return CompileSettings.from_options(options)


@pytest.mark.parametrize("engine", ["cudagraph", "auto"])
def test_the_graphed_engine_compiles_without_inductor_graphs(engine):
    assert settings_for_engine(_settings(mode="reduce-overhead"), engine).mode is None
    assert settings_for_engine(_settings(mode="max-autotune"), engine).mode == "max-autotune-no-cudagraphs"
    options = settings_for_engine(_settings(options={"triton.cudagraphs": True, "b": 1}), engine).options
    assert dict(options) == {"triton.cudagraphs": False, "b": 1}
    unchanged = _settings(mode="max-autotune-no-cudagraphs")
    assert settings_for_engine(unchanged, engine) is unchanged


def test_the_compiled_engine_keeps_autotuning_and_refuses_reduce_overhead():
    assert settings_for_engine(_settings(mode="max-autotune"), "compiled").mode == "max-autotune-no-cudagraphs"
    for options in ({"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}):
        with pytest.raises(ValueError, match="engine='cudagraph'"):
            settings_for_engine(CompileSettings.from_options(options), "compiled")


def test_refused_at_construction_not_in_train():
    with pytest.raises(ValueError, match="inductor's CUDA graphs"):
        Trainer(MLP(), torch.nn.functional.cross_entropy, None, engine="compiled", compile_options={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match="Unknown compile_options"):
        Trainer(MLP(), torch.nn.functional.cross_entropy, None, engine="eager", compile_options={"moed": "default"})
    trainer = Trainer(MLP(), torch.nn.functional.cross_entropy, None, engine="cudagraph", compile_options={"mode": "reduce-overhead"})
    assert CudaGraphEngine(prepare.step_context(trainer, Trainer)).settings.mode is None


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_the_compiled_fallback_does_not_bring_the_mode_back(monkeypatch, mode):
    monkeypatch.setattr(CompiledEngine, "setup", lambda self: None)
    model = MLP()
    trainer = Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      engine="cudagraph", compile_options={"mode": mode})
    engine = CudaGraphEngine(prepare.step_context(trainer, Trainer))
    fallback = engine._make_fallback(CompiledEngine)
    assert type(fallback) is CompiledEngine
    assert fallback.settings == engine.settings
    assert fallback.settings.mode in (None, "max-autotune-no-cudagraphs")

"""Regional compilation: same losses as whole-model compile, one graph shared by the blocks."""

import pytest
import torch

from fasttrain.regional import compile_regions, compiled_region_names, find_repeated_blocks
from model_blocks import Block, Stack, train_losses


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def test_finds_the_repeated_block_class():
    assert find_repeated_blocks(Stack()) == (Block,)
    assert find_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == ()


def test_same_losses_as_whole_model_compile_one_graph_for_all_blocks():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    regional, trainer = train_losses("eager", compile_regions=True)
    assert compiled_region_names(trainer.model) == ["blocks.0", "blocks.1", "blocks.2"]
    # the three blocks share one forward graph: no recompiles for blocks 1 and 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    whole, _ = train_losses("compiled")
    # Inductor fuses one block differently from the whole graph, so fp32 sums are reassociated
    # (a few ulp per step, which AdamW's normalisation carries into later steps)
    torch.testing.assert_close(regional, whole, rtol=2e-6, atol=1e-6)


def test_with_the_compiled_engine_losses_match():
    plain, _ = train_losses("compiled")
    regional, _ = train_losses("compiled", compile_regions=[Block])
    torch.testing.assert_close(regional, plain, rtol=0, atol=1e-6)


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="name the block class"):
        compile_regions(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        compile_regions(Stack(), [1])

"""Activation checkpointing: same losses as without it, fewer saved activations, any engine."""

import pytest
import torch

from fasttrain.checkpoint_activations import apply_activation_checkpointing, checkpointed_module_names
from model_blocks import Block, Stack, train_losses


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _saved_bytes(model, x):
    """Bytes autograd keeps for the backward during one forward (what checkpointing saves)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_same_losses_with_and_without(engine):
    plain, _ = train_losses(engine)
    checkpointed, trainer = train_losses(engine, activation_checkpointing=Block)
    assert len(plain) == 6
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)
    assert checkpointed_module_names(trainer.model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_fewer_activations_kept_and_same_gradients():
    torch.manual_seed(0)
    plain = Stack(blocks=4, dim=32)
    checkpointed = Stack(blocks=4, dim=32)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, Block)
    x = torch.randn(16, 4)
    plain.eval(), checkpointed.eval()  # no dropout: compare gradients exactly
    saved_plain, saved_ckpt = _saved_bytes(plain, x), _saved_bytes(checkpointed, x)
    # per block only its input (16 x 32 floats) survives instead of ~7 activations
    assert saved_ckpt < saved_plain / 3
    for p, q in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6)


def test_state_dict_keys_unchanged_and_idempotent():
    model = Stack()
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model, Block) == ["blocks.0", "blocks.1", "blocks.2"]
    apply_activation_checkpointing(model, (Block,))
    assert list(model.state_dict()) == keys
    Stack().load_state_dict(model.state_dict())


def test_bad_module_types_say_what_to_pass():
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        apply_activation_checkpointing(Stack(), "Block")
    with pytest.raises(ValueError, match="no submodule of type"):
        apply_activation_checkpointing(Stack(), torch.nn.Conv2d)
    with pytest.raises(ValueError, match="name its blocks"):
        apply_activation_checkpointing(Stack(), Stack)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lower_peak_cuda_memory():
    def peak(checkpointing):
        torch.manual_seed(0)
        model = Stack(blocks=8, dim=256).cuda()
        if checkpointing:
            apply_activation_checkpointing(model, Block)
        x = torch.randn(4096, 4, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    assert peak(True) < 0.5 * peak(False)

"""utils: batch limiting, DataLoaderSlice, process decorators, ModelEma, remove_padding."""

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fasttrain.utils import (
    LIMIT_BATCHES_ENV_VAR,
    DataLoaderSlice,
    LimitBatches,
    ModelEma,
    local_process_zero_first,
    local_process_zero_only,
    remove_padding,
    worker_init_fn,
    world_process_zero_only,
)


def original_utils():
    return pytest.importorskip("pytorch_accelerated.utils")


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(LIMIT_BATCHES_ENV_VAR, raising=False)


def test_env_var_name_matches_original():
    assert LIMIT_BATCHES_ENV_VAR == original_utils().LIMIT_BATCHES_ENV_VAR == "PT_ACC_LIMIT_BATCHES"


def test_limit_batches_sets_and_removes_the_variable(clean_env):
    with LimitBatches(3) as limiter:
        assert os.environ[LIMIT_BATCHES_ENV_VAR] == "3"
        assert limiter.num_batches == 3
    assert LIMIT_BATCHES_ENV_VAR not in os.environ


def test_limit_batches_restores_previous_value_even_on_error(monkeypatch):
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, "10")
    with pytest.raises(RuntimeError):
        with LimitBatches(2):
            with LimitBatches(1):
                assert os.environ[LIMIT_BATCHES_ENV_VAR] == "1"
            assert os.environ[LIMIT_BATCHES_ENV_VAR] == "2"
            raise RuntimeError("stop")
    assert os.environ[LIMIT_BATCHES_ENV_VAR] == "10"


@pytest.mark.parametrize("slice_size", [0, 2, 5, 9])
def test_dataloader_slice_matches_original(slice_size):
    loader = torch.utils.data.DataLoader(torch.arange(20), batch_size=4)
    ours = DataLoaderSlice(loader, slice_size)
    theirs = original_utils().DataLoaderSlice(loader, slice_size)
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
    assert len(ours) == len(theirs) == slice_size
    assert len(list(ours)) == min(slice_size, 5)  # iterable more than once


def test_process_decorators_run_on_a_single_process_like_the_original():
    calls = []

    def work(x, *, y=1):
        """Docstring kept by the decorator."""
        calls.append(x)
        return x + y

    original = original_utils()
    for decorator, theirs in [
        (local_process_zero_only, original.local_process_zero_only),
        (local_process_zero_first, original.local_process_zero_first),
        (world_process_zero_only, original.world_process_zero_only),
    ]:
        calls.clear()
        wrapped = decorator(work)
        assert wrapped(2, y=3) == theirs(work)(2, y=3) == 5
        assert calls == [2, 2]  # once per wrapper, on process zero
        assert wrapped.__name__ == "work" and wrapped.__doc__ == work.__doc__


def test_process_decorators_skip_other_ranks(monkeypatch):
    import types

    import fasttrain.utils as utils_module

    barriers = []
    monkeypatch.setattr(
        utils_module, "PartialState", lambda: types.SimpleNamespace(local_process_index=1, process_index=1)
    )
    monkeypatch.setattr(utils_module, "wait_for_everyone", lambda: barriers.append(1))
    calls = []

    def work():
        calls.append(1)
        return "done"

    assert local_process_zero_only(work)() is None
    assert world_process_zero_only(work)() is None
    assert calls == []
    assert local_process_zero_first(work)() == "done"
    assert calls == [1]
    assert len(barriers) == 3  # every rank reaches each barrier, or the others would hang


class EmaNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.linear(x)))


def perturb(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))
    model.train()
    model(torch.randn(8, 3, generator=generator))  # moves BN running stats and the counter


def test_model_ema_matches_original_over_updates():
    torch.manual_seed(0)
    model = EmaNet()
    ours = ModelEma(model, decay=0.9)
    theirs = original_utils().ModelEma(copy.deepcopy(model), decay=0.9)
    assert ours.decay == theirs.decay == 0.9
    for seed in range(5):
        perturb(model, seed)
        ours.update(model)
        theirs.update(model)
        for (name, a), b in zip(ours.module.state_dict().items(), theirs.module.state_dict().values()):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert ours.module.norm.num_batches_tracked.item() == theirs.module.norm.num_batches_tracked.item()
    ours.set(model)
    theirs.set(model)
    for a, b in zip(ours.module.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_model_ema_copy_is_frozen_in_eval_mode_and_movable():
    model = EmaNet()
    ema = ModelEma(model)
    assert ema.decay == 0.9999
    assert ema.module is not model and not ema.module.training
    assert all(not p.requires_grad for p in ema.module.parameters())
    assert all(p.requires_grad for p in model.parameters())
    ema.to(torch.float64)
    assert ema.module.linear.weight.dtype == torch.float64
    assert ema(torch.randn(2, 3, dtype=torch.float64)).shape == (2, 1)


def test_model_ema_custom_update_fn_is_used():
    class Halfway(ModelEma):
        def update_fn(self, ema_weights, model_weights):
            return (ema_weights + model_weights) / 2

    model = nn.Linear(2, 2)
    ema = Halfway(model)
    start = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.add_(2.0)
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, start + 1.0)


def test_model_ema_rejects_a_different_model():
    ema = ModelEma(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="state entries"):
        ema.update(EmaNet())


def test_worker_init_fn_reseeds_and_offsets_by_worker_id():
    with torch.random.fork_rng():
        result = worker_init_fn(3)
        assert result == torch.initial_seed() + 3


@pytest.mark.parametrize(
    "tensor, pad",
    [
        (torch.tensor([1, 2, -1, 3, -1]), -1),
        (torch.tensor([[1, 2], [-1, -1], [-1, 5], [3, 4]]), -1),
        (torch.zeros(3, 2, 2), 0),
        (torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]]), 0.0),
    ],
)
def test_remove_padding_matches_original(tensor, pad):
    assert torch.equal(remove_padding(tensor, pad), original_utils().remove_padding(tensor, pad))


@settings(max_examples=50, deadline=None, database=None)
@given(st.lists(st.lists(st.sampled_from([-1, 0, 1, 2]), min_size=3, max_size=3), max_size=8))
def test_remove_padding_drops_exactly_all_padding_rows(rows):
    tensor = torch.tensor(rows, dtype=torch.long).reshape(len(rows), 3)
    result = remove_padding(tensor, -1)
    assert result.tolist() == [row for row in rows if row != [-1, -1, -1]]

"""TrainerRunConfig: fields, immutability and to_dict against pytorch-accelerated."""

import dataclasses

import pytest
import torch

from fasttrain.run_config import TrainerRunConfig

FIELD_NAMES = [
    "num_epochs", "train_per_device_batch_size", "train_dl_kwargs", "eval_per_device_batch_size",
    "eval_dl_kwargs", "gradient_accumulation_steps", "gradient_clip_value",
    "train_total_batch_size", "eval_total_batch_size", "num_update_steps_per_epoch",
    "num_local_update_steps_per_epoch", "max_num_train_steps", "is_local_process_zero",
    "is_world_process_zero", "is_distributed", "mixed_precision", "num_processes",
]


def original_run_config():
    return pytest.importorskip("pytorch_accelerated.run_config").TrainerRunConfig


def values(sampler=None):
    train_kwargs = {"shuffle": False, "num_workers": 2, "collate_fn": None}
    if sampler is not None:
        train_kwargs["sampler"] = sampler
    return dict(
        num_epochs=3, train_per_device_batch_size=8, train_dl_kwargs=train_kwargs,
        eval_per_device_batch_size=16, eval_dl_kwargs={"shuffle": False, "extra": [1, 2]},
        gradient_accumulation_steps=2, gradient_clip_value=1.0, train_total_batch_size=16,
        eval_total_batch_size=16, num_update_steps_per_epoch=5,
        num_local_update_steps_per_epoch=5, max_num_train_steps=None,
        is_local_process_zero=True, is_world_process_zero=True, is_distributed=False,
        mixed_precision="no", num_processes=1,
    )


def test_fields_and_order_match_original():
    ours = [f.name for f in dataclasses.fields(TrainerRunConfig)]
    assert ours == FIELD_NAMES
    assert ours == [f.name for f in dataclasses.fields(original_run_config())]


def test_is_frozen():
    config = TrainerRunConfig(**values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_epochs = 4


def test_to_dict_matches_original_and_copies_values():
    ours = TrainerRunConfig(**values()).to_dict()
    assert ours == original_run_config()(**values()).to_dict()
    assert list(ours) == FIELD_NAMES
    config = TrainerRunConfig(**values())
    result = config.to_dict()
    result["eval_dl_kwargs"]["extra"].append(3)
    assert config.eval_dl_kwargs["extra"] == [1, 2]


def test_to_dict_keeps_the_sampler_and_leaves_the_config_unchanged_unlike_the_original():
    sampler = torch.utils.data.RandomSampler(range(10), generator=torch.Generator())
    ours_config = TrainerRunConfig(**values(sampler))
    theirs_config = original_run_config()(**values(sampler))
    ours, theirs = ours_config.to_dict(), theirs_config.to_dict()
    assert ours["train_dl_kwargs"]["sampler"] is sampler is theirs["train_dl_kwargs"]["sampler"]
    assert ours.keys() == theirs.keys()
    assert ours["train_dl_kwargs"].keys() == theirs["train_dl_kwargs"].keys()
    assert ours_config.train_dl_kwargs["sampler"] is sampler
    # The original pops the sampler out of the frozen config's own dict and never puts it back.
    assert "sampler" not in theirs_config.train_dl_kwargs

"""Bad arguments and bad inputs get an error that names the fix, raised before any work."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, StepLR
from torch.utils.data import TensorDataset

from fasttrain import Trainer, TrainerPlaceholderValues, nonfinite, validation
from fasttrain.callbacks import SaveTrainingStateCallback

FAST = settings(max_examples=40, deadline=None)

not_positive_ints = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
)
not_positive_numbers = st.one_of(
    st.integers(max_value=0),
    st.floats(max_value=0.0),
    st.just(math.nan),
    st.booleans(),
    st.text(max_size=3),
)


def _data(n=8):
    return TensorDataset(torch.randn(n, 2), torch.randn(n, 1))


def _trainer(**kwargs):
    model = nn.Linear(2, 1)
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[], **kwargs)


TRAINER = _trainer()


def _train_args(**overrides):
    args = dict(
        train_dataset=_data(),
        num_epochs=1,
        per_device_batch_size=2,
        train_dataloader_kwargs={"num_workers": 0},
    )
    args.update(overrides)
    return args


# ----------------------------------------------------------------------------- arguments
@FAST
@given(
    name=st.sampled_from(["num_epochs", "per_device_batch_size", "gradient_accumulation_steps", "max_num_train_steps"]),
    value=not_positive_ints,
)
def test_counts_must_be_positive_integers(name, value):
    if name == "max_num_train_steps" and value is None:
        return  # None means "use num_epochs"
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        TRAINER.train(**_train_args(**{name: value}))


@FAST
@given(name=st.sampled_from(["gradient_clip_value", "gradient_clip_norm"]), value=not_positive_numbers)
def test_clip_values_must_be_positive(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive number"):
        TRAINER.train(**_train_args(**{name: value}))


@FAST
@given(
    epochs=st.integers(1, 10**6),
    batch=st.integers(1, 10**6),
    accumulation=st.integers(1, 10**6),
    clip=st.one_of(st.none(), st.floats(min_value=1e-12, allow_infinity=False, allow_nan=False)),
)
def test_valid_arguments_pass(epochs, batch, accumulation, clip):
    validation.train_arguments(
        train_dataset=_data(),
        num_epochs=epochs,
        per_device_batch_size=batch,
        max_num_train_steps=None,
        gradient_accumulation_steps=accumulation,
        gradient_clip_value=clip,
        gradient_clip_norm=clip,
        create_scheduler_fn=None,
    )


def test_max_num_train_steps_makes_num_epochs_optional():
    validation.train_arguments(
        train_dataset=_data(),
        num_epochs=None,
        per_device_batch_size=1,
        max_num_train_steps=3,
        gradient_accumulation_steps=1,
        gradient_clip_value=None,
        gradient_clip_norm=None,
        create_scheduler_fn=None,
    )


@FAST
@given(value=st.one_of(st.integers(), st.text(max_size=3), st.floats()))
def test_scheduler_factory_must_be_callable(value):
    with pytest.raises(TypeError, match="create_scheduler_fn must be a callable.*Pass a factory"):
        TRAINER.train(**_train_args(create_scheduler_fn=value))


def test_scheduler_instance_instead_of_factory():
    model = nn.Linear(2, 1)
    scheduler = StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(TypeError, match="not a scheduler instance"):
        TRAINER.train(**_train_args(create_scheduler_fn=scheduler))


def test_placeholder_as_the_factory():
    with pytest.raises(ValueError, match="placeholder .* not a factory"):
        TRAINER.train(**_train_args(create_scheduler_fn=TrainerPlaceholderValues.NUM_EPOCHS))


def test_placeholder_as_positional_argument_of_the_partial():
    factory = functools.partial(OneCycleLR, 0.1, TrainerPlaceholderValues.NUM_EPOCHS)
    with pytest.raises(ValueError, match="only replaced in keyword arguments"):
        _trainer().train(**_train_args(create_scheduler_fn=factory))


@FAST
@given(
    option=st.sampled_from(["nonfinite", "resume_data_skip"]),
    value=st.one_of(st.text(max_size=8), st.integers(), st.none()),
)
def test_trainer_choices(option, value):
    valid = {"nonfinite": nonfinite.POLICIES, "resume_data_skip": validation.RESUME_DATA_SKIP}
    if value in valid[option]:
        _trainer(**{option: value})
        return
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        _trainer(**{option: value})


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"interrupt_save_dir": 3}, TypeError, "interrupt_save_dir must be a directory path"),
        ({"handle_signals": "yes"}, TypeError, "handle_signals must be True or False"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps must be a positive integer"),
        ({"engine": "turbo"}, ValueError, "engine must be one of"),
    ],
)
def test_trainer_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        _trainer(**kwargs)


def test_save_training_state_callback_arguments():
    with pytest.raises(ValueError, match="save_every_n_steps must be a positive integer"):
        SaveTrainingStateCallback(save_every_n_steps=0)


# ----------------------------------------------------------------------------- data
def test_empty_train_dataset():
    with pytest.raises(ValueError, match="train dataset is empty"):
        TRAINER.train(**_train_args(train_dataset=_data(0)))


def test_empty_eval_dataset():
    with pytest.raises(ValueError, match="eval dataset is empty"):
        TRAINER.train(**_train_args(eval_dataset=_data(0)))


def test_batch_larger_than_dataset_with_drop_last():
    with pytest.raises(ValueError, match="yields no batches.*lower the batch size or set drop_last=False"):
        _trainer().train(
            **_train_args(per_device_batch_size=16, train_dataloader_kwargs={"drop_last": True, "num_workers": 0})
        )


def test_batch_larger_than_dataset_without_drop_last_trains():
    trainer = _trainer()
    trainer.train(**_train_args(per_device_batch_size=16))
    assert trainer.num_updates == 1


# ----------------------------------------------------------------------------- losses
class _Custom(Trainer):
    def __init__(self, make_output, **kwargs):
        model = nn.Linear(2, 1)
        super().__init__(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[], **kwargs)
        self.make_output = make_output

    def calculate_train_batch_loss(self, batch):
        xb, yb = batch
        return self.make_output(self.model, xb, yb)


def _per_sample(model, xb, yb):
    return {"loss": ((model(xb) - yb) ** 2).squeeze(1), "batch_size": 2}


@pytest.mark.parametrize(
    "make_output, error, message",
    [
        (lambda m, x, y: {"model_outputs": m(x)}, ValueError, r"must return a dict with a 'loss' entry.*keys \['model_outputs'\]"),
        (lambda m, x, y: m(x).mean(), ValueError, "must return a dict with a 'loss' entry.*got Tensor"),
        (_per_sample, ValueError, r"must be a scalar, got a tensor of shape \(2,\).*loss.mean\(\)"),
        (lambda m, x, y: {"loss": ((m(x) - y) ** 2).mean().item()}, TypeError, r"not loss.item\(\)"),
        (lambda m, x, y: {"loss": ((m(x) - y) ** 2).mean().detach()}, ValueError, "frozen .* or the loss was detached"),
    ],
    ids=["no-loss-key", "not-a-dict", "non-scalar", "python-number", "detached"],
)
def test_bad_training_loss_is_reported_before_backward(make_output, error, message):
    trainer = _Custom(make_output)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(error, match=message):
        trainer.train(**_train_args())
    assert trainer.num_updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_frozen_model_is_reported():
    model = nn.Linear(2, 1)
    for p in model.parameters():
        p.requires_grad_(False)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    with pytest.raises(ValueError, match=r"parameters are frozen \(requires_grad=False\)"):
        trainer.train(**_train_args())


def test_one_element_loss_is_accepted():
    trainer = _Custom(lambda m, x, y: {"loss": ((m(x) - y) ** 2).mean().reshape(1), "batch_size": 2})
    trainer.train(**_train_args())
    assert trainer.num_updates == 4


def test_eval_loss_missing():
    class NoEvalLoss(Trainer):
        def calculate_eval_batch_loss(self, batch):
            return {"model_outputs": self.model(batch[0])}

    model = nn.Linear(2, 1)
    trainer = NoEvalLoss(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    with pytest.raises(ValueError, match="must return a dict with a 'loss' entry"):
        trainer.evaluate(_data(), per_device_batch_size=2, dataloader_kwargs={"num_workers": 0})

"""Mixed precision: the keyword option and accelerate's environment are both honoured."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # accelerate keeps the precision in a process-wide singleton; each test sets its own
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


class RecordSteps(TrainerCallback):
    def __init__(self):
        self.output_dtypes = []

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        # accelerate converts the model's outputs back to fp32 at the model's boundary
        self.output_dtypes.append(batch_output["model_outputs"].dtype)


def _train(**trainer_kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    model = nn.Sequential(nn.Linear(4, 2))
    inner_dtypes = []
    # what the layer computes in, seen inside the model (under autocast when mixed precision is on)
    model[0].register_forward_hook(lambda module, args, out: inner_dtypes.append(out.dtype))
    recorder = RecordSteps()
    trainer = Trainer(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[recorder], **trainer_kwargs
    )
    trainer.train(data, num_epochs=1, per_device_batch_size=8, train_dataloader_kwargs={"num_workers": 0})
    recorder.dtypes = inner_dtypes
    assert recorder.output_dtypes == [torch.float32, torch.float32]
    return trainer, recorder


def test_keyword_option_runs_the_forward_in_bf16():
    trainer, recorder = _train(mixed_precision="bf16")
    assert trainer.run_config.mixed_precision == "bf16"
    assert recorder.dtypes == [torch.bfloat16, torch.bfloat16]
    # the weights stay in fp32 and the loss reached the run history as a number
    assert trainer.get_model()[0].weight.dtype == torch.float32
    assert trainer.run_history.get_latest_metric("train_loss_epoch") > 0


def test_environment_is_honoured_when_the_option_is_not_given(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    trainer, recorder = _train()
    assert trainer.run_config.mixed_precision == "bf16"
    assert recorder.dtypes == [torch.bfloat16, torch.bfloat16]


def test_no_mixed_precision_by_default(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    trainer, recorder = _train()
    assert trainer.run_config.mixed_precision == "no"
    assert recorder.dtypes == [torch.float32, torch.float32]


def test_one_process_trains_in_fp32_then_bf16_then_fp32():
    # accelerate refuses a second Accelerator asking for another precision in the same process;
    # a notebook or a script that compares precisions builds one Trainer per precision
    _, first = _train(mixed_precision="no")
    _, second = _train(mixed_precision="bf16")
    _, third = _train(mixed_precision="no")
    assert set(first.dtypes) == {torch.float32}
    assert set(second.dtypes) == {torch.bfloat16}
    assert set(third.dtypes) == {torch.float32}

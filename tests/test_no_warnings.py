"""A normal run shows no warnings or log records from fasttrain's own machinery."""

import logging
import warnings

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_compiled_run_has_no_profiler_notice():
    from torch._logging._internal import warning_once

    warning_once.cache_clear()  # the notice is logged once per process; let this run log it again
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        x = torch.randn(32, 3)
        trainer = Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.01), callbacks=())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(TensorDataset(x, x.sum(1, keepdim=True)), num_epochs=1, per_device_batch_size=8,
                          train_dataloader_kwargs={"num_workers": 0})

        # what the compiled engine's update meets in torch.optim.Optimizer.step, traced cheaply
        def marked(t):
            with torch.autograd.profiler.record_function("optimizer step"):
                return t * 2

        torch._dynamo.reset()
        assert torch.compile(marked, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert trainer.num_updates == 4
    assert not [m for m in handler.messages if "will be ignored" in m], handler.messages
    ours = [w for w in caught if "fasttrain" in str(w.filename) or "fasttrain" in str(w.message)]
    assert not ours, [str(w.message) for w in ours]

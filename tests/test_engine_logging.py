"""Logger calls inside a compiled hook do not break its graph, and the setting that allows it is
in force only while fasttrain's compiled functions run."""

import logging
import warnings

import pytest
import torch
from torch import nn

from fasttrain.engine.logging_calls import ignored_logging_functions, ignoring_logger_calls, logger_methods
from fasttrain.trainer import Trainer
from log_records import torch_log_records

logger = logging.getLogger("fasttrain.tests.logging_model")


class LoggingModel(nn.Module):
    """Logs from its forward, as transformers' models do (``logger.warning_once``)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        logger.info("forward of %d rows", 4)
        logger.warning("a warning from the forward")
        return self.linear(x)


def _train(model, **trainer_options):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=(),
                      **trainer_options)
    trainer.train(data, num_epochs=1, eval_dataset=data, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
                  eval_dataloader_kwargs={"num_workers": 0})
    return trainer


def _logging_breaks():
    return {reason: n for reason, n in torch._dynamo.utils.counters["graph_break"].items() if "logging" in reason}


def test_logger_calls_in_the_forward_compile_whole_and_match_eager():
    torch.manual_seed(0)
    eager_model = LoggingModel()
    compiled_model = LoggingModel()
    compiled_model.load_state_dict(eager_model.state_dict())
    _train(eager_model, engine="eager")
    torch._dynamo.utils.counters.clear()
    before = set(ignored_logging_functions())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        trainer = _train(compiled_model, engine="compiled", compile_options={"backend": "aot_eager"})
    assert trainer.active_engine == "compiled" and trainer.active_eval_engine == "compiled"
    assert _logging_breaks() == {}
    for compiled, eager in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    # the setting is fasttrain's only while its compiled functions run
    assert set(ignored_logging_functions()) == before


def test_the_users_own_setting_is_kept():
    ignored = ignored_logging_functions()
    ignored.add(logging.Logger.info)
    try:
        with ignoring_logger_calls():
            assert logger_methods() <= ignored
        assert logging.Logger.info in ignored and logging.Logger.warning not in ignored
    finally:
        ignored.discard(logging.Logger.info)


def test_a_method_the_logger_class_gains_between_calls_is_ignored_from_the_next_call(monkeypatch):
    # transformers adds its *_once and warning_advice methods to logging.Logger when imported,
    # which may be after fasttrain's first compiled call
    def warning_advice(self, *args, **kwargs):
        pass

    ignored = ignored_logging_functions()
    if "warning_advice" in vars(logging.Logger):
        monkeypatch.delattr(logging.Logger, "warning_advice")
    with ignoring_logger_calls():
        assert warning_advice not in ignored and logging.Logger.warning in ignored
    monkeypatch.setattr(logging.Logger, "warning_advice", warning_advice, raising=False)
    with ignoring_logger_calls():
        assert warning_advice in ignored
    assert warning_advice not in ignored and logging.Logger.warning not in ignored


def test_a_users_own_compile_still_breaks_at_logger_calls():
    # fasttrain's setting is not global: outside its calls dynamo does what it did
    torch._dynamo.utils.counters.clear()
    torch.compile(LoggingModel(), backend="aot_eager")(torch.randn(2, 4))
    assert sum(_logging_breaks().values()) >= 1


def test_transformers_gpt2_runs_compiled():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install fasttrain[dev])")
    from zoo_models import ZOO, hf_trainer_class

    entry = ZOO["gpt2"]
    model = entry.make()
    trainer = hf_trainer_class()(model, None, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=(),
                                 engine="compiled", compile_options={"backend": "aot_eager"})
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train(entry.data(8), num_epochs=1, eval_dataset=entry.data(4), per_device_batch_size=4,
                      train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
                      eval_dataloader_kwargs={"num_workers": 0})
    assert trainer.active_engine == "compiled" and trainer.active_eval_engine == "compiled"
    assert _logging_breaks() == {}


def test_compiling_a_model_that_logs_writes_no_error_record():
    # torch 2.11's compilation-metrics logger sorts every set of dynamo's config, the ignored
    # logging functions included: with Logger methods in it, each compiled frame logged an ERROR
    # ("Unexpected exception logging compilation metrics") with a traceback
    torch._dynamo.reset()  # compile afresh: the metrics are logged when a frame is compiled
    with torch_log_records(logging.ERROR) as records:
        trainer = _train(LoggingModel(), engine="compiled", compile_options={"backend": "aot_eager"})
    assert trainer.active_engine == "compiled"
    assert [record.getMessage() for record in records] == []

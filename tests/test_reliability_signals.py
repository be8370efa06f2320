"""SIGINT/SIGTERM during train(): finish the step, save, fire the events, return; a second
signal aborts; handlers are restored; a process killed with SIGTERM resumes to the same result."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from tiny_run import build_trainer, train_kwargs, weights  # noqa: E402

from fasttrain import checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback, TrainerCallback  # noqa: E402
from fasttrain.signals import InterruptFlag, InterruptHandler, _ShieldWorker, share_stop_decisions  # noqa: E402


class SendSignal(TrainerCallback):
    """Raises ``signum`` ``times`` times in the step that performs update ``at_update``."""

    def __init__(self, at_update: int, signum: int, times: int = 1):
        self.at_update, self.signum, self.times = at_update, signum, times
        self.sent = False

    def on_train_step_end(self, trainer, **kwargs):
        if not self.sent and trainer.num_updates == self.at_update:
            self.sent = True
            for _ in range(self.times):
                signal.raise_signal(self.signum)


class EventLog(TrainerCallback):
    def __init__(self):
        self.events = []
        self.steps_after_signal = 0

    def on_train_step_end(self, trainer, **kwargs):
        self.events.append("step")

    def on_training_interrupted(self, trainer, signal_number, **kwargs):
        self.events.append(("interrupted", signal_number))

    def on_stop_training_error(self, trainer, **kwargs):
        self.events.append("stop_training_error")

    def on_training_run_end(self, trainer, **kwargs):
        self.events.append("run_end")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_state_fires_events_and_returns(tmp_path, signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    log = EventLog()
    trainer, recorder = build_trainer(
        callbacks=[SendSignal(at_update=4, signum=signum), log], interrupt_save_dir=str(tmp_path / "int")
    )
    torch.manual_seed(123)
    trainer.train(**train_kwargs())  # returns instead of raising

    assert trainer.stop_reason == "interrupted"
    assert trainer.num_updates == 4  # the step that received the signal was finished, no more
    assert log.events[-4:] == ["step", ("interrupted", signum), "stop_training_error", "run_end"]
    assert trainer.run_history.get_latest_metric("stopped_interrupted") == 4
    assert {s: signal.getsignal(s) for s in before} == before
    assert isinstance(trainer._interrupt, InterruptFlag) and not isinstance(trainer._interrupt, InterruptHandler)
    checkpointing.verify_training_state(tmp_path / "int")
    # the losses of the steps before the signal were delivered
    assert len([r for r in recorder.records if r[0] == "train"]) == len([e for e in log.events if e == "step"])


def test_interrupted_state_resumes_to_the_uninterrupted_result(tmp_path):
    reference, reference_rec = build_trainer()
    torch.manual_seed(123)
    reference.train(**train_kwargs())

    # inside an accumulation window: update 4 happens at micro-step 1 of epoch 2; signal at
    # micro-step 2 (update count still 4), so the saved gradients matter
    class SignalAtMicroStep(TrainerCallback):
        def on_train_step_end(self, trainer, step, **kwargs):
            if trainer.run_history.current_epoch == 2 and step == 2:
                signal.raise_signal(signal.SIGTERM)

    first, first_rec = build_trainer(callbacks=[SignalAtMicroStep()], interrupt_save_dir=str(tmp_path / "int"))
    torch.manual_seed(123)
    first.train(**train_kwargs())
    assert first.stop_reason == "interrupted"
    assert (tmp_path / "int" / "grads_0.pt").exists()

    second, second_rec = build_trainer(model_seed=9)
    second.train(**train_kwargs(), resume_from=str(tmp_path / "int"))
    assert first_rec.records + second_rec.records == reference_rec.records
    for name, value in weights(reference).items():
        assert torch.equal(weights(second)[name], value)


def test_interrupt_saves_into_the_save_training_state_callback_dir(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path / "states"), save_at_end=False)
    trainer, _ = build_trainer(callbacks=[SendSignal(2, signal.SIGINT), saver])
    trainer.train(**train_kwargs())
    assert checkpointing.find_latest_training_state(tmp_path / "states") == tmp_path / "states" / "interrupted"


def test_without_a_save_location_nothing_is_saved(tmp_path, capsys):
    trainer, _ = build_trainer(callbacks=[SendSignal(2, signal.SIGINT)])
    trainer.train(**train_kwargs())
    assert trainer.stop_reason == "interrupted"
    assert "no training state saved" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def default_signal_handlers():
    """The handlers a Python process starts with, whatever this one was started with (a shell's
    background job starts with SIGINT ignored)."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_a_signal_the_process_ignores_stays_ignored(tmp_path):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = EventLog()
    trainer, _ = build_trainer(callbacks=[SendSignal(2, signal.SIGINT, times=2), log],
                               interrupt_save_dir=str(tmp_path / "int"))
    seen = []

    class Look(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            seen.append(signal.getsignal(signal.SIGINT))

    trainer.callback_handler.add_callback(Look())
    trainer.train(**train_kwargs())
    assert ("interrupted", signal.SIGINT) not in log.events and trainer.stop_reason is None
    assert log.events.count("step") == 3 * 6  # every step of the three epochs ran
    assert set(seen) == {signal.SIG_IGN} and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert not (tmp_path / "int").exists()


def test_second_signal_aborts_at_once(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    log = EventLog()
    trainer, _ = build_trainer(
        callbacks=[SendSignal(2, signal.SIGINT, times=2), log], interrupt_save_dir=str(tmp_path / "int")
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train(**train_kwargs())
    assert ("interrupted", signal.SIGINT) not in log.events
    assert not (tmp_path / "int").exists()
    assert signal.getsignal(signal.SIGINT) is before


def test_handle_signals_false_installs_nothing():
    seen = []

    class Look(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    trainer, _ = build_trainer(callbacks=[Look()], handle_signals=False)
    trainer.train(**train_kwargs(num_epochs=1, eval_data=False))
    assert set(seen) == {before}


def test_no_handlers_outside_the_main_thread():
    seen, errors = [], []

    class Look(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            seen.append(type(trainer._interrupt))

    def run():
        try:
            trainer, _ = build_trainer(callbacks=[Look()])
            trainer.train(**train_kwargs(num_epochs=1, eval_data=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors
    assert set(seen) == {InterruptFlag}


def test_dataloader_workers_ignore_stop_signals_during_train():
    seen = []

    class Look(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            seen.append(trainer._train_dataloader.worker_init_fn)

    trainer, _ = build_trainer(callbacks=[Look()])
    kwargs = train_kwargs(num_epochs=1, eval_data=False, train_dataloader_kwargs={"num_workers": 1})
    trainer.train(**kwargs)
    original = trainer._train_dataloader.worker_init_fn
    assert not isinstance(original, _ShieldWorker)
    assert all(isinstance(fn, _ShieldWorker) and fn.worker_init_fn is original for fn in seen)


def test_handler_restores_previous_python_handler_and_escalates_to_it():
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        handler = InterruptHandler(signals=(signal.SIGUSR1,))
        assert handler.install()
        signal.raise_signal(signal.SIGUSR1)
        assert handler.stop_requested and handler.signal_number == signal.SIGUSR1 and calls == []
        signal.raise_signal(signal.SIGUSR1)  # second: back to the previous handler, which runs
        assert calls == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_distributed_handler_waits_for_agreement():
    class FakeAccelerator:
        """Two processes: this one and another that reports ``other``."""

        device = torch.device("cpu")

        def __init__(self, other):
            self.other = other

        def gather(self, tensor):  # rows: [signal, non-finite code, loss sum, samples]
            return torch.cat([tensor, torch.tensor([self.other], dtype=tensor.dtype)])

    handler = InterruptHandler(agree_at_flush=True)
    handler._on_signal(signal.SIGINT, None)
    assert not handler.stop_requested  # noted only: the other process may be a step behind
    code, totals = share_stop_decisions(FakeAccelerator([0.0, 0.0, 3.0, 4.0]), handler, 0, (1.5, 2))
    assert code == 0 and totals == (4.5, 6)  # the loss counters are summed over the processes
    assert handler.stop_requested and handler.signal_number == signal.SIGINT

    quiet = InterruptHandler(agree_at_flush=True)
    code, _ = share_stop_decisions(FakeAccelerator([float(signal.SIGTERM), 2.0, 0.0, 0.0]), quiet, 1)
    assert code == 2
    assert quiet.stop_requested and quiet.signal_number == signal.SIGTERM  # received elsewhere


# ----------------------------------------------------------------------------- real processes
def _run_script(*args, **popen_kwargs):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "sigterm_train.py"), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen_kwargs,
    )


def _wait_for(path: Path, process, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the script exited early:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out waiting for the training script")
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_in_a_real_process(tmp_path):
    """Two processes at once (imports dominate their cost). One, loading with worker processes,
    gets SIGTERM sent to its whole process group (as schedulers do) and must exit 0 with a
    complete state that resumes to the uninterrupted result; the other gets a second SIGTERM
    while handling the first and must die of it, keeping the state already saved."""
    once = _run_script("slow", tmp_path / "int", tmp_path / "slow.pt", tmp_path / "ready", start_new_session=True)
    twice = _run_script("linger", tmp_path / "int2", tmp_path / "linger.pt", tmp_path / "ready2")

    # meanwhile, the uninterrupted reference in this process
    reference, reference_rec = build_trainer()
    torch.manual_seed(123)
    reference.train(**train_kwargs())

    _wait_for(tmp_path / "ready", once)
    os.killpg(once.pid, signal.SIGTERM)  # the main process and its data-loader workers
    _wait_for(tmp_path / "ready2", twice)
    twice.send_signal(signal.SIGTERM)
    _wait_for(tmp_path / "ready2.interrupted", twice)  # written in on_training_interrupted
    twice.send_signal(signal.SIGTERM)

    out, _ = once.communicate(timeout=120)
    assert once.returncode == 0, out
    assert "training state is saved" in out
    assert not (tmp_path / "slow.pt").exists()  # it stopped before the end
    checkpointing.verify_training_state(tmp_path / "int")

    out2, _ = twice.communicate(timeout=120)
    assert twice.returncode == -signal.SIGTERM, out2
    checkpointing.verify_training_state(tmp_path / "int2")  # the save before was complete

    resumed, resumed_rec = build_trainer(model_seed=5)
    resumed.train(**train_kwargs(), resume_from=str(tmp_path / "int"))
    before = torch.load(tmp_path / "int.losses.pt", weights_only=True)
    assert [tuple(r) for r in before] + resumed_rec.records == reference_rec.records
    for name, value in weights(reference).items():
        assert torch.equal(weights(resumed)[name], value), name


def test_a_signal_adopted_from_another_process_is_not_a_first_local_one():
    # the scheduler signals every process; one sees it a little later than the agreement
    handler = InterruptHandler(signals=(signal.SIGUSR1,), agree_at_flush=True)
    handler.adopt(signal.SIGTERM)
    assert handler.stop_requested
    handler._on_signal(signal.SIGTERM, None)  # its own copy arrives: still the first here
    assert handler.local_signal() == 0 and handler.signal_number == signal.SIGTERM

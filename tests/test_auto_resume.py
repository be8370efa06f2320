"""``train(..., resume_from="latest")``: the same call starts a run and continues it after a crash,
from the newest complete state of the run's state directory (never a half-written one), and its
result equals a run never interrupted. The multi-process restarts under torchrun are in
tests/test_torchrun_restart.py."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from tiny_run import build_trainer, train_kwargs, weights  # noqa: E402

from fasttrain import auto_resume, checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback, TrainerCallback  # noqa: E402


class Crash(TrainerCallback):
    """Raises after the ``at``-th training step of the run, as a process failure would."""

    def __init__(self, at: int):
        self.at, self.steps = at, 0

    def on_train_step_end(self, trainer, step, **kwargs):
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("test: the process fails here")


def _saver(save_dir, **kwargs):
    return SaveTrainingStateCallback(save_dir=str(save_dir), save_every_n_steps=3, save_at_end=False, **kwargs)


def _run(callbacks=(), model_seed=0, **kwargs):
    trainer, recorder = build_trainer(model_seed=model_seed, callbacks=callbacks)
    torch.manual_seed(123)
    trainer.train(**train_kwargs(), **kwargs)
    return trainer, recorder


@pytest.fixture(scope="module")
def reference():
    return _run()


def _assert_equal_to(trainer, reference_trainer) -> None:
    for name, value in weights(reference_trainer).items():
        assert torch.equal(weights(trainer)[name], value), name
    got, expected = trainer.optimizer.state_dict()["state"], reference_trainer.optimizer.state_dict()["state"]
    assert got.keys() == expected.keys()
    for index in expected:
        assert torch.equal(got[index]["momentum_buffer"], expected[index]["momentum_buffer"]), index
    assert trainer.num_updates == reference_trainer.num_updates


def test_latest_continues_from_the_newest_complete_state_and_equals_the_uninterrupted_run(tmp_path, reference):
    reference_trainer, reference_recorder = reference
    states = tmp_path / "states"
    with pytest.raises(RuntimeError, match="the process fails here"):
        # 6 batches an epoch, windows of 2: the state after batch 9 is inside a window of epoch 2
        _run([_saver(states, max_checkpoints=2), Crash(at=11)], resume_from="latest")
    assert sorted(p.name for p in states.iterdir()) == ["step_6", "step_9"]
    # newer but incomplete: a save's staging folder with every file and its manifest (killed
    # before its rename), and a state without its manifest
    shutil.copytree(states / "step_9", states / ".step_12.staging")
    shutil.copytree(states / "step_9", states / "step_15")
    (states / "step_15" / "manifest.json").unlink()

    # the crashed run's every record, then the resumed run's, as a process restarted by its
    # launcher would run the same script again: a fresh model (other weights, another seed)
    metadata = torch.load(states / "step_9" / "trainer_state.pt", weights_only=True)
    assert (metadata["current_epoch"], metadata["phase"], metadata["step_in_epoch"]) == (2, "mid_epoch", 3)
    resumed, recorder = _run([_saver(states, max_checkpoints=2)], model_seed=7, resume_from="latest")
    assert resumed.progress.resumed_from == str(states / "step_9")
    done = [r for r in reference_recorder.records if (r[1], r[0] == "eval", r[2]) < (2, False, 3)]
    assert done + recorder.records == reference_recorder.records
    _assert_equal_to(resumed, reference_trainer)
    # the rotation went on from the resumed state's list
    assert sorted(p.name for p in states.iterdir() if not p.name.startswith(".")) == ["step_15", "step_18"]


def test_latest_without_any_state_starts_from_the_beginning(tmp_path, reference, capsys):
    reference_trainer, reference_recorder = reference
    states = tmp_path / "states"
    # a half-written state only: nothing to resume from
    states.mkdir()
    (states / ".step_3.staging").mkdir()
    trainer, recorder = _run([_saver(states)], resume_from="latest")
    assert trainer.progress.resumed_from is None
    assert f"No complete training state in {states}: training starts from the beginning" in capsys.readouterr().out
    assert recorder.records == reference_recorder.records
    _assert_equal_to(trainer, reference_trainer)


def test_latest_finds_the_interrupted_state_and_a_state_left_aside_by_a_killed_swap(tmp_path):
    states, interrupted = tmp_path / "states", tmp_path / "interrupted"

    def trainer_with_dirs(**kwargs):
        return build_trainer(callbacks=[_saver(states)], interrupt_save_dir=str(interrupted), **kwargs)[0]

    trainer = trainer_with_dirs()
    assert auto_resume.state_directories(trainer) == [states, interrupted]
    trainer.train(**train_kwargs(num_epochs=1, scheduler=False))
    trainer.save_training_state(str(interrupted))  # after the epoch: newer than step_6
    assert checkpointing.find_latest_training_state(states, interrupted) == interrupted
    # a save killed between its two renames leaves the previous state as .<name>.old only
    interrupted.rename(tmp_path / ".interrupted.old")
    assert checkpointing.find_latest_training_state(states, interrupted) == tmp_path / ".interrupted.old"
    resumed = trainer_with_dirs(model_seed=7)
    resumed.train(**train_kwargs(num_epochs=2, scheduler=False), resume_from="latest")
    assert resumed.progress.resumed_from == str(tmp_path / ".interrupted.old")
    assert resumed.num_updates == 6
    # .old counts only while no state has taken its name again
    interrupted.mkdir()
    assert checkpointing.find_latest_training_state(interrupted) is None


def test_latest_without_a_state_directory_says_what_to_add():
    trainer, _ = build_trainer()
    with pytest.raises(ValueError, match=r"SaveTrainingStateCallback\(save_dir=\.\.\.\).*interrupt_save_dir"):
        trainer.train(**train_kwargs(num_epochs=1), resume_from="latest")


def test_resume_from_keeps_its_meaning_for_paths(tmp_path):
    trainer, _ = build_trainer()
    with pytest.raises(TypeError, match="resume_from must be the directory of a training state, 'latest' or None"):
        trainer.train(**train_kwargs(num_epochs=1), resume_from=3)
    # a path named latest is a path, not the keyword
    with pytest.raises(checkpointing.CheckpointError, match="No training state at latest"):
        trainer.train(**train_kwargs(num_epochs=1), resume_from=Path("latest"))

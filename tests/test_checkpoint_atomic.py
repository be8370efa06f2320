"""Atomic, verified checkpoints: a save that fails half-way leaves the previous checkpoint intact,
a damaged training state is detected before anything is loaded from it, and keep-last-N never
removes the newest good state."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from tiny_run import SMALL, build_trainer, keep_last_two_run, train_kwargs, trained_small, weights  # noqa: E402

from fasttrain import checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback, TrainerCallback  # noqa: E402
from fasttrain.checkpointing import CheckpointError  # noqa: E402


class DiskFull(Exception):
    pass


def _failing_torch_save(monkeypatch, fail_on_call: int):
    """Make the ``fail_on_call``-th ``torch.save`` write half its bytes and raise, as a full
    disk or a crash in the middle of a write would."""
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] != fail_on_call:
            return real_save(obj, f, *args, **kwargs)
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        raise DiskFull("no space left on device")

    monkeypatch.setattr(torch, "save", save)
    return calls


@pytest.fixture(scope="module")
def trained():
    return trained_small()


def _no_temp_files(directory: Path):
    return [p.name for p in directory.rglob("*") if p.name.endswith(".tmp") or ".staging" in p.name]


def test_failed_checkpoint_save_keeps_the_previous_file(tmp_path, monkeypatch, trained):
    path = tmp_path / "model.pt"
    trained.save_checkpoint(path)
    good = path.read_bytes()
    with torch.no_grad():
        for p in trained.get_model().parameters():
            p.add_(1.0)
    _failing_torch_save(monkeypatch, fail_on_call=1)
    with pytest.raises(DiskFull):
        trained.save_checkpoint(path)
    assert path.read_bytes() == good
    assert _no_temp_files(tmp_path) == []
    checkpoint = torch.load(path, weights_only=True)
    assert set(checkpoint) >= {"model_state_dict", "optimizer_state_dict"}


@pytest.mark.parametrize("fail_on_call", [1, 2, 4])
def test_failed_training_state_save_keeps_the_previous_state(tmp_path, monkeypatch, trained, fail_on_call):
    state = tmp_path / "state"
    trained.save_training_state(state)
    before = {p.name: p.read_bytes() for p in state.iterdir()}
    _failing_torch_save(monkeypatch, fail_on_call)
    with pytest.raises(DiskFull):
        trained.save_training_state(state)
    assert {p.name: p.read_bytes() for p in state.iterdir()} == before
    checkpointing.verify_training_state(state)
    monkeypatch.undo()
    trained.save_training_state(state)  # the next save cleans up what the failed one left
    assert _no_temp_files(tmp_path) == []
    checkpointing.verify_training_state(state)


def test_manifest_lists_every_file(tmp_path, trained):
    trained.save_training_state(tmp_path / "state")
    manifest = json.loads((tmp_path / "state" / checkpointing.MANIFEST_FILE).read_text())
    names = {p.name for p in (tmp_path / "state").iterdir()} - {checkpointing.MANIFEST_FILE}
    assert set(manifest["files"]) == names
    assert {"model.pt", "optimizer.pt", "trainer_state.pt", "rng_state_0.pt"} <= names
    for name, entry in manifest["files"].items():
        assert entry["size"] == (tmp_path / "state" / name).stat().st_size


def test_truncated_file_is_reported_before_loading(tmp_path, trained):
    state = tmp_path / "state"
    trained.save_training_state(state)
    model_file = state / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-10])
    fresh, _ = build_trainer(model_seed=1)
    before = weights(fresh)
    with pytest.raises(CheckpointError, match=r"model.pt has \d+ bytes, the manifest records \d+ \(truncated\?\)"):
        fresh.train(**train_kwargs(**SMALL), resume_from=str(state))
    for name, value in before.items():  # nothing was loaded
        assert torch.equal(weights(fresh)[name], value)


def test_corrupted_file_is_reported(tmp_path, trained):
    state = tmp_path / "state"
    trained.save_training_state(state)
    data = bytearray((state / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (state / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.pt does not match its SHA-256"):
        checkpointing.verify_training_state(state)


def test_unfinished_state_is_reported(tmp_path, trained):
    state = tmp_path / "state"
    trained.save_training_state(state)
    (state / checkpointing.MANIFEST_FILE).unlink()
    (state / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="not a complete fasttrain training state"):
        trained.load_training_state(state)
    with pytest.raises(CheckpointError, match="No training state at"):
        trained.load_training_state(tmp_path / "missing")


def test_state_left_aside_by_a_killed_swap_is_found(tmp_path, trained):
    # a kill between the two renames leaves the previous state under .<name>.old
    state = tmp_path / "state"
    trained.save_training_state(state)
    os.replace(state, tmp_path / ".state.old")
    with pytest.warns(UserWarning, match="interrupted save"):
        trained.load_training_state(state)


def test_find_latest_training_state_skips_damaged_ones(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=1, save_at_end=False)
    trainer, _ = build_trainer(callbacks=[saver])
    trainer.train(**train_kwargs(**SMALL))  # steps count batches: 6, two per update
    assert checkpointing.find_latest_training_state(tmp_path) == tmp_path / "step_6"
    (tmp_path / "step_6" / "model.pt").write_bytes(b"")
    assert checkpointing.find_latest_training_state(tmp_path) == tmp_path / "step_5"
    assert checkpointing.find_latest_training_state(tmp_path / "nothing") is None


# ----------------------------------------------------------------------------- keep-last-N
def test_keep_last_n_keeps_the_newest(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=1, max_checkpoints=2)
    trainer, _ = build_trainer(callbacks=[saver])
    trainer.train(**train_kwargs(**SMALL))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_6"]


def test_failed_save_never_costs_the_newest_good_state(tmp_path, monkeypatch):
    class FailOnUpdate(TrainerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            if trainer.num_updates == 2 and not hasattr(self, "armed"):
                self.armed = True
                _failing_torch_save(monkeypatch, fail_on_call=1)

    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=1, max_checkpoints=1)
    trainer, _ = build_trainer(callbacks=[FailOnUpdate(), saver])
    with pytest.raises(DiskFull):
        trainer.train(**train_kwargs(**SMALL))
    # the save at batch 4 (update 2) failed; batch 3's state, saved inside a window, is kept
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_3"]
    checkpointing.verify_training_state(tmp_path / "step_3")


def test_keep_last_n_continues_across_a_resume(tmp_path):
    keep_last_two_run(tmp_path / "s", stop_at_update=4)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["step_7", "step_8"]
    keep_last_two_run(tmp_path / "s", resume_from=tmp_path / "s" / "step_8")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["step_11", "step_12"]

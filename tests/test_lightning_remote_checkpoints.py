"""Checkpoints on a file system other than the local disk (an ``s3://``-style URL), compared with
lightning.Trainer on fsspec's in-memory file system: where they are written, what is removed,
what a resume reads, and that nothing lands on the local disk under a folder named after the URL."""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import fsspec  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, assert_same_weights, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)
QUIET_SAVING = {**QUIET, "enable_checkpointing": True}


@pytest.fixture
def memory(tmp_path, monkeypatch):
    """fsspec's in-memory file system, emptied, and a fresh working folder to see local writes."""
    filesystem = fsspec.filesystem("memory")
    filesystem.store.clear()
    filesystem.pseudo_dirs[:] = [""]
    monkeypatch.chdir(tmp_path)
    yield filesystem
    filesystem.store.clear()


def _files(filesystem, prefix):
    return sorted(name[len(prefix) + 1:] for name in filesystem.store if name.startswith(prefix + "/"))


def test_model_checkpoint_writes_to_and_removes_from_the_url_as_lightning(memory, tmp_path):
    written = []
    for trainer_cls in BOTH:
        root = f"/{trainer_cls.__module__.split('.')[0]}"
        torch.manual_seed(0)
        callback = ModelCheckpoint(dirpath=f"memory://{root}", monitor="val_loss", save_top_k=1, save_last=True)
        trainer = trainer_cls(max_epochs=3, callbacks=[callback], **QUIET_SAVING)
        trainer.fit(Classifier(), train_loader(), val_loader())
        written.append((_files(memory, root), callback.best_model_path.replace(root, "")))
    assert written[1] == written[0]
    assert len(written[0][0]) == 2  # the best one (older ones removed) and last.ckpt
    assert os.listdir(tmp_path) == []  # nothing on the local disk


def test_a_fit_resumes_from_a_checkpoint_on_another_file_system_as_lightning(memory):
    modules = []
    for trainer_cls in BOTH:
        url = f"memory:///{trainer_cls.__module__.split('.')[0]}/last.ckpt"
        torch.manual_seed(0)
        module = Classifier()
        first = trainer_cls(max_epochs=1, **QUIET)
        first.fit(module, train_loader())
        first.save_checkpoint(url)
        assert memory.isfile(url)
        torch.manual_seed(0)
        resumed = Classifier()  # other weights until the checkpoint's are loaded
        trainer = trainer_cls(max_epochs=2, **QUIET)
        torch.manual_seed(1)
        trainer.fit(resumed, train_loader(), ckpt_path=url)
        assert trainer.global_step == 12 and trainer.ckpt_path == url
        modules.append(resumed)
    assert_same_weights(*modules)


def test_ckpt_path_last_over_a_url_reads_what_lightning_reads(memory):
    """ModelCheckpoint lists its folder without the URL's protocol, so Lightning finds no last
    checkpoint on another file system and trains from the start, with its warning: as here."""
    seen = []
    for trainer_cls in BOTH:
        root = f"memory:///{trainer_cls.__module__.split('.')[0]}"
        trainer = trainer_cls(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], **QUIET_SAVING)
        trainer.fit(Classifier(), train_loader())
        again = trainer_cls(max_epochs=2, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], **QUIET_SAVING)
        with pytest.warns(UserWarning, match="no last checkpoint available"):
            again.fit(Classifier(), train_loader(), ckpt_path="last")
        seen.append((again.ckpt_path, again.global_step))
    assert seen[1] == seen[0] == (None, 12)


def test_default_root_dir_keeps_a_url_as_lightning(memory, tmp_path):
    roots = [trainer_cls(default_root_dir="memory:///runs/a", **QUIET).default_root_dir for trainer_cls in BOTH]
    assert roots[1] == roots[0] == "memory:///runs/a"
    trainer = Trainer(max_epochs=1, default_root_dir="memory:///runs/a", **QUIET_SAVING)
    trainer.fit(Classifier(), train_loader())
    assert _files(memory, "/runs/a") == ["checkpoints/epoch=0-step=6.ckpt"]
    assert os.listdir(tmp_path) == []


def test_a_missing_checkpoint_on_the_url_is_lightnings_error(memory):
    with pytest.raises(FileNotFoundError, match="memory:///nowhere/last.ckpt"):
        Trainer(max_epochs=1, **QUIET).fit(Classifier(), train_loader(), ckpt_path="memory:///nowhere/last.ckpt")


def test_a_web_checkpoint_is_downloaded_through_torch_hub_with_safe_loading(monkeypatch, tmp_path):
    """No network here: torch.hub's download is replaced by one that reads a local file, and
    records how it was asked (the URL, the CPU, torch's safe loading unless told otherwise)."""
    source = Trainer(max_epochs=1, **QUIET)
    module = Classifier()
    source.fit(module, train_loader())
    local = tmp_path / "remote.ckpt"
    source.save_checkpoint(local)
    asked = []

    def download(url, map_location=None, weights_only=False, **kwargs):
        asked.append((url, map_location, weights_only))
        return torch.load(local, map_location=map_location, weights_only=weights_only)

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", download)
    trainer = Trainer(**QUIET)
    fresh = Classifier()
    trainer.validate(fresh, val_loader(), ckpt_path="https://example.org/runs/remote.ckpt", verbose=False)
    assert asked == [("https://example.org/runs/remote.ckpt", "cpu", None)]
    assert_same_weights(module, fresh)

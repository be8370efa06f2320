"""Checkpoint files: atomic writes, verified safe reads, the errors a bad file raises.

Every file is written to a temporary name in its directory, ``fsync``ed and renamed into place,
so an exception or a kill during a save never leaves a half-written file under the checkpoint's
name. ``.pt`` files are read with ``weights_only=True`` (a file carrying arbitrary pickled objects
is refused); ``.safetensors`` files hold tensors only by construction.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import torch

_HASH_CHUNK = 1 << 20
SAFETENSORS_SUFFIX = ".safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint or training state cannot be read (missing, truncated, corrupt or unsafe)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file at the checkpoint path (also a ``FileNotFoundError``, as it always was)."""


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it, so a file's
    SHA-256 comes from the bytes as written, without reading the file back."""

    def __init__(self, file):
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


@contextlib.contextmanager
def replaced_atomically(path: Path):
    """Yields a temporary file's name in ``path``'s directory for the block to write. When the
    block ends normally the file is ``fsync``ed and renamed to ``path``, so ``path`` holds either
    its old content or the complete new one; when it raises, the file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # KeyboardInterrupt included: the partial file must never be mistaken for a checkpoint
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj, path) -> dict:
    """``torch.save`` to ``path`` through a temporary file in the same directory, an ``fsync`` and
    a rename, so ``path`` holds either its old content or the complete new one. Returns the
    file's manifest entry (``size`` and ``sha256``)."""
    with replaced_atomically(Path(path)) as tmp, open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def file_entry(path: Path) -> dict:
    """A file's manifest entry (``size`` and ``sha256``), read from disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def safe_load(path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True`` and errors that say what went wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"No checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"Refusing to load {path}: it contains objects other than tensors and plain Python "
            "values (numbers, strings, lists, dicts), and unpickling them could run arbitrary "
            "code. If you trust the file, load it yourself with torch.load(..., "
            f"weights_only=False) and pass the state dicts on. Details: {e}"
        ) from e
    except Exception as e:
        # torch's zip reader fails in many ways on a cut or damaged file (RuntimeError,
        # EOFError, OSError "Invalid argument", ValueError, KeyError ...): each means the same
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


# ------------------------------------------------------------------------------- safetensors
def is_safetensors(path) -> bool:
    return Path(path).suffix == SAFETENSORS_SUFFIX


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "Saving or loading a .safetensors checkpoint needs the safetensors package: "
            "pip install safetensors (or save to a .pt path)."
        ) from e
    return safetensors.torch


def save_safetensors(state_dict: dict, path) -> None:
    """Write a model's ``state_dict`` to a ``.safetensors`` file, atomically. Tensors that share
    memory (tied weights) are each written whole, so the file loads back with
    ``load_state_dict`` as it is."""
    st = _safetensors()
    tensors, storages = {}, set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"A .safetensors file holds tensors only; the state entry {name!r} is a {type(value).__name__}.")
        value = value.detach().cpu().contiguous()  # SYNC(save): the file is written from host memory
        storage = value.untyped_storage().data_ptr()
        if value.numel() and storage in storages:
            value = value.clone()  # safetensors refuses two names on one storage
        storages.add(storage)
        tensors[name] = value
    with replaced_atomically(Path(path)) as tmp:
        st.save_file(tensors, tmp, metadata={"format": "pt", "content": "model_state_dict"})


def load_safetensors(path) -> dict:
    """``{"model_state_dict": tensors}`` from a ``.safetensors`` file, with errors that say what
    went wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"No checkpoint at {path}")
    st = _safetensors()
    try:
        return {"model_state_dict": st.load_file(path, device="cpu")}
    except Exception as e:  # safetensors' own error type for a cut or damaged header or body
        raise CheckpointError(
            f"{path} is not a readable .safetensors checkpoint (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e

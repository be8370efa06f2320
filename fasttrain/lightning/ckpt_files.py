"""Where checkpoint files live: a local path, or a URL of another file system (``s3://``,
``gs://``, ``hdfs://``, ``memory://``, any protocol fsspec knows; ``http(s)://`` for reading), as
Lightning's checkpoint I/O takes them.

A local file is written atomically (a temporary file in the same folder, ``fsync``, rename). A
file on another file system is written as one upload of the whole serialized checkpoint, so an
object store holds the previous object or the complete new one. An ``http(s)://`` checkpoint is
downloaded through ``torch.hub`` (its cache) as Lightning downloads it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import fsspec
import torch

from fasttrain.checkpoint_files import replaced_atomically


def is_remote(path) -> bool:
    """Whether ``path`` is a URL of a file system other than the local one."""
    return fsspec.utils.get_protocol(os.fspath(path)) != "file"


def _filesystem(path):
    return fsspec.core.url_to_fs(os.fspath(path))[0]


def _is_web(path) -> bool:
    return os.fspath(path).startswith(("http://", "https://"))


def write(checkpoint: dict, filepath) -> None:
    """``torch.save`` to ``filepath``: atomically on the local disk; one upload elsewhere."""
    if not is_remote(filepath):
        with replaced_atomically(Path(filepath)) as tmp:
            torch.save(checkpoint, tmp)
        return
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    filesystem = _filesystem(filepath)
    filesystem.makedirs(os.path.dirname(os.fspath(filepath)), exist_ok=True)
    with filesystem.open(os.fspath(filepath), "wb") as f:
        f.write(buffer.getvalue())


def read(path, weights_only):
    """``torch.load(path, map_location="cpu", weights_only=weights_only)`` from wherever ``path``
    is (``weights_only=None``: torch's default, safe loading, for a download too)."""
    if not is_remote(path):
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    if _is_web(path):
        return torch.hub.load_state_dict_from_url(os.fspath(path), map_location="cpu", weights_only=weights_only)
    with _filesystem(path).open(os.fspath(path), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=weights_only)


def is_file(path) -> bool:
    """Whether there is a checkpoint file at ``path`` (a web address is taken as there: its
    download says otherwise)."""
    if not is_remote(path):
        return os.path.isfile(path)
    return _is_web(path) or _filesystem(path).isfile(os.fspath(path))


def exists(path) -> bool:
    """Whether there is anything at ``path``, a file or a folder."""
    if not is_remote(path):
        return os.path.exists(path)
    return _filesystem(path).exists(os.fspath(path))


def modified(path) -> float:
    """When the file at ``path`` was last written, as a timestamp."""
    if not is_remote(path):
        return os.path.getmtime(path)
    return _filesystem(path).modified(os.fspath(path)).timestamp()


def remove(path) -> None:
    """Remove the checkpoint at ``path`` if there is one (a folder checkpoint with its files)."""
    if not exists(path):
        return
    if is_remote(path):
        _filesystem(path).rm(os.fspath(path), recursive=True)
    else:
        os.remove(path)

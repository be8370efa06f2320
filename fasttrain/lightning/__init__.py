"""Fit an unchanged LightningModule on fasttrain's engines: replace ``from lightning import
Trainer`` with ``from fasttrain.lightning import Trainer``. Needs ``pip install
fasttrain[lightning]``; see docs/lightning.md for what is supported and what differs."""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fasttrain.lightning needs the lightning package: pip install 'fasttrain[lightning]'"
    ) from error

from fasttrain.lightning.trainer import Trainer

__all__ = ["Trainer"]

"""Lightning's command line on fasttrain.lightning's Trainer: ``from fasttrain.lightning.cli import
LightningCLI`` in place of ``from lightning.pytorch.cli import LightningCLI``.

Lightning's ``LightningCLI`` builds its ``--trainer.*`` options from the signature of
``trainer_class`` and takes only a subclass of ``lightning.Trainer`` or a function typed as
returning one. :func:`trainer` is such a function: it makes a ``fasttrain.lightning.Trainer``, and
its signature is ``lightning.Trainer``'s (names, types, defaults, so the options, the config files
and ``--print_config`` read as under Lightning, and a config file Lightning's CLI wrote loads),
with fasttrain's own (``engine``, ``compile_options``, ``nonfinite``) after them. The arguments
fasttrain does not support (``sync_batchnorm``, ``benchmark``, ...) are there with Lightning's
defaults, which ask for nothing; another value is fasttrain's error naming it. :class:`LightningCLI`
is Lightning's with that ``trainer_class`` by default; everything else (subcommands, config
files, ``save_config_callback``, linking, the model and DataModule classes) is Lightning's own.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI as _LightningCLI

from fasttrain.lightning.arguments import own_arguments
from fasttrain.lightning.trainer import Trainer


def _signature() -> inspect.Signature:
    lightning_parameters = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for name, p in inspect.signature(pl.Trainer.__init__).parameters.items() if name != "self"
    ]
    own = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
        for name, (kind, default) in own_arguments({p.name for p in lightning_parameters}).items()
    ]
    return inspect.Signature(lightning_parameters + own, return_annotation=pl.Trainer)


def trainer(**kwargs: Any) -> pl.Trainer:
    """A ``fasttrain.lightning.Trainer(**kwargs)``; typed as ``lightning.Trainer`` with the
    arguments fasttrain takes, for ``LightningCLI(trainer_class=...)``."""
    return Trainer(**kwargs)


trainer.__signature__ = _signature()
# jsonargparse reads the annotations (resolved here: Lightning's module names the types)
trainer.__annotations__ = {
    **{p.name: p.annotation for p in trainer.__signature__.parameters.values()},
    "return": pl.Trainer,
}


class LightningCLI(_LightningCLI):
    """Lightning's ``LightningCLI``, making a ``fasttrain.lightning.Trainer`` unless given
    another ``trainer_class``."""

    def __init__(self, *args: Any, trainer_class: Any = trainer, **kwargs: Any) -> None:
        super().__init__(*args, trainer_class=trainer_class, **kwargs)


__all__ = ["LightningCLI", "trainer"]

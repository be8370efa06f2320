"""A pytest plugin that runs Lightning's own test suite with ``fasttrain.lightning.Trainer`` in
place of ``lightning.Trainer``: every ``from lightning.pytorch import Trainer`` (and ``import
lightning as L; L.Trainer``) in the suite's modules gets fasttrain's class. Lightning's tests are
not in its wheel or source distribution; take them from the repository at the installed
version's tag, then, from the folder that holds ``tests_pytorch``:

    PYTHONPATH=/path/to/fasttrain/tests/lightning python -m pytest -p suite_swap -p no:cacheprovider -q \\
        tests_pytorch/trainer/logging_ tests_pytorch/loops tests_pytorch/trainer/optimization

Run the same files without ``-p suite_swap`` for Lightning's own result on the machine. What
the comparison found, and the failures that remain with their causes, are in docs/lightning.md
(*Lightning's own tests*).

``lightning.pytorch.trainer.trainer.Trainer`` stays Lightning's class: fasttrain reads its
signature there (the ``PL_TRAINER_*`` environment defaults)."""

import lightning
import lightning.pytorch
import lightning.pytorch.trainer

import fasttrain.lightning

for _module in (lightning, lightning.pytorch, lightning.pytorch.trainer):
    _module.Trainer = fasttrain.lightning.Trainer

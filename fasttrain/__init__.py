"""fasttrain: a high-throughput PyTorch trainer with pytorch-accelerated's hook and callback API.

Migrating a script is a change of import prefix: ``pytorch_accelerated`` -> ``fasttrain``.
"""

import logging

from accelerate import notebook_launcher
from accelerate.utils import set_seed

from fasttrain._version import __version__
from fasttrain.metrics import FlushedMetrics
from fasttrain.trainer import Trainer, TrainerPlaceholderValues

# pytorch-accelerated's top-level names. Unlike it, importing fasttrain seeds nothing: call
# set_seed (or pass Trainer(seed=...)) to make a run repeatable.
accelerate_notebook_launcher = notebook_launcher
logger = logging.getLogger(__name__)

__all__ = [
    "Trainer",
    "TrainerPlaceholderValues",
    "notebook_launcher",
    "set_seed",
    "FlushedMetrics",
    "__version__",
]

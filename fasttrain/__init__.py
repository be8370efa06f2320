"""fasttrain: a high-throughput PyTorch trainer with pytorch-accelerated's hook and callback API.

Migrating a script is a change of import prefix: ``pytorch_accelerated`` -> ``fasttrain``.
"""

from accelerate import notebook_launcher

from fasttrain._version import __version__
from fasttrain.metrics import FlushedMetrics
from fasttrain.trainer import Trainer, TrainerPlaceholderValues

__all__ = ["Trainer", "TrainerPlaceholderValues", "notebook_launcher", "FlushedMetrics", "__version__"]

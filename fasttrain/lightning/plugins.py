"""``Trainer(plugins=...)``: Lightning's plugin objects, read as Lightning reads them, honoured
where fasttrain's engines can honour them and refused with one clear error where they cannot.

- Precision plugins: ``Precision()`` (full precision) and ``MixedPrecision("bf16-mixed" |
  "16-mixed", ...)`` choose the mixed precision accelerate runs, as ``precision=`` does, and are
  ``trainer.precision_plugin``. Other precision plugins (``HalfPrecision``, ``DoublePrecision``,
  the quantising and DeepSpeed/FSDP ones, a subclass of your own) change how the module is
  converted and run in ways fasttrain's step engines do not implement: an error.
- ``CheckpointIO`` plugins write, read and remove the checkpoint files (``storage_options`` of
  ``trainer.save_checkpoint`` reaches them).
- Cluster environments (``LightningEnvironment``, ``TorchElasticEnvironment``,
  ``SLURMEnvironment``, ...): one process uses none, as under Lightning's single-device
  strategy; with several processes fasttrain's launch (torchrun or accelerate) sets the ranks,
  and the environment must agree with them (checked when a run starts).
- ``LayerSync`` (``TorchSyncBatchNorm``): an error, as ``sync_batchnorm`` is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins import LayerSync, MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from fasttrain.lightning.errors import LightningConfigError

# accelerate's mixed precision for the Lightning precision plugins fasttrain runs
_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_FLAGS = {mixed: flag for flag, mixed in _MIXED.items()}
# GradScaler's defaults: accelerate builds its own scaler with them, so a plugin's scaler with
# other settings cannot be honoured
_SCALER_DEFAULTS = {"_init_scale": 2.0**16, "_growth_factor": 2.0, "_backoff_factor": 0.5, "_growth_interval": 2000}


@dataclass
class Plugins:
    """What ``plugins=`` chose (None: not given)."""

    precision_plugin: Optional[Precision] = None
    #: accelerate's mixed precision for precision_plugin ("no", "bf16", "fp16")
    mixed_precision: Optional[str] = None
    checkpoint_io: Optional[CheckpointIO] = None
    cluster_environment: Optional[ClusterEnvironment] = None

    def check_environment(self, processes: int, rank: int) -> None:
        """With several processes, the cluster environment given must see the launch fasttrain
        runs in (torchrun's or accelerate's ranks)."""
        env = self.cluster_environment
        if env is None or processes == 1:
            return
        try:
            seen = (env.world_size(), env.global_rank())
        except (KeyError, ValueError) as error:
            seen = f"an error reading it ({error!r})"
        if seen != (processes, rank):
            raise ValueError(
                f"plugins=[{type(env).__name__}()] describes world size and rank {seen}, but this process was "
                f"launched as rank {rank} of {processes} (torchrun's or accelerate's variables, which fasttrain "
                "runs on): launch with torchrun or accelerate launch and use TorchElasticEnvironment or "
                "LightningEnvironment, or leave the environment out"
            )


def read_plugins(plugins: Any, precision: Any) -> Plugins:
    """Lightning's reading of ``plugins`` (one plugin or an iterable of them; its errors for an
    unknown type, two of one kind, or a precision plugin besides ``precision=``), then
    fasttrain's check of each."""
    chosen = Plugins()
    if plugins is None:
        return chosen
    plugins = plugins if isinstance(plugins, Iterable) else [plugins]
    kinds: Counter = Counter()
    for plugin in plugins:
        if isinstance(plugin, Precision):
            chosen.precision_plugin = plugin
            kinds["Precision"] += 1
        elif isinstance(plugin, CheckpointIO):
            chosen.checkpoint_io = plugin
            kinds["CheckpointIO"] += 1
        elif isinstance(plugin, ClusterEnvironment):
            chosen.cluster_environment = plugin
            kinds["ClusterEnvironment"] += 1
        elif isinstance(plugin, LayerSync):
            raise TypeError(
                f"fasttrain.lightning.Trainer does not support the plugin {type(plugin).__name__}: convert the model "
                "with torch.nn.SyncBatchNorm.convert_sync_batchnorm before fit() instead."
            )
        else:
            raise LightningConfigError(
                f"Found invalid type for plugin {plugin}. Expected one of: Precision, "
                "CheckpointIO, ClusterEnvironment, or LayerSync."
            )
    duplicated = [kind for kind, count in kinds.items() if count > 1]
    if duplicated:
        raise LightningConfigError(
            f"Received multiple values for {', '.join(duplicated)} flags in `plugins`."
            " Expected one value for each type at most."
        )
    if chosen.precision_plugin is not None:
        if precision is not None:
            raise ValueError(
                f"Received both `precision={precision}` and `plugins={chosen.precision_plugin}`. Choose one."
            )
        chosen.mixed_precision = _mixed_precision(chosen.precision_plugin)
    return chosen


def _mixed_precision(plugin: Precision) -> str:
    kind = type(plugin)
    if kind is Precision:
        return "no"
    if kind is MixedPrecision:
        scaler = plugin.scaler
        if scaler is not None and (
            type(scaler) is not torch.amp.GradScaler
            or any(getattr(scaler, name, value) != value for name, value in _SCALER_DEFAULTS.items())
        ):
            raise TypeError(
                "fasttrain.lightning.Trainer runs 16-mixed with accelerate's GradScaler at its default settings; "
                "a MixedPrecision plugin with a scaler of its own cannot be honoured: pass "
                "MixedPrecision('16-mixed', device) without a scaler, or precision='16-mixed'"
            )
        return _MIXED[plugin.precision]
    raise TypeError(
        f"fasttrain.lightning.Trainer does not support the precision plugin {kind.__name__}: fasttrain's step engines "
        "run full precision or accelerate's mixed precision only; use precision='32-true', 'bf16-mixed' or "
        "'16-mixed' (or plugins=[Precision()] / [MixedPrecision(...)]), or train this run with lightning.Trainer."
    )


def precision_of_run(chosen: Plugins, mixed_precision: str, device_type: str):
    """``trainer.precision_plugin`` and accelerate's mixed precision for a Trainer that trains on
    ``device_type``, as Lightning's accelerator connector decides them: a plugin given is used as
    it is; ``precision="16-mixed"`` on the CPU, where there is no fp16 autocast to run, is
    bf16-mixed, with Lightning's warning; a mixed precision is a ``MixedPrecision`` plugin."""
    if chosen.precision_plugin is not None:
        return chosen.precision_plugin, mixed_precision
    if mixed_precision == "fp16" and device_type == "cpu":
        rank_zero_warn(
            "You passed `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on "
            "CPU. Using `precision='bf16-mixed'` instead."
        )
        mixed_precision = "bf16"
    if mixed_precision == "no":
        return Precision(), mixed_precision
    rank_zero_info(f"Using {'16bit' if mixed_precision == 'fp16' else 'bfloat16'} Automatic Mixed Precision (AMP)")
    return MixedPrecision(_FLAGS[mixed_precision], "cpu" if device_type == "cpu" else "cuda"), mixed_precision


def share_loss_scaler(plugin: Precision, accelerator) -> None:
    """A ``MixedPrecision("16-mixed")`` plugin's ``scaler`` is the run's loss scaler, accelerate's,
    so that what a callback reads there (``get_scale()``) is what the steps use. Where accelerate
    makes no scaler (fp16 on the CPU, which it would run in full precision) the run stops here,
    before its first hook, rather than train in another precision than the plugin names."""
    if type(plugin) is not MixedPrecision or plugin.precision != "16-mixed":
        return
    if accelerator.scaler is None:
        raise ValueError(
            f"plugins=[MixedPrecision('16-mixed', {plugin.device!r})] on the {accelerator.device.type.upper()}: accelerate "
            "runs fp16 mixed precision, with its loss scaler, on CUDA only, and would train this run in full "
            "precision; on the CPU use precision='bf16-mixed' (or MixedPrecision('bf16-mixed', 'cpu'))"
        )
    plugin.scaler = accelerator.scaler

"""Throughput, MFU and GPU utilisation of a training run, from the batched metric flushes.

:class:`ThroughputMonitorCallback` implements no per-step event: everything it reports comes from
``on_metrics_flush``, which the trainer fires every ``log_every_n_steps`` updates and at epoch
ends with host values (sample counts, token counts, elapsed seconds). Watching throughput
therefore costs no synchronisation and nothing per step.
"""

from __future__ import annotations

from typing import Dict, Optional

from fasttrain.callbacks import TrainerCallback
from fasttrain.hardware import GpuSampler, peak_flops, precision_key
from fasttrain.metrics import FlushedMetrics

__all__ = ["ThroughputMonitorCallback", "throughput"]


def throughput(
    metrics: FlushedMetrics,
    flops_per_sample: Optional[float] = None,
    flops_per_token: Optional[float] = None,
    peak_flops: Optional[float] = None,
) -> Dict[str, float]:
    """Rates over the steps of one flush.

    Returns ``throughput_samples_per_s``; ``throughput_tokens_per_s`` when the loss reported
    ``num_items_in_batch`` (then ``metrics.num_items`` counts tokens); ``flops_per_s`` when FLOPs
    per token (needs the token count) or per sample are given, preferring tokens; and ``mfu``,
    achieved over ``peak_flops``, when a peak is given too. Empty when the flush covers no time
    or no samples (an epoch-end flush right after a periodic one).

    The FLOPs are those of one training step (forward + backward), the convention of the MFU
    metric: recomputation, optimizer and communication work do not count.
    """
    elapsed = metrics.elapsed_s
    samples = metrics.num_samples
    if elapsed <= 0 or samples <= 0:
        return {}
    out = {"throughput_samples_per_s": samples / elapsed}
    tokens = metrics.num_items
    if tokens is not None:
        out["throughput_tokens_per_s"] = tokens / elapsed
    flops = None
    if flops_per_token is not None and tokens is not None:
        flops = flops_per_token * tokens
    elif flops_per_sample is not None:
        flops = flops_per_sample * samples
    if flops is not None:
        out["flops_per_s"] = flops / elapsed
        if peak_flops:
            out["mfu"] = out["flops_per_s"] / peak_flops
    return out


def _check(name: str, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    return float(value)


class ThroughputMonitorCallback(TrainerCallback):
    """Records training throughput into the run history at every flush.

    :param flops_per_sample: training FLOPs (forward + backward) of one sample.
    :param flops_per_token: training FLOPs per token, for language models whose loss returns
        ``num_items_in_batch`` (e.g. ``6 * num_params + 12 * layers * d_model * seq_len``).
    :param peak_flops: the device's peak FLOP/s for MFU; by default looked up from the GPU's name
        and the trainer's ``mixed_precision`` (known NVIDIA data-centre GPUs only; no MFU otherwise).
    :param gpu_metrics: sample GPU utilisation through NVML in a background thread while training
        (skipped, with ``gpu_metrics_reason`` saying why, without NVML or a GPU).

    Metrics written each flush, per process: ``throughput_samples_per_s``,
    ``throughput_tokens_per_s`` (with token counts), ``mfu`` (with FLOPs and a peak),
    ``gpu_utilization`` (percent, mean since the previous flush). The latest values are also kept
    in ``last_samples_per_s``, ``last_tokens_per_s``, ``last_mfu``, ``last_gpu_utilization``.
    The first flush of a run includes warm-up (compilation, graph capture), so it reads low.
    """

    def __init__(self, flops_per_sample=None, flops_per_token=None, peak_flops=None, gpu_metrics=True):
        self.flops_per_sample = _check("flops_per_sample", flops_per_sample)
        self.flops_per_token = _check("flops_per_token", flops_per_token)
        self.peak_flops = _check("peak_flops", peak_flops)
        self.gpu_metrics = bool(gpu_metrics)
        self.gpu_metrics_reason: Optional[str] = None
        self._peak: Optional[float] = self.peak_flops
        self._sampler = None
        self.last_samples_per_s: Optional[float] = None
        self.last_tokens_per_s: Optional[float] = None
        self.last_flops_per_s: Optional[float] = None
        self.last_mfu: Optional[float] = None
        self.last_gpu_utilization: Optional[float] = None

    def _resolve_peak(self, trainer) -> Optional[float]:
        if self.peak_flops is not None:
            return self.peak_flops
        if self.flops_per_sample is None and self.flops_per_token is None:
            return None
        config = getattr(trainer, "run_config", None)
        return peak_flops(trainer.device, precision_key(getattr(config, "mixed_precision", None)))

    def on_training_run_start(self, trainer, **kwargs):
        self._peak = self._resolve_peak(trainer)
        if self.gpu_metrics and self._sampler is None:
            sampler = GpuSampler(trainer.device)
            if sampler.available:
                self._sampler = sampler.start()
            else:
                self.gpu_metrics_reason = sampler.reason

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if metrics.phase != "train":
            return
        values = throughput(metrics, self.flops_per_sample, self.flops_per_token, self._peak)
        if self._sampler is not None:
            gpu = self._sampler.take()
            if gpu.get("samples"):
                values["gpu_utilization"] = gpu["utilization_mean"]
        if not values:
            return
        self.last_samples_per_s = values.get("throughput_samples_per_s")
        self.last_tokens_per_s = values.get("throughput_tokens_per_s")
        self.last_flops_per_s = values.get("flops_per_s")
        self.last_mfu = values.get("mfu")
        self.last_gpu_utilization = values.get("gpu_utilization")
        for name in ("throughput_samples_per_s", "throughput_tokens_per_s", "mfu", "gpu_utilization"):
            if name in values:
                trainer.run_history.update_metric(name, values[name])

    def _stop_sampler(self):
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def on_training_run_end(self, trainer, **kwargs):
        self._stop_sampler()

    def on_training_interrupted(self, trainer, signal_number=None, **kwargs):
        self._stop_sampler()

"""``fasttrain bench``: training throughput of fasttrain and its peers, measured side by side.

workloads (synthetic models and data) · peers (the loops compared) · runner (warm-up, counting,
interleaved timing) · counters (host syncs, recompiles) · hardware (versions of what ran) ·
report (tables and files). Method: benchmarks/README.md. The device's peak FLOP/s and the NVML
sampler live in :mod:`fasttrain.hardware`, which the trainer's monitor uses too (this package is
above the trainer; nothing in the trainer imports it); ``hardware`` and ``gpu_metrics`` here
re-export them.
"""

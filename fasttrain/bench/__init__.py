"""``fasttrain bench``: training throughput of fasttrain and its peers, measured side by side.

workloads (synthetic models and data) · peers (the loops compared) · runner (warm-up, counting,
interleaved timing) · counters (host syncs, recompiles) · gpu_metrics (NVML sampling) ·
hardware (device peak FLOP/s, versions) · report (tables and files). Method: benchmarks/README.md.
"""

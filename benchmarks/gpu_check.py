"""Correctness of fasttrain's step engines on one device: the checks `run_gpu.sh` runs on a GPU.

    python benchmarks/gpu_check.py --device cuda --out bench_out/check
    python benchmarks/gpu_check.py --device cpu --tiny          # what CI runs

For each workload (mlp, convnet, gpt, hf-gpt2: transformers' GPT-2) and precision (fp32 with TF32 off, bf16 autocast) it trains
the same seeded model with the eager, compiled and cudagraph engines: AdamW, gradient norm clipping,
gradient accumulation 2, an eval set, 3 epochs whose last batch is smaller than the others. It
fails (exit status 1) when

* the engine asked for is not the one that ran, as read from the trainer after the run
  (``active_engine``, ``active_eval_engine``). On a CPU the cudagraph engine cannot capture: there
  the check demands the documented fallback to the compiled engine *and* the warning announcing it;
* the final weights of fp32 runs differ from eager's by more than ``FP32_WEIGHT_RTOL``, or the
  per-step losses of bf16 runs differ from eager's by more than the ``BF16_LOSS_*`` noise bounds;
* after the first epoch (warm-up: compilation, capture, the partial batch's own graph), anything is
  compiled (``torch._dynamo`` frame counter) or the run synchronises the host with the device more
  often than once per metrics flush and once per epoch end (train and eval). On CUDA synchronising
  calls are counted with ``torch.cuda.set_sync_debug_mode("warn")``; on every device the Python
  reads of device values (``item``, ``tolist``, ...) are counted too, as the CPU's stand-in.
  Reads made inside a third-party model's own package (transformers' GPT-2 checks its attention
  mask with ``bool(tensor)`` in every eager forward) are shown apart and not held against the
  budget: no engine but a compiled one can remove them. Each CUDA sync is attributed to the frame
  that made it (``WarningLog``): the innermost frame outside the warnings machinery, the host-read
  counter's wrapper and torch's own code.

Writes ``check.json`` (every figure) and ``check.md`` (a table) to ``--out`` after each workload
and precision, so a run stopped part-way keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from accelerate.state import AcceleratorState

from fasttrain import Trainer
from fasttrain.bench.counters import RecompileCounter, SyncCounter
from fasttrain.bench.workloads import PeerUnavailable, make_workload
from fasttrain.callbacks import TrainerCallback, get_default_callbacks

#: fp32 (TF32 off): relative difference ||w - w_eager|| / ||w_eager|| of all final weights
FP32_WEIGHT_RTOL = 1e-4
#: bf16 autocast: per-step training losses against eager's, |l - l_eager| / |l_eager|. bf16 keeps
#: 8 significant bits (a relative rounding step of 2^-8 = 0.4%); fused and unfused kernels round
#: at different points and the differences feed through the updates, so the curves drift apart
#: by a few rounding steps over a short run: mean and worst step bounds.
BF16_LOSS_MEAN_RTOL = 0.02
BF16_LOSS_MAX_RTOL = 0.06
#: synchronising calls allowed per metrics flush and per epoch end (train and eval each)
SYNCS_PER_FLUSH = 1
SYNCS_PER_EPOCH_END = 1
#: frames torch.compile may compile after the first epoch
MAX_RECOMPILES_AFTER_WARMUP = 0

EPOCHS = 3
ACCUMULATION = 2
CLIP_NORM = 1.0
ENGINES = ("eager", "compiled", "cudagraph")
PRECISIONS = ("fp32", "bf16")
#: the engine each one is documented to fall back to where it cannot run (CPU: no CUDA graphs)
CPU_FALLBACK = {"cudagraph": "compiled"}

#: (size, batch size, full training batches per epoch, flush interval) per workload
SIZES = {
    "cuda": {
        "mlp": ("small", 64, 24, 4), "convnet": ("small", 64, 16, 4), "gpt": ("small", 8, 12, 4),
        "hf-gpt2": ("small", 8, 12, 4),
    },
    "cpu": {
        "mlp": ("small", 16, 12, 4), "convnet": ("tiny", 8, 8, 4), "gpt": ("tiny", 4, 8, 4),
        "hf-gpt2": ("tiny", 4, 8, 4),
    },
    "tiny": {
        "mlp": ("tiny", 8, 6, 2), "convnet": ("tiny", 4, 4, 2), "gpt": ("tiny", 2, 4, 2),
        "hf-gpt2": ("tiny", 2, 4, 2),
    },
}


@dataclass
class RunResult:
    workload: str
    precision: str
    engine: str
    active_engine: str = ""
    active_eval_engine: str = ""
    fallback_warnings: List[str] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    weights: Dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    steps_after_warmup: int = 0
    #: metrics flushes (periodic and at epoch ends) and train + eval epoch ends after warm-up
    flushes_after_warmup: int = 0
    epoch_ends_after_warmup: int = 0
    host_reads_after_warmup: int = 0
    #: "method @ file:line" of each host read after warm-up
    host_read_sites: Dict[str, int] = field(default_factory=dict)
    #: "file:line" of the frame that made each CUDA sync after warm-up (CUDA only)
    cuda_sync_sites: Dict[str, int] = field(default_factory=dict)
    cuda_syncs_after_warmup: Optional[int] = None
    #: host reads and CUDA syncs made by the model's own code (a third-party model, such as
    #: transformers' GPT-2 checking its attention mask): no engine but a compiled one removes
    #: them, so they are shown apart and not held against the budget
    model_host_reads_after_warmup: int = 0
    model_cuda_syncs_after_warmup: Optional[int] = None
    recompiles_after_warmup: int = 0
    #: the guard that failed for each of them compiled again, in dynamo's words
    #: (``"function: guard"``); the others were compiled for the first time
    recompile_reasons: List[str] = field(default_factory=list)
    #: dynamo's "hit config.recompile_limit" reports: a frame then runs eagerly, silently
    recompile_limit_hits: List[str] = field(default_factory=list)
    seconds: float = 0.0


#: modules whose frames only pass a warning on: the warnings machinery and the host-read
#: counter's wrapper around the Tensor methods (on CUDA, torch's C++ sync check warns from inside
#: that wrapper, so the warning's own ``filename`` names fasttrain/bench/counters.py)
_PASSING_ON = ("warnings", "_py_warnings", "fasttrain.bench.counters")


def _made_by(frame) -> str:
    """``file:line`` of the frame that made a warning: the innermost one that is neither the
    warnings machinery, the sync counter's wrapper nor torch's own code (torch acting for its
    caller: the engine's step, or a model's forward). '' when no such frame exists."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module not in _PASSING_ON and module != "torch" and not module.startswith("torch."):
            return f"{os.path.abspath(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


#: modules on the stack only while torch compiles: dynamo's entry, inductor's compile of a graph
#: (a backward's too, compiled at its first run) and the autotuning benchmarks, which wait for the
#: device between timings. A sync made under them is the compiler's, paid once, not the step's.
_COMPILING = (
    "torch._dynamo.convert_frame",
    "torch._inductor.compile_fx",
    "torch._inductor.runtime.benchmarking",
    "torch._inductor.select_algorithm",
    "torch._inductor.autotune_process",
    "triton.testing",
)


def _while_compiling(frame) -> bool:
    """Whether a frame runs inside torch's compiler or its autotuning (see :data:`_COMPILING`)."""
    while frame is not None:
        if frame.f_globals.get("__name__", "") in _COMPILING:
            return True
        frame = frame.f_back
    return False


class WarningLog:
    """Records every warning raised inside it, as ``warnings.catch_warnings(record=True)`` does
    (``records``), and beside each the frame that made it (``makers``, see :func:`_made_by`), so
    that CUDA syncs made in a third-party model's own code are told from the trainer's: the
    warning's ``filename`` is the innermost Python frame, which for a sync inside a counted
    Tensor method is the counter's wrapper, whoever called it. ``compiling``: beside each, whether
    torch's compiler was on the stack (:func:`_while_compiling`)."""

    def __init__(self):
        self.records: List[warnings.WarningMessage] = []
        self.makers: List[str] = []
        self.compiling: List[bool] = []
        self._context = None

    def _show(self, message, category, filename, lineno, file=None, line=None):
        self.records.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
        # frame 1 is the warnings module's dispatch; the walk skips it
        self.makers.append(_made_by(sys._getframe(1)))
        self.compiling.append(_while_compiling(sys._getframe(1)))

    def __enter__(self) -> "WarningLog":
        self._context = warnings.catch_warnings(record=True)
        self._context.__enter__()
        warnings.simplefilter("always")
        # the documented hook: catch_warnings puts the previous one back on exit
        warnings.showwarning = self._show
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def __iter__(self):
        return iter(self.records)

    def syncs(self, compiling: Optional[bool] = None) -> List[str]:
        """The makers of the CUDA sync warnings recorded so far: all of them, or only those made
        while torch compiled (``compiling=True``) or only the others (``False``)."""
        return [
            maker
            for w, maker, during in zip(self.records, self.makers, self.compiling)
            if _is_sync_warning(w) and (compiling is None or during == compiling)
        ]


class _Probe(TrainerCallback):
    """Keeps each micro-step's loss on the device (a copy: graphed engines hand out ring views that
    are reused after a flush) and marks the end of the warm-up epoch in the counters."""

    def __init__(self, sync_counter: SyncCounter, caught: WarningLog, recompiles: RecompileCounter,
                 model_dir: Optional[str] = None):
        self.losses: List[torch.Tensor] = []
        self._model_dir = model_dir
        self.steps = 0
        self.flushes = 0
        self.epoch_ends = 0
        self._sync_counter, self._caught, self._recompiles = sync_counter, caught, recompiles
        self.marks: Dict[str, tuple] = {}
        self.sites: Dict[str, Counter] = {}
        self.cuda_sites: Dict[str, Counter] = {}
        #: how many recompile reasons there were at each mark
        self.reasons: Dict[str, int] = {}

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].detach().clone())
        self.steps += 1

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        self.flushes += 1

    def on_train_epoch_end(self, trainer, **kwargs):
        self.epoch_ends += 1

    def on_eval_epoch_end(self, trainer, **kwargs):
        self.epoch_ends += 1

    def _in_model(self, filename: str) -> bool:
        return self._model_dir is not None and os.path.abspath(filename).startswith(self._model_dir + os.sep)

    def _mark(self, name: str) -> None:
        self._recompiles.update()
        syncs = self._caught.syncs()
        model_cuda = sum(1 for maker in syncs if maker and self._in_model(maker.rsplit(":", 1)[0]))
        model_reads = sum(n for (_, site), n in self._sync_counter.by_site.items() if self._in_model(site.rsplit(":", 1)[0]))
        self.marks[name] = (
            self.steps, self._sync_counter.count - model_reads, len(syncs) - model_cuda, self._recompiles.recompiles,
            self.flushes, self.epoch_ends, model_reads, model_cuda,
        )
        self.sites[name] = Counter(self._sync_counter.by_site)
        self.cuda_sites[name] = Counter(syncs)
        self.reasons[name] = len(self._recompiles.reasons)

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 1:
            self._mark("warm")

    def on_training_run_end(self, trainer, **kwargs):
        self._mark("end")


class _LimitHits(logging.Handler):
    """Collects dynamo's report that a frame reached its recompile limit (after which dynamo runs
    that frame eagerly for the rest of the process, with only this log line to show for it)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "hit config." in message and "limit" in message:
            self.messages.append(" ".join(message.split("\n")[:2]))


def _is_sync_warning(w) -> bool:
    return "synchroniz" in str(w.message)


def _is_fallback_warning(w) -> bool:
    return "falls back" in str(w.message)


def model_package_dir(model: torch.nn.Module) -> Optional[str]:
    """The folder of the third-party package a model's class comes from (transformers), or None
    for models defined in fasttrain, torch or the calling script."""
    top = type(model).__module__.split(".")[0]
    module = sys.modules.get(top)
    if top in ("fasttrain", "torch", "__main__") or getattr(module, "__file__", None) is None:
        return None
    return os.path.dirname(os.path.abspath(module.__file__))


def _datasets(wl, full_batches: int):
    """Train and eval sets whose last batch is partial (half a batch)."""
    b = wl.batch_size
    train = torch.utils.data.Subset(wl.dataset, range(full_batches * b + b // 2 + 1))
    evaluation = torch.utils.data.Subset(wl.dataset, range(2 * b + b // 2 + 1))
    return train, evaluation


def train_once(
    name: str, precision: str, engine: str, device: torch.device, sizes: dict, backend: str = "inductor"
) -> RunResult:
    size, batch, full_batches, flush_every = sizes[name]
    wl = make_workload(name, size=size, device=device, batch_size=batch, precision=precision, num_batches=full_batches + 1)
    train_set, eval_set = _datasets(wl, full_batches)
    model = wl.make_model()
    optimizer = wl.make_optimizer(model)
    result = RunResult(name, precision, engine)
    # accelerate keeps one precision per process; each run chooses its own
    AcceleratorState._reset_state()
    with WarningLog() as caught:
        trainer = Trainer(
            model,
            wl.loss_func,
            optimizer,
            callbacks=get_default_callbacks(progress_bar=False),
            engine=engine,
            log_every_n_steps=flush_every,
            mixed_precision="bf16" if precision == "bf16" else "no",
            compile_options={"backend": backend},
        )
        # on CUDA a read of a CPU tensor is no sync; on the CPU every read stands in for one
        sync_counter = SyncCounter(cuda=False, skip_cpu_tensors=device.type == "cuda")
        limit_hits = _LimitHits()
        dynamo_log = logging.getLogger("torch._dynamo")
        dynamo_log.addHandler(limit_hits)
        recompiles = RecompileCounter()
        probe = _Probe(sync_counter, caught, recompiles, model_package_dir(model))
        trainer.callback_handler.add_callback(probe)
        loader_kwargs = {"shuffle": False, "num_workers": 0, "pin_memory": False}
        old_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
        start = time.perf_counter()
        with sync_counter, recompiles:
            if old_mode is not None:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train(
                    train_dataset=train_set,
                    eval_dataset=eval_set,
                    num_epochs=EPOCHS,
                    per_device_batch_size=batch,
                    gradient_accumulation_steps=ACCUMULATION,
                    gradient_clip_norm=CLIP_NORM,
                    train_dataloader_kwargs=loader_kwargs,
                    eval_dataloader_kwargs=loader_kwargs,
                    collate_fn=wl.collate_fn,
                )
            finally:
                dynamo_log.removeHandler(limit_hits)
                if old_mode is not None:
                    torch.cuda.set_sync_debug_mode(old_mode)
        if device.type == "cuda":
            # SYNC: outside the counted run, so the wall time covers the queued work.
            torch.cuda.synchronize(device)
        result.seconds = time.perf_counter() - start
    result.fallback_warnings = [str(w.message) for w in caught if _is_fallback_warning(w)]
    result.recompile_limit_hits = limit_hits.messages
    result.active_engine = getattr(trainer._engine, "active_engine", trainer._engine.name)
    result.active_eval_engine = getattr(trainer._engine, "active_eval_engine", trainer._engine.name)
    result.losses = torch.stack(probe.losses).float().cpu().tolist()
    result.weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    warm, end = probe.marks["warm"], probe.marks["end"]
    result.steps_after_warmup = end[0] - warm[0]
    result.host_reads_after_warmup = end[1] - warm[1]
    result.host_read_sites = {f"{m} @ {site}": n for (m, site), n in (probe.sites["end"] - probe.sites["warm"]).items()}
    result.cuda_syncs_after_warmup = end[2] - warm[2] if device.type == "cuda" else None
    result.cuda_sync_sites = dict(probe.cuda_sites["end"] - probe.cuda_sites["warm"])
    result.recompiles_after_warmup = end[3] - warm[3]
    result.recompile_reasons = recompiles.reasons[probe.reasons["warm"]:probe.reasons["end"]]
    result.flushes_after_warmup = end[4] - warm[4]
    result.epoch_ends_after_warmup = end[5] - warm[5]
    result.model_host_reads_after_warmup = end[6] - warm[6]
    result.model_cuda_syncs_after_warmup = end[7] - warm[7] if device.type == "cuda" else None
    return result


def sync_budget(run: RunResult) -> int:
    """Synchronising calls allowed after warm-up: one per metrics flush (an epoch end flushes
    too) and one per train and eval epoch end (the epoch loss)."""
    return SYNCS_PER_FLUSH * run.flushes_after_warmup + SYNCS_PER_EPOCH_END * run.epoch_ends_after_warmup


def weight_difference(weights: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """||w - w_ref|| / ||w_ref|| over all floating-point tensors of a state dict taken as one vector.

    One vector, not tensor by tensor: a parameter whose gradient is zero in exact arithmetic (the
    key bias of attention: softmax ignores a constant added to every score) receives rounding
    noise, which Adam normalises into full-size steps, so its own relative difference measures
    noise, not the engines."""
    if weights.keys() != reference.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(weights.keys() ^ reference.keys())}")
    diff = sum(float((weights[k] - ref).double().pow(2).sum()) for k, ref in reference.items())
    norm = sum(float(ref.double().pow(2).sum()) for ref in reference.values())
    return math.sqrt(diff / norm) if norm else math.sqrt(diff)


def loss_difference(losses: List[float], reference: List[float]) -> tuple:
    """(mean, max) of |l - l_ref| / |l_ref| over the steps of two loss curves."""
    if len(losses) != len(reference):
        raise ValueError(f"loss curves have {len(losses)} and {len(reference)} steps")
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
    return sum(rel) / len(rel), max(rel)


def expected_engine(engine: str, device: torch.device) -> str:
    if device.type != "cuda":
        return CPU_FALLBACK.get(engine, engine)
    return engine


def judge(runs: List[RunResult], device: torch.device) -> List[str]:
    """The failures of one workload and precision's runs, one line each (empty: all passed)."""
    failures = []
    by_engine = {r.engine: r for r in runs}
    for run in runs:
        tag = f"{run.workload}/{run.precision}/{run.engine}"
        want = expected_engine(run.engine, device)
        if run.active_engine != want or run.active_eval_engine != want:
            failures.append(
                f"{tag}: asked for {run.engine!r}, training ran {run.active_engine!r} and evaluation "
                f"{run.active_eval_engine!r} (expected {want!r}); warnings: {run.fallback_warnings or 'none'}"
            )
        if want != run.engine and not run.fallback_warnings:
            failures.append(f"{tag}: fell back to {run.active_engine!r} without a warning")
        if want == run.engine and run.fallback_warnings:
            failures.append(f"{tag}: fallback warnings raised: {run.fallback_warnings}")
        for hit in run.recompile_limit_hits:
            failures.append(f"{tag}: part of the step ran eagerly without a warning: {hit}")
        if run.recompiles_after_warmup > MAX_RECOMPILES_AFTER_WARMUP:
            why = "; ".join(reason[:200] for reason in run.recompile_reasons[:3])
            failures.append(
                f"{tag}: {run.recompiles_after_warmup} frames compiled after the first epoch"
                + (f" (guards that failed: {why})" if why else " (each for the first time)")
            )
        budget = sync_budget(run)
        for label, count in (("host reads", run.host_reads_after_warmup), ("CUDA syncs", run.cuda_syncs_after_warmup)):
            if count is not None and count > budget:
                failures.append(
                    f"{tag}: {count} {label} in {run.steps_after_warmup} steps after warm-up, over the "
                    f"budget of {budget} ({run.flushes_after_warmup} flushes, {run.epoch_ends_after_warmup} epoch ends)"
                )
    reference = by_engine.get("eager")
    for run in runs:
        if reference is None or run is reference:
            continue
        tag = f"{run.workload}/{run.precision}/{run.engine}"
        if run.precision == "fp32":
            diff = weight_difference(run.weights, reference.weights)
            run.__dict__["weight_rel_diff"] = diff
            if not diff <= FP32_WEIGHT_RTOL:
                failures.append(f"{tag}: final weights differ from eager's by {diff:.3g} (> {FP32_WEIGHT_RTOL:g})")
        else:
            mean, worst = loss_difference(run.losses, reference.losses)
            run.__dict__["loss_rel_diff"] = (mean, worst)
            if not (mean <= BF16_LOSS_MEAN_RTOL and worst <= BF16_LOSS_MAX_RTOL):
                failures.append(
                    f"{tag}: losses differ from eager's by {mean:.3g} on average, {worst:.3g} at worst "
                    f"(bounds {BF16_LOSS_MEAN_RTOL:g}, {BF16_LOSS_MAX_RTOL:g})"
                )
    return failures


def _row(run: RunResult) -> str:
    diff = run.__dict__.get("weight_rel_diff")
    loss = run.__dict__.get("loss_rel_diff")
    agreement = f"w {diff:.2e}" if diff is not None else (f"loss {loss[0]:.2e}/{loss[1]:.2e}" if loss else "reference")
    cuda = "n/a" if run.cuda_syncs_after_warmup is None else run.cuda_syncs_after_warmup
    if run.model_cuda_syncs_after_warmup:
        cuda = f"{cuda} (+{run.model_cuda_syncs_after_warmup} model)"
    reads = run.host_reads_after_warmup
    if run.model_host_reads_after_warmup:
        reads = f"{reads} (+{run.model_host_reads_after_warmup} model)"
    return (
        f"| {run.workload} | {run.precision} | {run.engine} | {run.active_engine}/{run.active_eval_engine} | "
        f"{agreement} | {cuda} | {reads} | {sync_budget(run)} | "
        f"{run.steps_after_warmup} | {run.recompiles_after_warmup} | {run.seconds:.1f} |"
    )


def _set_precision_flags(device: torch.device) -> None:
    # fp32 must mean fp32: TF32 matmuls round to 10 bits and would hide a real difference
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--workloads", default=",".join(SIZES["tiny"]), help="comma-separated from " + ", ".join(SIZES["tiny"]))
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated from fp32, bf16")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated; eager is the reference")
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes (CI); the same as --sizes tiny")
    parser.add_argument("--sizes", choices=sorted(SIZES), default=None,
                        help="the size table to use (default: the device's); --sizes cuda on a CPU measures "
                        "what a GPU run compiles, at the GPU's sizes")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled engines; CI uses aot_eager, which checks the "
        "engines' logic (fallbacks, recompiles, syncs, agreement) without inductor's compile time",
    )
    parser.add_argument("--out", default=None, help="folder for check.json and check.md")
    args = parser.parse_args(argv)
    for option, allowed in (("workloads", SIZES["tiny"]), ("precisions", PRECISIONS), ("engines", ENGINES)):
        values = [v.strip() for v in getattr(args, option).split(",") if v.strip()]
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            parser.error(f"--{option}: {unknown or 'nothing given'}; choose from {', '.join(allowed)}")
        setattr(args, option, values)
    if "eager" not in args.engines:
        parser.error("--engines must include eager: every other engine is compared with it")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (a CPU build of torch, or no driver)")
    return args


def report(args, device: torch.device, all_runs: List[RunResult], failures: List[str], not_run: List[str],
           pending: List[str]) -> str:
    """check.md's text: the table so far, what could not run, what is still to run."""
    lines = [
        f"# fasttrain engine checks on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
        "",
        f"compile backend {args.compile_backend}; {EPOCHS} epochs with a partial last batch, accumulation {ACCUMULATION}, norm clip {CLIP_NORM}, eval set; "
        f"counts after the first epoch. Tolerances: fp32 weights rel <= {FP32_WEIGHT_RTOL:g} (TF32 off); "
        f"bf16 losses rel mean <= {BF16_LOSS_MEAN_RTOL:g}, max <= {BF16_LOSS_MAX_RTOL:g}; "
        f"syncs <= {SYNCS_PER_FLUSH}/flush + {SYNCS_PER_EPOCH_END}/epoch end; recompiles <= {MAX_RECOMPILES_AFTER_WARMUP}. "
        "'(+n model)': reads in the model's own code (a third-party model's package), not held against the budget.",
        "",
        "| workload | precision | engine asked | ran (train/eval) | vs eager | CUDA syncs | host reads | sync budget | steps | recompiles | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[_row(r) for r in all_runs],
        "",
    ]
    if not_run:
        lines += ["not run:", "", *[f"- {line}" for line in not_run], ""]
    if pending:
        lines += [f"still to run (the check was cut short here): {', '.join(pending)}", ""]
    lines += ["## failed", "", *[f"- {f}" for f in failures]] if failures else ["all checks passed" if not pending else ""]
    return "\n".join(lines + [""])


def write_outputs(folder: Optional[str], device_name: str, text: str, runs: List[RunResult], failures: List[str],
                  not_run: List[str]) -> None:
    """check.md and check.json, rewritten after each workload and precision so a run stopped
    part-way keeps what finished."""
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "check.md"), "w") as f:
        f.write(text)
    records = [{k: v for k, v in r.__dict__.items() if k != "weights"} for r in runs]
    with open(os.path.join(folder, "check.json"), "w") as f:
        json.dump({"device": device_name, "failures": failures, "not_run": not_run, "runs": records}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    sizes = SIZES[args.sizes or ("tiny" if args.tiny else args.device)]
    _set_precision_flags(device)
    all_runs: List[RunResult] = []
    failures: List[str] = []
    not_run: List[str] = []
    groups = [(name, precision) for name in args.workloads for precision in args.precisions]
    for index, (name, precision) in enumerate(groups):
        runs = []
        try:
            for engine in args.engines:
                print(f"gpu_check: {name} {precision} {engine} ...", file=sys.stderr, flush=True)
                runs.append(train_once(name, precision, engine, device, sizes, args.compile_backend))
        except PeerUnavailable as exc:
            # a workload whose package is missing here (transformers for hf-gpt2): said, not failed
            not_run.append(f"{name}/{precision}: {exc}")
            runs = []
        failures += judge(runs, device)
        all_runs += runs
        pending = [f"{n}/{p}" for n, p in groups[index + 1:]]
        text = report(args, device, all_runs, failures, not_run, pending)
        write_outputs(args.out, args.device, text, all_runs, failures, not_run)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

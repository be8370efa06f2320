"""Running the peers: warm-up and measurement runs, then interleaved timed repeats.

How a peer is timed. A run is one whole training call of ``n`` steps (see peers.py). Per repeat,
the runner times ``run(W)`` and ``run(W + N)`` back to back, W the warm-up steps and N the
measured steps, and takes ``(T(W + N) - T(W)) / N`` as the steady-state time of one step. The
difference cancels everything a training call pays once — building a DataLoader iterator,
``train()``'s setup and epoch-end work, Lightning's ``fit`` machinery — and the first W steps of
each call, so what remains is the cost of steps W..W+N inside a running loop. Every peer is timed
the same way, with the clock read only around whole calls: nothing runs per step on behalf of the
measurement. Each run ends with a device synchronisation, so the clock covers the work. The clock
is wall time, or process CPU time for single-threaded CPU runs on shared hosts (see ``CLOCKS``).

Order. All peers are set up and warmed up first. Then ``for repeat: for peer: time(peer)``, so
slow drift of the machine (clock boost, thermal state, other tenants) spreads over every peer
instead of biasing whichever ran last.

Counting. Host syncs and recompiles are counted in separate, untimed runs after warm-up (the sync
counter patches tensor methods and would slow the loops it counts), with the same difference of
two runs, so the per-call costs such as an epoch-end loss read drop out. Recompiles are also
counted over every timed run, since they cost nothing to read.

Stopping. SIGINT and SIGTERM (a scheduler's or ``timeout``'s end) stop the run at once: the repeat
in progress is dropped for every peer and what completed is returned. With a time limit
(time_limit.py) the run is sized to end inside it, and its end stops the run the same way.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from fasttrain.bench.counters import RecompileCounter, SyncCounter
from fasttrain.bench.peers import PeerUnavailable, device_sync, make_peer
from fasttrain.bench.time_limit import REPEAT_MARGIN, PEER_SPREAD, TimeLimit, fit_schedule, steps_that_fit
from fasttrain.bench.workloads import Workload
from fasttrain.hardware import GpuSampler

try:
    import resource
except ImportError:  # not on Windows; memory is then reported as n/a
    resource = None


@dataclass
class PeerResult:
    name: str
    status: str = "ok"  # "ok", "unavailable" or "failed"
    reason: Optional[str] = None
    #: steady-state seconds per step, one per repeat.
    step_times: List[float] = field(default_factory=list)
    #: repeats whose difference came out non-positive (noise larger than N steps' work).
    invalid_repeats: int = 0
    setup_s: Optional[float] = None
    #: Python-level host syncs per step (``.item()``, ``.cpu()``, ...), and CUDA-reported ones.
    host_syncs_per_step: Optional[float] = None
    cuda_syncs_per_step: Optional[float] = None
    sync_methods: Dict[str, float] = field(default_factory=dict)
    #: syncs per step by calling line, to find where a loop syncs.
    sync_sites: Dict[str, float] = field(default_factory=dict)
    recompiles: int = 0
    #: why frames compiled again after warm-up (``"function: guard"``, dynamo's words) and how
    #: often, over the counting pair and the timed repeats
    recompile_reasons: Dict[str, int] = field(default_factory=dict)
    new_graphs: int = 0
    graph_breaks: int = 0
    peak_memory_mb: Optional[float] = None
    memory_kind: Optional[str] = None
    gpu: Dict[str, object] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    #: the step engine that actually ran training steps (fasttrain peers), which differs from the
    #: one asked for after a fallback; None for peers without engines.
    engine: Optional[str] = None
    #: why the engine asked for did not run (the fallback warning), when it did not.
    engine_fallback: Optional[str] = None
    #: seconds of the untimed counting pair after warm-up, ``run(W)`` and ``run(W + N)``, and
    #: the steps it ran (``2W + N``): what a timed repeat of this peer will take
    pair_s: Optional[float] = None
    pair_steps: Optional[int] = None

    @property
    def label(self) -> str:
        return peer_label(self.name, self.engine)


def peer_label(name: str, engine: Optional[str]) -> str:
    """A peer's name as tables and charts show it: with the engine that ran, when that is not
    the one its name promises (``fasttrain-cudagraph (ran compiled)`` on a CPU)."""
    if engine is not None and not name.endswith("-" + engine):
        return f"{name} (ran {engine})"
    return name


@dataclass
class BenchResult:
    workload: Dict[str, object]
    settings: Dict[str, object]
    peers: List[PeerResult]
    #: True when Ctrl-C (SIGINT) ended the run early: only repeats every peer completed are kept.
    interrupted: bool = False
    #: repeats completed by every measured peer (``settings["repeats"]`` were asked for).
    completed_repeats: int = 0

    def to_dict(self) -> Dict[str, object]:
        return {
            "workload": self.workload,
            "settings": self.settings,
            "interrupted": self.interrupted,
            "completed_repeats": self.completed_repeats,
            "peers": [asdict(p) for p in self.peers],
        }


class BenchInterrupted(Exception):
    """Ctrl-C (or SIGTERM, or the time limit's end) reached a peer's run; that run is discarded."""


class SetupOverran(Exception):
    """A peer's set-up ran past the time a time limit left for it; the peer is skipped."""


class _CtrlC:
    """Turns SIGINT and SIGTERM into a prompt stop of the benchmark, whatever the peers do with
    them, and SIGALRM into the time limit's stops.

    Peers handle the signals their own ways: fasttrain's trainer finishes the step and returns
    from ``train()`` (the peer then raises ``KeyboardInterrupt``), Lightning catches
    ``KeyboardInterrupt``, ignores SIGINT from then on and calls ``exit(1)``. The runner keeps
    its own handlers, records that a signal came and puts the handlers back after every peer
    call, so a run cut short by any of them is recognised and thrown away rather than timed.
    The alarm (:meth:`arm`) either ends a set-up that ran past its time (``"setup"``: the peer is
    skipped, the run goes on) or ends the run as SIGINT does (``"end"``).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = False
        #: what stopped the run: "SIGINT", "SIGTERM" or "time limit" (None: a peer's own handler)
        self.stopped_by: Optional[str] = None
        self.setup_overran = False
        self._alarm_kind: Optional[str] = None
        self._previous: Dict[int, object] = {}
        self._installed = False
        self._in_peer_call = False

    def _handle(self, signum, frame):
        self.received = True
        self.stopped_by = self.stopped_by or signal.Signals(signum).name
        # inside a peer's run the exception stops it at once; between runs (the runner's own
        # bookkeeping) the flag is enough: the next guard raises before starting anything
        if self._in_peer_call:
            raise KeyboardInterrupt

    def _alarm(self, signum, frame):
        if self._alarm_kind == "setup":
            self.setup_overran = True
        else:
            self.received = True
            self.stopped_by = self.stopped_by or "time limit"
        if self._in_peer_call:
            raise KeyboardInterrupt

    def arm(self, seconds: float, kind: str) -> None:
        """Raise the alarm ``kind`` ("setup" or "end") after ``seconds`` (at once when none are left)."""
        if self._installed:
            self._alarm_kind = kind
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))

    def disarm(self) -> None:
        if self._installed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._alarm_kind = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._alarm)
            self._installed = True
        return self

    def reinstall(self) -> None:
        if self._installed:
            for signum in self.SIGNALS:
                signal.signal(signum, self._handle)
            signal.signal(signal.SIGALRM, self._alarm)

    @contextlib.contextmanager
    def guard(self):
        """Run one peer call; raise :class:`BenchInterrupted` if Ctrl-C cut it short."""
        if self.received:
            raise BenchInterrupted
        self._in_peer_call = True
        try:
            yield
        except KeyboardInterrupt:
            if self.setup_overran:
                raise SetupOverran from None
            raise BenchInterrupted from None
        except SystemExit:
            if self.setup_overran:
                raise SetupOverran from None
            if not self.received:
                raise
            raise BenchInterrupted from None
        finally:
            self._in_peer_call = False
            self.reinstall()
        if self.received:
            raise BenchInterrupted

    def __exit__(self, *exc):
        if self._installed:
            self.disarm()
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._installed = False


@contextlib.contextmanager
def quiet():
    """Send every peer's console output (progress bars, prints, log records) to a null stream.

    The peers still do the work of producing it — tqdm still formats its bar — so the default
    callbacks run as users run them, minus the terminal's own cost, which is not the trainer's.
    Applied to all peers alike.
    """
    sink = open(os.devnull, "w")
    previous_disable = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logging.disable(previous_disable)
        sink.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Memory:
    """Peak memory attributable to one peer's setup and warm-up.

    CUDA: the allocator's peak of reserved memory minus what was reserved before (other peers'
    weights stay resident; the cache is emptied first, so that one peer's cached blocks do not
    serve the next). Reserved, not allocated: a CUDA graph's intermediates count as allocated
    only while it is captured, and between replays they are free blocks of its private pool, so
    the allocated peak would miss what runs beside the pool. CPU: growth of the process's peak RSS; it reads 0 when the peer fits in memory an
    earlier peer already touched, so it is a lower bound.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = None
        self._base = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # SYNC(bench): measure from an idle device
            torch.cuda.empty_cache()
            self._base = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.kind = "cuda_max_reserved"
        elif resource is not None:
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.kind = "cpu_peak_rss_delta"
        return self

    def __exit__(self, *exc):
        pass

    def peak_mb(self) -> Optional[float]:
        if self.kind == "cuda_max_reserved":
            return (torch.cuda.max_memory_reserved(self.device) - self._base) / 2**20
        if self.kind == "cpu_peak_rss_delta":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            # Linux reports KiB, macOS bytes.
            scale = 2**20 if sys.platform == "darwin" else 2**10
            return (peak - self._base) / scale
        return None


_FALLBACK_WORDS = ("fall back", "falls back", "falling back", "fallback")


def _add_reasons(result: PeerResult, counter: RecompileCounter) -> None:
    for reason in counter.reasons:
        result.recompile_reasons[reason] = result.recompile_reasons.get(reason, 0) + 1


def _setup_peer(peer, result: PeerResult, warmup: int, steps: int, count_syncs: bool) -> None:
    """Build and warm up one peer, then count its syncs and recompiles per step."""
    wl = peer.workload
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Memory(wl.device) as mem:
            t0 = time.perf_counter()
            peer.setup()
            peer.run(warmup)  # compile, capture, allocator growth: everything a first call pays
            result.setup_s = time.perf_counter() - t0
            if count_syncs:
                on_gpu = wl.device.type == "cuda"
                with RecompileCounter() as rc:
                    t1 = time.perf_counter()
                    with SyncCounter(skip_cpu_tensors=on_gpu) as short:
                        peer.run(warmup)
                    with SyncCounter(skip_cpu_tensors=on_gpu) as long:
                        peer.run(warmup + steps)
                    result.pair_s, result.pair_steps = time.perf_counter() - t1, 2 * warmup + steps
                result.host_syncs_per_step = (long.count - short.count) / steps
                if long.cuda_syncs is not None:
                    result.cuda_syncs_per_step = (long.cuda_syncs - short.cuda_syncs) / steps
                methods = set(long.by_method) | set(short.by_method)
                result.sync_methods = {
                    m: (long.by_method[m] - short.by_method[m]) / steps
                    for m in sorted(methods)
                    if long.by_method[m] != short.by_method[m]
                }
                result.sync_sites = {
                    f"{m} @ {site}": round((long.by_site[(m, site)] - short.by_site[(m, site)]) / steps, 4)
                    for m, site in long.by_site
                    if long.by_site[(m, site)] > short.by_site[(m, site)]
                }
                result.recompiles += rc.recompiles
                _add_reasons(result, rc)
                result.new_graphs += rc.new_graphs
                result.graph_breaks += rc.graph_breaks
            device_sync(wl.device)
        result.peak_memory_mb = mem.peak_mb()
        result.memory_kind = mem.kind
    seen = set()
    for w in caught:
        msg = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if any(word in msg.lower() for word in _FALLBACK_WORDS) and msg not in seen:
            seen.add(msg)
            result.notes.append(msg)
    result.engine = getattr(peer, "engine_ran", None)
    if result.engine is not None and result.label != result.name:
        result.engine_fallback = next(iter(result.notes), None) or "fell back at set-up"


#: "wall": elapsed time, what a user waits for; the only meaningful clock when a GPU does the work.
#: "cpu": this process's CPU time. On a CPU run with one intra-op thread every bit of training
#: work is done by this process, so its CPU time equals the wall time of an idle machine, but it
#: does not count the time the process sits descheduled while neighbours use the cores: on a
#: shared host it removes most of the noise. With several threads it would also count their
#: spin-waiting, so it is for single-threaded CPU runs only.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time_pair(peer, warmup: int, steps: int, clock=time.perf_counter) -> float:
    """Seconds per steady-state step from one (short, long) pair of runs."""
    # SYNC(bench): start the clock with an idle device, so no earlier work is billed to this pair.
    device_sync(peer.device)
    t0 = clock()
    peer.run(warmup)
    t1 = clock()
    peer.run(warmup + steps)
    t2 = clock()
    return ((t2 - t1) - (t1 - t0)) / steps


def _merge_gpu(summaries: List[Dict[str, object]]) -> Dict[str, object]:
    ok = [s for s in summaries if s.get("available") and s.get("samples")]
    if not summaries:
        return {}
    if not ok:
        return {"available": False, "reason": summaries[0].get("reason") or "no samples"}
    out: Dict[str, object] = {"available": True, "samples": sum(s["samples"] for s in ok)}
    for key in ("utilization_mean", "power_mean_w", "sm_clock_mean_mhz"):
        vals = [s[key] for s in ok if s.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    for key in ("utilization_max", "memory_used_max_mb"):
        vals = [s[key] for s in ok if s.get(key) is not None]
        out[key] = max(vals) if vals else None
    return out


def _pair_seconds(result: PeerResult, warmup: int, steps: int) -> Optional[float]:
    """What a timed pair of this peer takes at ``warmup``/``steps``, from its counting pair."""
    if not result.pair_s or not result.pair_steps:
        return None
    return result.pair_s * (2 * warmup + steps) / result.pair_steps


def run_benchmark(
    workload: Workload,
    peer_names: List[str],
    steps: int,
    warmup: int,
    repeats: int,
    progress: bool = True,
    count_syncs: bool = True,
    gpu_metrics: bool = True,
    settings: Optional[Dict[str, object]] = None,
    clock: str = "wall",
    on_setup: Optional[Callable[[PeerResult, int, int, int, int], None]] = None,
    time_limit: Optional[TimeLimit] = None,
) -> BenchResult:
    """Set up every peer, then time ``repeats`` interleaved rounds. ``on_setup`` is called after
    each peer is set up (the command line prints its time estimate from the first one). Ctrl-C
    or SIGTERM stops at once: the round it cut short is discarded and the result says
    ``interrupted``. With ``time_limit`` the run is sized to end inside it (time_limit.py)."""
    if steps < 1 or warmup < 1 or repeats < 1:
        raise ValueError("steps, warmup and repeats must each be at least 1")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, not {clock!r}")
    if clock == "cpu" and workload.device.type != "cpu":
        raise ValueError("the cpu clock cannot see GPU work; use the wall clock on CUDA")
    if time_limit is not None and not count_syncs:
        raise ValueError("a time limit needs the counting runs (count_syncs=True): they time each peer's steps")
    clock_fn = CLOCKS[clock]
    from tqdm.auto import tqdm

    # One epoch must hold the longest run: the trainers stop at max_num_train_steps within it.
    workload.resize(warmup + steps)
    results = {name: PeerResult(name) for name in peer_names}
    peers = {}
    bar = tqdm(
        total=len(peer_names) * (repeats + 1), desc="bench", unit="run", file=sys.stderr,
        disable=not progress, leave=False,
    )
    interrupted = False
    completed = 0
    sampler = None
    ctrl_c = _CtrlC()
    try:
        with ctrl_c:
            try:
                skipped = None  # why the remaining peers are not set up (the time limit)
                for name in peer_names:
                    res = results[name]
                    if skipped is not None:
                        res.status, res.reason = "skipped", skipped
                        bar.update(1)
                        continue
                    if time_limit is not None:
                        # this set-up may use the time left less one repeat of every peer so far
                        # and of this one (at the spread of the first peer's step time)
                        pairs = [_pair_seconds(results[n], warmup, steps) or 0.0 for n in peers]
                        room = time_limit.repeat_room(pairs + [PEER_SPREAD * max(pairs, default=0.0)])
                        if room <= 0:
                            skipped = "not set up: the time limit left no room for it (--time-limit)"
                            res.status, res.reason = "skipped", skipped
                            bar.update(1)
                            continue
                        ctrl_c.arm(room, "setup")
                    bar.set_postfix_str(f"setup {name}")
                    peer = make_peer(name, workload)
                    try:
                        with ctrl_c.guard(), quiet():
                            _setup_peer(peer, res, warmup, steps, count_syncs)
                        peers[name] = peer
                    except SetupOverran:
                        skipped = "not set up: the time limit left no room for it (--time-limit)"
                        res.status = "skipped"
                        res.reason = f"its set-up ran past the {room:.0f} s the time limit left for it (--time-limit)"
                        peer.close()
                    except BenchInterrupted:
                        res.status, res.reason = "interrupted", f"{ctrl_c.stopped_by or 'Ctrl-C'} during its set-up"
                        peer.close()
                        raise
                    except PeerUnavailable as exc:
                        res.status, res.reason = "unavailable", str(exc)
                        peer.close()
                    except Exception as exc:  # a peer that cannot be built is reported, not fatal
                        res.status, res.reason = "unavailable", _first_line(exc)
                        if ctrl_c.setup_overran:
                            # the alarm's exception surfaced as another (a CUDA graph capture
                            # cut short fails on its way out)
                            skipped = "not set up: the time limit left no room for it (--time-limit)"
                            res.status = "skipped"
                            res.reason = f"its set-up ran past the {room:.0f} s the time limit left for it (--time-limit)"
                        peer.close()
                    finally:
                        ctrl_c.disarm()
                        ctrl_c.setup_overran = False
                    gc.collect()
                    bar.update(1)
                    if time_limit is not None and list(peers) == [name]:
                        # the first peer set up: size the run from its steady step time
                        per_step = res.pair_s / res.pair_steps
                        fitted = fit_schedule(per_step, len(peer_names), time_limit.left(), steps, warmup, repeats)
                        if fitted != (steps, warmup, repeats):
                            time_limit.note(
                                f"--time-limit {time_limit.seconds:g} s: {fitted[0]} steps after {fitted[1]} "
                                f"warm-up, {fitted[2]} repeat(s) (asked {steps}, {warmup}, {repeats}), from the "
                                f"{name} loop's {per_step * 1000:.3g} ms per step"
                            )
                            steps, warmup, repeats = fitted
                    if on_setup is not None and name in peers:
                        on_setup(res, warmup, steps, repeats, len(peer_names))

                sampler = GpuSampler(workload.device) if gpu_metrics else None
                gpu_summaries: Dict[str, List[Dict[str, object]]] = {n: [] for n in peers}
                if time_limit is not None:
                    ctrl_c.arm(time_limit.left(), "end")
                last_repeat_s = None
                for repeat in range(repeats):
                    if time_limit is not None and peers:
                        pairs = [(results[n].pair_s, results[n].pair_steps) for n in peers]
                        expected = last_repeat_s or sum(_pair_seconds(results[n], warmup, steps) for n in peers)
                        if time_limit.left() < REPEAT_MARGIN * expected:
                            if completed:
                                time_limit.note(
                                    f"--time-limit {time_limit.seconds:g} s: stopped after {completed} of "
                                    f"{repeats} repeats, another would not fit in the time left"
                                )
                                repeats = completed
                                break
                            fit = steps_that_fit(pairs, warmup, steps, time_limit.left())
                            time_limit.note(
                                f"--time-limit {time_limit.seconds:g} s: {fit} measured steps instead of "
                                f"{steps}, so that one repeat fits in the time left"
                            )
                            steps = fit
                    started = time.perf_counter()
                    # a repeat counts only once every peer has run it: an interrupted one is
                    # dropped whole, so all peers keep the same number of interleaved repeats
                    this_repeat: Dict[str, float] = {}
                    for name, peer in list(peers.items()):
                        bar.set_postfix_str(f"repeat {repeat + 1}/{repeats} {name}")
                        res = results[name]
                        # Same starting state for every measurement: garbage left by the previous
                        # peer must not be collected on this one's clock.
                        gc.collect()
                        try:
                            with ctrl_c.guard(), quiet(), RecompileCounter() as rc:
                                if sampler is not None:
                                    sampler.start()
                                try:
                                    per_step = _time_pair(peer, warmup, steps, clock_fn)
                                finally:
                                    if sampler is not None:
                                        gpu_summaries[name].append(sampler.stop())
                        except BenchInterrupted:
                            raise
                        except Exception as exc:
                            res.status, res.reason = "failed", f"during repeat {repeat + 1}: {_first_line(exc)}"
                            peer.close()
                            del peers[name]
                            continue
                        res.recompiles += rc.recompiles
                        _add_reasons(res, rc)
                        res.new_graphs += rc.new_graphs
                        res.graph_breaks += rc.graph_breaks
                        this_repeat[name] = per_step
                        bar.update(1)
                    for name, per_step in this_repeat.items():
                        if name not in peers:
                            continue
                        if per_step > 0:
                            results[name].step_times.append(per_step)
                        else:
                            results[name].invalid_repeats += 1
                    completed = repeat + 1
                    last_repeat_s = time.perf_counter() - started
            except BenchInterrupted:
                interrupted = True
            finally:
                ctrl_c.disarm()
        if sampler is not None:
            sampler.close()
            for name, summaries in gpu_summaries.items():
                results[name].gpu = _merge_gpu(summaries)
    finally:
        bar.close()
        for peer in peers.values():
            peer.close()
    all_settings = {"steps": steps, "warmup": warmup, "repeats": repeats, "peers": peer_names, "clock": clock}
    all_settings.update(settings or {})
    if time_limit is not None:
        all_settings["time_limit"] = time_limit.seconds
        all_settings["time_limit_notes"] = list(time_limit.notes)
    if interrupted:
        # None: a trainer's own handler took the signal (fasttrain's finishes its step and returns)
        all_settings["stopped_by"] = ctrl_c.stopped_by or "a stop signal"
    return BenchResult(
        workload=workload.describe(), settings=all_settings, peers=[results[n] for n in peer_names],
        interrupted=interrupted, completed_repeats=completed,
    )

"""fasttrain reads device values on the host only at flushes and epoch ends.

Every Tensor method that copies a value to the host (``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__``, ``numpy``, ``cpu``) is wrapped; a call is attributed to fasttrain when
the frame calling it is in the fasttrain package or in ``kernels/``, and to the user when it is in
this file. On the CPU these calls cost nothing, but each one would be a host-device
synchronisation on a GPU, so counting them is how the CPU test suite guards the hot path.
"""

from __future__ import annotations

import ast
import collections
import functools
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import fasttrain
import fasttrain.kernels
from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback, get_default_callbacks
from fasttrain.schedulers import CosineLrScheduler

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (fasttrain, fasttrain.kernels)
)
THIS_FILE = os.path.abspath(__file__)


class SyncCounter:
    """Counts host reads of tensors by who asked: ``library`` (fasttrain, kernels), ``user`` (this
    test file); ``where`` keeps ``(file name, line, method)`` of the library's calls and ``paths``
    the full path behind each ``(file name, line)`` (two files may share a name)."""

    def __init__(self):
        self.library = 0
        self.user = 0
        self.where = collections.Counter()
        self.paths = {}


@pytest.fixture
def sync_counter(monkeypatch):
    counter = SyncCounter()

    def wrap(name, original):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename.startswith(LIBRARY_DIRS):
                counter.library += 1
                counter.where[(os.path.basename(filename), frame.f_lineno, name)] += 1
                counter.paths[(os.path.basename(filename), frame.f_lineno)] = filename
            elif filename == THIS_FILE:
                counter.user += 1
            return original(self, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    return counter


class FlushCounter(TrainerCallback):
    def __init__(self):
        self.flushes = 0
        self.epoch_ends = 0

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        self.flushes += 1

    def on_train_epoch_end(self, trainer, **kwargs):
        self.epoch_ends += 1

    def on_eval_epoch_end(self, trainer, **kwargs):
        self.epoch_ends += 1


class ItemEveryStep(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].item())  # a per-step sync, on the user's side


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :1] - x[:, 1:2] + 0.05 * torch.randn(n, 1, generator=g))


def run(extra_callbacks=(), log_every_n_steps=None, num_epochs=2):
    """400 training steps (2 epochs of 200 batches of 2), 20 eval steps per epoch, clipping by
    value and by norm, a cosine schedule, and the default callbacks (progress bar included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    flushes = FlushCounter()
    kwargs = {} if log_every_n_steps is None else {"log_every_n_steps": log_every_n_steps}
    trainer = Trainer(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=(*get_default_callbacks(), flushes, *extra_callbacks),
        **kwargs,
    )
    trainer.train(
        train_dataset=dataset(400, 0),
        eval_dataset=dataset(40, 1),
        num_epochs=num_epochs,
        per_device_batch_size=2,
        gradient_clip_value=0.5,
        gradient_clip_norm=1.0,
        create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1),
        train_dataloader_kwargs={"num_workers": 0},
        eval_dataloader_kwargs={"num_workers": 0},
    )
    return trainer, flushes


TRAIN_STEPS = 2 * 200
EVAL_STEPS = 2 * 20
PER_FLUSH = 3  # a flush may read its packed values and a few counters


def test_syncs_only_at_flushes_and_epoch_ends(sync_counter):
    trainer, flushes = run()
    assert trainer.num_updates == TRAIN_STEPS
    # default interval 50: 8 train flushes + 2 train and 2 eval epoch-end flushes
    assert flushes.flushes == TRAIN_STEPS // 50 + 4
    assert flushes.epoch_ends == 4
    budget = (flushes.flushes + flushes.epoch_ends) * PER_FLUSH
    assert sync_counter.library <= budget, sync_counter.where.most_common(5)
    assert sync_counter.library / (TRAIN_STEPS + EVAL_STEPS) < 0.05, sync_counter.where.most_common(5)
    assert sync_counter.user == 0
    untagged = [(f, line) for f, line, _ in sync_counter.where if not sync_tag(sync_counter.paths[(f, line)], line)]
    assert not untagged, f"host reads without a '# SYNC(<cadence>): why' comment: {untagged}"


def test_sync_count_follows_the_flush_interval(sync_counter):
    """With a flush every update the reads grow with the steps, bounded by the flushes: the
    count really depends on the interval, not on a fixed setup cost."""
    trainer, flushes = run(log_every_n_steps=1, num_epochs=1)
    assert flushes.flushes == 200 + 20 + 2
    assert sync_counter.library <= (flushes.flushes + flushes.epoch_ends) * PER_FLUSH
    # every flush with steps in it copied its values once (the epoch-end flush right after the
    # last step's flush has nothing left to copy)
    assert sync_counter.library >= 200 + 20


def test_a_per_step_item_in_user_code_is_counted_as_the_users(sync_counter):
    _, quiet_flushes = run(num_epochs=1)
    library_alone = sync_counter.library
    assert library_alone > 0  # the wrappers see the library's own (flush) reads
    sync_counter.library = 0
    item = ItemEveryStep()
    _, flushes = run(extra_callbacks=[item], num_epochs=1)
    assert sync_counter.user == 200 == len(item.losses)
    assert sync_counter.library == library_alone
    assert flushes.flushes == quiet_flushes.flushes


class StepHostReads:
    """Counts the host reads of each optimizer step, C++ argument conversions included (a 0-dim
    tensor passed where a kernel takes a float), which the Python wrappers above cannot see."""

    def __init__(self, optimizer):
        from host_reads import HostReads

        self.per_step = []
        self._mode = None

        def before(opt, args, kwargs):
            self._mode = HostReads()
            self._mode.__enter__()

        def after(opt, args, kwargs):
            self._mode.__exit__(None, None, None)
            self.per_step.append(self._mode.reads)

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_a_fused_optimizer_steps_without_host_reads_in_the_compiled_engine(opt_cls):
    """``fused=True`` (the usual choice on GPUs) takes its hyperparameters from the groups the
    compiled engine holds: a tensor where the kernel wants a float would be read back every
    update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = opt_cls(model.parameters(), lr=0.01, fused=True)
    reads = StepHostReads(optimizer)
    trainer = Trainer(model, nn.MSELoss(), optimizer, engine="compiled", compile_options={"backend": "aot_eager"},
                      callbacks=())
    trainer.train(train_dataset=dataset(32, 0), num_epochs=1, per_device_batch_size=4,
                  create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=0),
                  train_dataloader_kwargs={"num_workers": 0})
    assert trainer._engine.active_engine == "compiled"
    assert reads.per_step == [0] * 8


FLUSH_READ_LINE = next(
    n for n, line in enumerate(open(os.path.join(LIBRARY_DIRS[0], "step_metrics.py")), 1)
    if "host = packed.tolist()" in line
)


def test_one_host_read_per_flush(sync_counter):
    """Each flush point (periodic, epoch end) reads the device once, in one packed copy; the
    epoch loss written to the run history is taken from the epoch-end flush, not read again."""
    trainer, flushes = run(num_epochs=1)
    # 200 updates: 4 periodic train flushes, the train epoch end (nothing left after update
    # 200's flush, so no read), the eval epoch end
    assert flushes.flushes == 6
    assert sync_counter.library == 5, sync_counter.where.most_common(5)
    assert set(sync_counter.where) == {("step_metrics.py", FLUSH_READ_LINE, "tolist")}
    assert trainer.run_history.get_latest_metric("train_loss_epoch") > 0


# ---------------------------------------------------------------- every host read says why
#: how often a host read may happen; "none" marks a call on a tensor already on the host
CADENCES = ("flush", "epoch-end", "save", "load", "setup", "fallback", "stop", "callback", "update", "step", "bench", "none")
SYNC_TAG = re.compile(r"#\s*SYNC\((?P<cadence>[a-z-]+)\):\s*\S")
#: Tensor methods that copy to the host, and the explicit device synchronisation
HOST_READS = ("item", "tolist", "cpu", "numpy", "synchronize")
REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _statements(path):
    """Each line's innermost enclosing statement as (first line, last line), and the file's lines."""
    source = Path(path).read_text()
    spans = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            for line in range(node.lineno, node.end_lineno + 1):
                old = spans.get(line)
                if old is None or (node.end_lineno - node.lineno) < (old[1] - old[0]):
                    spans[line] = (node.lineno, node.end_lineno)
    return spans, source.splitlines()


def sync_tag(path, line):
    """The cadence of the ``# SYNC(<cadence>): why`` comment that covers ``line``: on a line of its
    statement up to ``line``, or in the comment block right above the statement; None if none."""
    spans, lines = _statements(str(path))
    first, _ = spans.get(line, (line, line))
    candidates = lines[first - 1:line]
    above = first - 2
    while above >= 0 and lines[above].strip().startswith("#"):
        candidates.append(lines[above])
        above -= 1
    for text in candidates:
        match = SYNC_TAG.search(text)
        if match:
            return match.group("cadence")
    return None


def _host_reads():
    for root in ("fasttrain", "kernels"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in HOST_READS
                    and (not node.args or node.func.attr == "synchronize")  # synchronize(device) too
                ):
                    # the line of the method name, where a chained call puts it
                    yield path, node.func.end_lineno, node.func.attr


def test_every_host_read_in_the_library_carries_a_sync_tag():
    reads = list(_host_reads())
    assert len(reads) >= 20  # the scan sees the library's reads (flush, epoch end, saves, ...)
    untagged = [f"{p.relative_to(REPO)}:{line} .{name}()" for p, line, name in reads if sync_tag(p, line) is None]
    assert not untagged, "add a '# SYNC(<cadence>): why' comment to: " + ", ".join(untagged)
    unknown = {sync_tag(p, line) for p, line, _ in reads} - set(CADENCES)
    assert not unknown, f"cadences must be one of {CADENCES}; found {sorted(unknown)}"


def test_sync_tag_reads_the_statement_and_the_comment_block_above(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "x = 1\n"
        "# SYNC(flush): one packed copy\n"
        "# a second comment line\n"
        "y = (x\n"
        "     .tolist())\n"
        "z = x.item()  # SYNC(epoch-end): once per epoch\n"
        "w = x.item()\n"
    )
    assert sync_tag(path, 5) == "flush"  # the statement's comment block, from its second line
    assert sync_tag(path, 6) == "epoch-end"
    assert sync_tag(path, 7) is None  # a tag belongs to its own statement only

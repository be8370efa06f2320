"""torchmetrics Metrics called in a compiled step run outside its graphs.

A ``Metric`` keeps Python state that changes at every call (``_update_count``, its cached
values). Traced into a compiled ``training_step`` or ``validation_step``, each call is compiled
with that state as a guarded constant, so the step compiled again at every batch until dynamo's
recompile limit, and the rest of the run was eager; in a fresh process the first trace could fail
outright inside torchmetrics' own lazy checks of optional packages. Lightning users call metrics in
their steps as a rule (``self.train_acc(preds, y); self.log("train_acc", self.train_acc)``).

While a compiled or graphed engine runs a module's steps, each of its metrics' ``forward`` and
``update`` is wrapped in ``torch.compiler.disable``: the call is a graph break, the metric runs
eagerly on the step's tensors as under Lightning, and the rest of the step stays compiled, with no
recompilation. Those breaks are fasttrain's, so the steps are compiled with graph breaks from the
start (``fullgraph=False``, unless ``compile_options`` asks for ``fullgraph`` either way) rather
than traced whole first and warned about. The wrappers are instance attributes, removed when the
run ends, and the runner's compile options are put back.
"""

from __future__ import annotations

import contextlib

import torch

_WRAPPED = ("forward", "update")
_MISSING = object()


def _metrics_of(module) -> list:
    try:
        from torchmetrics import Metric
    except ImportError:  # no torchmetrics: no metric to wrap
        return []
    return [m for m in module.modules() if isinstance(m, Metric)]


@contextlib.contextmanager
def metric_calls_outside_graphs(module, runner):
    """For a run of ``module``'s steps by ``runner`` (nothing to do on the eager engine)."""
    metrics = [] if runner.engine_name == "eager" else _metrics_of(module)
    options = runner.compile_options
    if metrics and (options is None or "fullgraph" not in options):
        runner.compile_options = {**(options or {}), "fullgraph": False}
    saved = []
    for metric in metrics:
        own = {name: metric.__dict__.get(name, _MISSING) for name in _WRAPPED}
        saved.append((metric, own))
        for name in _WRAPPED:
            object.__setattr__(metric, name, torch.compiler.disable(getattr(metric, name)))
    try:
        yield
    finally:
        runner.compile_options = options
        for metric, own in saved:
            for name, value in own.items():
                if value is _MISSING:
                    metric.__dict__.pop(name, None)
                else:
                    object.__setattr__(metric, name, value)

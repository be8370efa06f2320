"""``on_before_backward`` and ``on_after_backward`` (the module's and the callbacks') under the
graphed engine.

Lightning runs them around the backward, inside the step a CUDA graph captures. A replay runs
the kernels they issued at the capture, never their Python: a branch on ``self.global_step``
(Lightning's own example logs gradient histograms every 25 steps this way), a scale read from
the epoch or a counter a callback sets would be replayed as the capture saw it, with no error.
So while the graphed engine runs, they are called through dynamo, traced whole: what their
Python reads becomes dynamo's guards, which the engine checks before each replay with those of
its other compiled functions (engine/step_guards.py), and a replay whose hooks would now take
another path is not made (the step is captured again, or, where that keeps happening, runs on
the compiled engine). Their ``self.log`` calls are recorded as a compiled step's are, and what
they change on the module or their callback refuses the capture (graph_logging.py). A hook
dynamo cannot trace whole (a graph break: ``.item()``, ``print``, a call dynamo does not
support) runs as written during the warm-up, and the capture is refused: the fit goes on
compiled, where these hooks run eagerly at every step. (Lightning's ``grad_norm``, which builds
its total on the host when run eagerly, traces whole.)
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from fasttrain.engine.capture_policy import CaptureRefused
from fasttrain.engine.compile_cache import with_own_dynamo_cache
from fasttrain.engine.compile_events import HOOKS_OF_COMPILED_CODE
from fasttrain.engine.compiled_functions import TRACE_ERRORS
from fasttrain.engine.compiled import describe_error
from fasttrain.engine.logging_calls import with_logger_calls_ignored
from fasttrain.engine.step_guards import compiled_variants


def _before_backward(hooks, loss):
    hooks("on_before_backward", loss)


def _after_backward(hooks):
    hooks("on_after_backward")


#: per hook: what is compiled for it, and the names of its arguments after ``hooks``
_BODIES = {"on_before_backward": (_before_backward, ("loss",)), "on_after_backward": (_after_backward, ())}
HOOKS_OF_COMPILED_CODE.update({body.__name__: name for name, (body, _) in _BODIES.items()})


class GraphedBackwardHooks:
    """What ``strategy.backward`` calls its hooks through in a fit on the graphed engine:
    ``on_before_backward`` / ``on_after_backward`` (the callbacks', then the module's, as the
    HookCaller calls them) compiled (``fullgraph=True``) while that engine runs the training
    steps, as written once it fell back.

    :param hooks: the run's HookCaller
    :param engine: the step engine (``active_engine`` says which one runs the steps now)
    :param compile_kwargs: ``torch.compile``'s arguments, those of the engine's own functions
    :param kept_apart: the step context's ``host_effects.kept_apart``: the ``self.log`` calls of
        a compiled hook go to a list of their own, empty at each call (as before each replay,
        when its guards are checked), so that they do not depend on how many the step made
    """

    def __init__(self, hooks, engine, compile_kwargs: dict, kept_apart):
        self.hooks = hooks
        self._engine = engine
        self._kept_apart = kept_apart
        self._compiled: Dict[str, Callable] = {}
        self._codes: Dict[str, object] = {}
        #: the arguments of each hook's last call (the frame the guards are checked against)
        self._arguments: Dict[str, tuple] = {}
        #: hooks dynamo could not trace whole, with why
        self._untraced: Dict[str, str] = {}
        for name, (body, _) in _BODIES.items():
            if hooks.overridden(name):
                own = with_own_dynamo_cache(body)
                self._compiled[name] = with_logger_calls_ignored(torch.compile(own, **compile_kwargs))
                self._codes[name] = own.__code__

    def __call__(self, name: str, *args):
        compiled = self._compiled.get(name)
        if compiled is None or name in self._untraced or self._engine.active_engine != "cudagraph":
            return self.hooks(name, *args)
        self._arguments[name] = args
        try:
            with self._kept_apart():
                return compiled(self.hooks, *args)
        except TRACE_ERRORS as error:
            # dynamo raised before running any of it (fullgraph): the hook runs as written, and
            # no step that runs it is captured (replay_calls)
            self._untraced[name] = describe_error(error)
            return self.hooks(name, *args)

    def replay_calls(self) -> List[Tuple[str, object, Callable[[], dict]]]:
        """Right after a capture: ``(hook, code, frame_locals)`` of each compiled hook it ran,
        for :class:`~fasttrain.engine.step_guards.ReplayGuards`. Raises :class:`CaptureRefused`
        where a hook ran uncompiled, whose Python no guard would check before a replay."""
        calls = []
        for name, code in self._codes.items():
            if name in self._untraced:
                raise CaptureRefused(
                    f"{name} (the module's or a callback's) does not trace into one graph "
                    f"({self._untraced[name]}): a CUDA graph replays the kernels of its capture, and only a "
                    "hook dynamo traces whole has its Python checked before each replay; without a host "
                    "read, print or other graph break there the fit keeps the graphs"
                )
            if len(compiled_variants(code)) >= torch._dynamo.config.recompile_limit:
                # past dynamo's limit a call runs uncompiled, and its variants' guards say nothing
                raise CaptureRefused(
                    f"{name} (the module's or a callback's) compiled once per value of a number it reads "
                    f"({torch._dynamo.config.recompile_limit} times)"
                )
            names = ("hooks", *_BODIES[name][1])
            values = dict(zip(names, (self.hooks, *self._arguments.get(name, ()))))
            calls.append((name, code, lambda values=values: values))
        return calls

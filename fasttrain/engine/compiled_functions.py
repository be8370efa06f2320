"""What the compiled engines compile, and with which settings.

Three functions are compiled, each with the hooks it calls inlined:

* the training forward: ``calculate_train_batch_loss`` and the 1/accumulation scaling of the
  loss (the context's ``loss_for_backward``). AOTAutograd compiles its backward at the same time, so
  ``backward_step``'s ``loss.backward()`` runs a compiled backward graph;
* the update: gradient clipping (the fused kernels, which are custom ops and trace) and
  ``optimizer_step``. The learning rate and Adam's betas are 0-dim tensors lent to the groups
  while it runs (:mod:`fasttrain.engine.hyperparams`), so a scheduler never causes a recompile;
* the evaluation forward: ``calculate_eval_batch_loss`` under ``no_grad``.

Each trainer (or what outlives it, ``StepContext.compile_owner``) keeps private copies of the
three, per :class:`CompileSettings`, so that trainers neither share dynamo's caches nor its
recompile limits, and a second ``train()`` with the same shapes compiles nothing.

The forward hooks are traced whole first (``fullgraph=True``); :meth:`_CompiledFunctions.allow_breaks`
compiles one with graph breaks allowed where its whole trace failed. Torch's optimizers break the
graph around ``step`` on purpose (to keep AOTAutograd's no-grad inference graph), so the update
is compiled with ``fullgraph=False``.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from fasttrain.engine import recompile_limit
from fasttrain.engine.compile_cache import with_own_dynamo_cache
from fasttrain.engine.context import StepContext
from fasttrain.engine.graph_report import CountingCall, HookGraphs
from fasttrain.engine.logging_calls import with_logger_calls_ignored
from fasttrain.engine.symbolic_ints import MAX_COPIES, ChangingValues, WithDynamicSources

COMPILE_OPTION_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options")


@dataclass(frozen=True)
class CompileSettings:
    """Validated ``Trainer(compile_options=...)``.

    ``fullgraph`` applies to the forward hooks (the optimizer update is always compiled with
    graph breaks allowed): None (not given) traces each whole and accepts graph breaks where it
    cannot (docs/engines.md, *Fallbacks*), True insists on one graph, False accepts breaks from
    the start. ``dynamic`` defaults to ``False`` so that shapes are static.
    """

    backend: object = "inductor"
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = False
    options: Optional[tuple] = None  # inductor options as sorted (key, value) items

    @classmethod
    def from_options(cls, options: Optional[dict]) -> "CompileSettings":
        options = dict(options or {})
        unknown = sorted(set(options) - set(COMPILE_OPTION_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown compile_options {unknown}; fasttrain passes only "
                f"{', '.join(COMPILE_OPTION_KEYS)} to torch.compile."
            )
        if options.get("mode") is not None and options.get("options") is not None:
            raise ValueError(
                "compile_options: give either 'mode' or 'options' (torch.compile refuses both)"
            )
        if "fullgraph" in options and not isinstance(options["fullgraph"], bool):
            raise ValueError(f"compile_options['fullgraph'] must be True or False, got {options['fullgraph']!r}")
        if options.get("dynamic") not in (None, True, False):
            raise ValueError(f"compile_options['dynamic'] must be True, False or None, got {options['dynamic']!r}")
        if options.get("options") is not None:
            # kept as sorted items so the settings hash (compiled functions are cached per value)
            options["options"] = tuple(sorted(dict(options["options"]).items()))
        return cls(**options)

    def kwargs(self, fullgraph: Optional[bool] = None) -> dict:
        kwargs = {
            "backend": self.backend,
            "fullgraph": self.fullgraph is not False if fullgraph is None else fullgraph,
            "dynamic": self.dynamic,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs


#: inductor modes whose only or partial effect is inductor's own CUDA graphs, and the variant that
#: keeps the rest of the mode without them
_WITHOUT_INDUCTOR_GRAPHS = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def _asks_for_inductor_graphs(settings: CompileSettings) -> bool:
    return settings.mode in _WITHOUT_INDUCTOR_GRAPHS or bool(dict(settings.options or ()).get("triton.cudagraphs"))


def settings_for_engine(settings: CompileSettings, engine_name: str) -> CompileSettings:
    """The settings an engine compiles with: never with inductor's own CUDA graphs.

    Inductor's graphs (``mode="reduce-overhead"``, ``"max-autotune"``, option
    ``triton.cudagraphs``) write each call's outputs into memory the next call overwrites, while
    fasttrain keeps per-step losses and norms on the device until the flush; and inside the
    graphed engine's capture they would be a graph inside a graph. So "max-autotune" becomes
    "max-autotune-no-cudagraphs" (the autotuning is kept) everywhere, and "reduce-overhead",
    whose whole effect is inductor's graphs, is what ``engine="cudagraph"`` does for the whole
    step: the graphed engine (and ``"auto"``, which may pick it) compile without it, and
    ``engine="compiled"`` refuses it (raised at ``Trainer`` construction).
    """
    if not _asks_for_inductor_graphs(settings):
        return settings
    if engine_name == "compiled" and (settings.mode == "reduce-overhead" or settings.options is not None):
        raise ValueError(
            "compile_options asks for inductor's CUDA graphs (mode='reduce-overhead' or "
            "options={'triton.cudagraphs': True}), whose outputs are overwritten by the next call "
            "while fasttrain still holds them until the flush. Use engine='cudagraph' (or 'auto'), "
            "which captures the whole step in CUDA graphs itself, or drop the option."
        )
    mode = _WITHOUT_INDUCTOR_GRAPHS.get(settings.mode, settings.mode)
    options = settings.options
    if options is not None:
        options = tuple(sorted({**dict(options), "triton.cudagraphs": False}.items()))
    return dataclasses.replace(settings, mode=mode, options=options)


# ---------------------------------------------------------------------------- compiled bodies
def _train_forward(ctx: StepContext, batch):
    batch_output = ctx.trainer.calculate_train_batch_loss(batch)
    return batch_output, ctx.loss_for_backward(batch_output)


def _update(ctx: StepContext):
    """The update's hooks: what the compiled update compiles, and what the compiled engine calls
    as it is where compiling would gain nothing (a fused optimizer: CompiledEngine)."""
    norm = ctx.clip()
    ctx.trainer.optimizer_step()
    return norm


def _eval_forward(ctx: StepContext, batch):
    with torch.no_grad():
        return ctx.trainer.calculate_eval_batch_loss(batch)


TRAIN_HOOK = "calculate_train_batch_loss"
EVAL_HOOK = "calculate_eval_batch_loss"
UPDATE = "optimizer_step"
_FORWARD_BODIES = {TRAIN_HOOK: _train_forward, EVAL_HOOK: _eval_forward}
#: what dynamo raises under fullgraph=True where it would break the graph (an unsupported call,
#: data-dependent control flow): compiling with breaks can still take the hook
TRACE_ERRORS = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                 torch._dynamo.exc.UncapturedHigherOrderOpError)


class _CompiledFunctions:
    """The three compiled callables of one trainer, kept across ``train()`` calls so that a
    second run with the same shapes reuses the graphs of the first.

    Each forward hook is first compiled whole (unless ``fullgraph=False``); :meth:`allow_breaks`
    replaces it with a compile that accepts graph breaks, where the whole trace failed."""

    def __init__(self, settings: CompileSettings):
        self.settings = settings
        whole = settings.fullgraph is not False
        #: the code object each compiled function runs from, by hook (``UPDATE`` for the update),
        #: whose dynamo cache holds its compiled variants (step_guards.py)
        self.codes: Dict[str, types.CodeType] = {}
        self._forwards = {hook: self._compile_forward(hook, whole) for hook in _FORWARD_BODIES}
        self._whole = dict.fromkeys(_FORWARD_BODIES, whole)
        self.update, self.codes[UPDATE] = self._new_update()
        #: the optimizer the update is compiled for (update_for), weakly
        self._update_optimizer: Optional[weakref.ref] = None
        #: per hook, the copy the compiled engine calls with the numbers that keep changing
        #: symbolic, and what it watches for them (symbolic_ints.py)
        self._symbolic: Dict[str, WithDynamicSources] = {}
        self._changing: Dict[str, ChangingValues] = {}
        self._no_symbolic: set = set()
        self._copies = 0

    def _compile_forward(self, hook: str, whole: bool) -> CountingCall:
        forward, self.codes[hook] = self._new_forward(hook, whole)
        return forward

    def update_for(self, optimizer) -> None:
        """At an engine's set-up, the optimizer its update steps. With isolated recompiles
        (recompile_limit.py) each optimizer gets an update of its own: the frames of torch's
        optimizer step, compiled anew for every optimizer object, count against that update's
        recompile limit only. (A LightningModule keeps its compiled functions across fits and
        ``configure_optimizers`` makes a new optimizer for each: its ninth fit met the limit and
        ran eagerly.)"""
        if not recompile_limit.ISOLATES or optimizer is None:
            return
        known = self._update_optimizer
        if known is not None and known() is not optimizer:
            self.update, self.codes[UPDATE] = self._new_update()
        self._update_optimizer = weakref.ref(optimizer)

    def _new_update(self) -> Tuple[Callable, types.CodeType]:
        body = with_own_dynamo_cache(_update)
        compiled = torch.compile(body, **self.settings.kwargs(fullgraph=False), **recompile_limit.update_compile_kwargs())
        return with_logger_calls_ignored(compiled), body.__code__

    def _new_forward(self, hook: str, whole: bool, dynamic: bool = False) -> Tuple[CountingCall, types.CodeType]:
        body = with_own_dynamo_cache(_FORWARD_BODIES[hook])
        kwargs = self.settings.kwargs(fullgraph=whole)
        if dynamic and kwargs["dynamic"] is False:
            # dynamo's only way to a symbolic float, or to a number of a frame it compiles on its
            # own inside the call (symbolic_ints.py)
            kwargs["dynamic"] = None
        # a logger call in a hook (transformers' models make them) is no graph break
        compiled = torch.compile(body, **kwargs)
        return CountingCall(with_logger_calls_ignored(compiled)), body.__code__

    def function(self, hook: str, symbolic_ints: bool) -> Callable:
        """What an engine calls for ``hook`` (``UPDATE`` for the update): with ``symbolic_ints``,
        the forward's copy that takes the integers that keep changing as symbolic values, once
        there is one."""
        if symbolic_ints:
            copy = self._symbolic.get(hook)
            if copy is not None:
                return copy
        return self.update if hook == UPDATE else self._forwards[hook]

    def before_call(self, hook: str) -> None:
        """Before a forward's call by an engine that takes symbolic values (see :meth:`note_call`)."""
        if hook == UPDATE or hook in self._no_symbolic:
            return
        changing = self._changing.get(hook)
        if changing is None:
            self._changing[hook] = ChangingValues(self.codes[hook])
        else:
            changing.before_call()

    def note_call(self, hook: str) -> None:
        """After a forward's call by an engine that takes symbolic values: where a number (an
        integer or a float, read by the hook's code or by a frame dynamo compiled on its own
        inside the call) failed its guard a second time, later calls run a fresh copy compiled
        with it (and those before it) symbolic. (The update's hooks, which run once per update,
        keep their constants.)"""
        changing = self._changing.get(hook)
        if changing is None or hook in self._no_symbolic:
            return
        sources = changing.newly_changing()
        if changing.specialized_again:
            self.drop_symbolic(hook)  # a copy that compiles once per value too is no gain
            return
        if sources is None or self._copies >= MAX_COPIES:
            return
        self._copies += 1
        compiled, code = self._new_forward(hook, self._whole[hook], dynamic=changing.dynamic)
        ints = [source for source in sources if source not in changing.floats] + sorted(changing.nested_ints)
        self._symbolic[hook] = WithDynamicSources(compiled, ",".join(ints))
        self._changing[hook] = ChangingValues(code, carried=changing)

    def drop_symbolic(self, hook: str) -> bool:
        """After a call of ``hook`` failed before it ran (its compile), or after the copy with
        symbolic values specialized one of them again: where there is that copy, drop it for good
        (a backend may not take an operation on them, such as a modulo) and say so; the hook goes
        on with its constants."""
        if self._symbolic.pop(hook, None) is None:
            return False
        self._changing.pop(hook, None)
        self._no_symbolic.add(hook)
        return True

    @property
    def train_forward(self) -> CountingCall:
        return self._forwards[TRAIN_HOOK]

    @property
    def eval_forward(self) -> CountingCall:
        return self._forwards[EVAL_HOOK]

    def may_break(self, hook: str, error: BaseException) -> bool:
        """Whether ``hook``, which failed with ``error``, goes on compiled with graph breaks: it
        was traced whole because ``fullgraph`` was not given, and the trace met a graph break."""
        return self.settings.fullgraph is None and self._whole[hook] and isinstance(error, TRACE_ERRORS)

    def allow_breaks(self, hook: str) -> None:
        self._forwards[hook] = self._compile_forward(hook, whole=False)
        self._whole[hook] = False
        self._symbolic.pop(hook, None)  # a copy traced whole: made again, with breaks, if needed
        self._changing.pop(hook, None)

    def is_whole(self, hook: str) -> bool:
        return self._whole[hook]

    def report(self, hook: str) -> Optional[HookGraphs]:
        return self._forwards[hook].report


_FUNCTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_functions(owner, settings: CompileSettings) -> _CompiledFunctions:
    """The compiled functions of ``owner`` (the trainer, or what outlives it: see
    ``StepContext.compile_owner``) for ``settings``, made on first use."""
    per_trainer: Dict[CompileSettings, _CompiledFunctions] = _FUNCTIONS.setdefault(owner, {})
    key = settings
    try:
        hash(key)
    except TypeError:  # options dict or a callable backend without a hash: no reuse
        return _CompiledFunctions(settings)
    if key not in per_trainer:
        per_trainer[key] = _CompiledFunctions(settings)
    return per_trainer[key]

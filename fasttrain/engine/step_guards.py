"""Whether a captured step's Python would still run the compiled code it was captured with:
dynamo's own guards, checked on the host before each replay.

Dynamo compiles a hook that reads a Python value (the batch index, Lightning's ``current_epoch``
or ``global_step``, an attribute a callback sets) with that value as a constant, behind a guard,
and keeps one compiled variant per value seen. A CUDA graph replays the kernels of the variant
its capture ran, without running the Python that would choose one. When the warm-up compiled the
variants of every value before the capture (the batch index over a whole first epoch, say), no
compile marks the capture as stale (compile_events.py) and the replays would train with the
captured value for good, with no error.

So the graphed engine keeps, for each compiled function a capture ran, the guards of the variant
it ran (dynamo moves the entry a call runs to the front of the function's cache, so right after
the capture it is the first one), and checks them before each replay against the values the call
would get now: the step context and the static batch the graph reads. Where they fail, the call
would run another variant (or compile one), and the step is not replayed. A check costs what
dynamo's own guard check costs on every call of a compiled function (microseconds, on the host,
no device read); ``torch.compile(mode="reduce-overhead")`` pays the same per call.

The guards of a compiled function cover its frame and what it inlines. A hook compiled with
graph breaks runs the code after each break in frames of their own (dynamo's resume functions),
and a compiled region (``compile_regions``) or a function called from the eager code between
two pieces is compiled as a frame of its own: a value read only there (an attribute a callback
sets, read after a break) is guarded in that frame alone. So a capture also records every
compiled frame it runs (:class:`FramesRun`): the variant dynamo chose for it and the arguments
it got: a tensor the step freed (an activation in the graphs' pool) as a stand-in with its
metadata and no memory, others as themselves. Before each replay their guards are checked
against those arguments, in the grad mode and autocast state each frame ran in: the objects the
step reads (the trainer, its model, a callback, the optimizer) are the same, and what the
guards read from them is read now; a freed tensor's guards (shape, dtype, device) are decided
by the frames before it, whose guards are checked too. A step with no graph break has no such
frame but torch's optimizers, which break the graph around their ``step`` on purpose: two
frames per update, a few microseconds of guard checks on the host before each replay.
"""

from __future__ import annotations

import dis
import inspect
import os
import sys
import types
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

try:  # dynamo's view of a code object's cache of compiled variants (torch >= 2.1)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as _cache_entries
except ImportError:  # pragma: no cover - a torch without it: replays rely on the capture's compile check
    _cache_entries = None


def compiled_variants(code: types.CodeType) -> list:
    """The compiled variants dynamo keeps for ``code``, the one its last call ran first; empty
    where it keeps none (nothing compiled yet, or a torch that does not show its cache)."""
    return _cache_entries(code) if _cache_entries is not None else []


def variant_in_use(code: types.CodeType):
    """The guards of the compiled variant of ``code`` that its last call ran, or None where dynamo
    keeps none."""
    entries = compiled_variants(code)
    if not entries:
        return None
    return getattr(entries[0], "guard_manager", None)


class ReplayGuards:
    """The guards of the variants one capture ran, with the arguments each call gets.

    :param checks: ``(name, guards, frame_locals)`` per compiled function the capture ran, where
        ``frame_locals()`` gives the function's arguments by name, as the replay's call would get
        them, and ``name`` is the hook it compiles (for the warning).
    :param inner: the other compiled frames the capture ran, grouped by the grad mode and
        autocast state they ran in: ``(ambient, [(name, guards, arguments)])``, ``arguments()``
        those of the frame's recorded call (:class:`FramesRun`)

    :meth:`failure` runs before every replay, so what it loops over is laid out for it here:
    dynamo's own check of each variant (the guard tree's, without the Python method around it)
    beside the values it is called with, and the inner frames flat, each with its grad mode and
    autocast state.
    """

    __slots__ = ("_checks", "_inner", "_calls", "_frames")

    def __init__(self, checks: List[Tuple[str, object, Callable[[], dict]]], inner: Sequence[tuple] = ()):
        self._checks = checks
        self._inner = inner
        self._calls = tuple((_checker(guards), frame_locals) for _, guards, frame_locals in checks)
        self._frames = tuple(
            (ambient, _checker(guards), arguments) for ambient, group in inner for _, guards, arguments in group
        )

    @classmethod
    def taken(
        cls, calls: List[Tuple[str, types.CodeType, Callable[[], dict]]], frames: Optional["FramesRun"] = None
    ) -> "ReplayGuards":
        """Right after a capture: the guards of the variant each of ``calls`` (``(name, code,
        frame_locals)``) ran, and those of the other compiled frames the capture ran
        (``frames``: graph breaks' resume functions, compiled regions)."""
        checks = []
        for name, code, frame_locals in calls:
            guards = variant_in_use(code)
            if guards is not None:
                checks.append((name, guards, frame_locals))
        inner: Dict[tuple, list] = {}
        if frames is not None:
            checked = {code for _, code, _ in calls}
            for name, code, guards, arguments, ambient in frames.calls:
                if code not in checked:
                    inner.setdefault(ambient, []).append((name, guards, _arguments(arguments)))
        return cls(checks, tuple(inner.items()))

    def failure(self) -> Optional[Tuple[str, str]]:
        """``(hook, guard)`` for the first guard that fails now, or None when every compiled
        function would run the variant the graph was captured from. Host only."""
        for check, frame_locals in self._calls:
            if not check(frame_locals()):
                return self._first_failure()
        if not self._frames:
            return None
        # each inner frame in the grad mode and autocast state it ran in, the host's put back
        switch = _AmbientSwitch()
        try:
            for ambient, check, arguments in self._frames:
                switch.enter(ambient)
                if not check(arguments()):
                    break
            else:
                return None
        finally:
            switch.leave()
        return self._first_failure()

    def _first_failure(self) -> Optional[Tuple[str, str]]:
        # the slow way, once a check failed: which guard, in dynamo's words
        for name, guards, frame_locals in self._checks:
            failed = _failed(name, guards, frame_locals())
            if failed is not None:
                return failed
        switch = _AmbientSwitch()
        try:
            for ambient, group in self._inner:
                switch.enter(ambient)
                for name, guards, arguments in group:
                    failed = _failed(name, guards, arguments())
                    if failed is not None:
                        return failed
            return None
        finally:
            switch.leave()


def _checker(guards) -> Callable[[dict], bool]:
    """The check of a variant's guards: the guard tree's own (``GuardManagerWrapper.check`` is a
    Python method around it), or the wrapper's where a torch keeps no tree."""
    root = getattr(guards, "root", None)
    check = getattr(root, "check", None)
    return check if callable(check) else guards.check


def _failed(name: str, guards, values: dict) -> Optional[Tuple[str, str]]:
    if guards.check(values):
        return None
    parts = guards.check_verbose(values).verbose_code_parts
    return name, " ".join(str(parts[0]).split()) if parts else "a guard"


def unverifiable_reason(guard: str) -> str:
    """Why a capture whose guards fail right after it (nothing outside the step ran yet) is not
    kept: a frame of the step reads state the step itself sets and clears, which a check
    between steps cannot see as the frame did."""
    return (
        "a compiled frame of the step reads state that the step itself sets and clears (dynamo's guard "
        f"that fails between steps: {guard[:300]}): checked before each replay it would fail every time, "
        "so a replay could not be told apart from a stale one. Keep such state in local variables or "
        "arguments, or train with engine='compiled'"
    )


def changed_value_reason(guard: str) -> str:
    """What changed when a graph's guards fail, for a warning."""
    return f"a Python value the step's hooks read changed (dynamo's guard that fails now: {guard[:300]})"


class FramesRun:
    """The compiled frames a step runs (:meth:`run`): per call, ``(hook, code, guards,
    arguments, ambient)``, ``code`` the function dynamo compiled (a resume function after a
    graph break is one of its own), ``guards`` those of the variant dynamo chose for the call,
    ``arguments`` what the call got, its tensors recorded (:func:`_recorded`), and
    ``ambient`` the grad mode and autocast state it ran in (:func:`_ambient`).

    :param hook: gives the hook the step is running (named in the warning when a guard fails)
    """

    def __init__(self, hook: Callable[[], Optional[str]]):
        self._hook = hook
        self._ran = False
        self.calls: List[Tuple[Optional[str], types.CodeType, object, dict, tuple]] = []
        #: ``(hook, code)`` of the first frame of the user's code that ran uncompiled, or None
        self.uncompiled: Optional[Tuple[Optional[str], types.CodeType]] = None

    def uncompiled_reason(self) -> Optional[str]:
        """Why the capture cannot be replayed where the user's code ran uncompiled in the step (a
        function dynamo runs as written: a graph break inside a loop, a frame it skips), whose
        Python no guard checks before a replay; None where none did."""
        if self.uncompiled is None:
            return None
        code = self.uncompiled[1]
        return (
            f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno}) runs "
            "uncompiled inside the captured step (dynamo runs a function as written where it cannot resume "
            "after a graph break, inside a loop, or skips it): a CUDA graph replays the kernels of its "
            "capture, and a value or branch its Python reads (a flag a callback sets, Python random numbers "
            "such as a layer drop) would stay as at the capture. Remove the graph break (TORCH_LOGS=graph_breaks "
            "shows it; compile_regions makes one at each block), or train with engine='compiled'"
        )

    def run(self, body: Callable[[], object]):
        """``body()``, recording the compiled frames it runs (a profile function, chained to
        one already set; under a profiler that is no Python callable, nothing is recorded)."""
        previous = sys.getprofile()
        if self._ran or _compiled_from is None or (previous is not None and not callable(previous)):
            return body()
        self._ran = True  # the capture's frames; a host stand-in's replays run the body again

        def note(frame, event, arg):
            if event == "call":
                code = _compiled_from.get(frame.f_code)
                if code is not None:
                    self._note(code, frame)
                elif self.uncompiled is None and _users_code(frame.f_code) and not _reads_nothing(frame.f_code):
                    self.uncompiled = (self._hook(), frame.f_code)
            if previous is not None:
                previous(frame, event, arg)

        sys.setprofile(note)
        try:
            return body()
        finally:
            sys.setprofile(previous)

    @torch._dynamo.disable  # what it calls is not the step's to compile
    def _note(self, code: types.CodeType, frame) -> None:
        # the variant dynamo runs this call with is the one whose compiled code the frame runs
        for entry in compiled_variants(code):
            if entry.code is frame.f_code:
                guards = getattr(entry, "guard_manager", None)
                if guards is not None:
                    # one call's arguments are alive together: ids and storages name one object
                    memo: Dict[object, object] = {}
                    with torch._C._DisableTorchDispatch():  # host metadata, no operation of the step's
                        arguments = {name: _recorded(value, memo) for name, value in frame.f_locals.items()}
                    self.calls.append((self._hook(), code, guards, arguments, _ambient()))
                return


def _library_roots() -> Tuple[str, ...]:
    """Where the code a step runs uncompiled by design lives: Python's own, torch's (and the
    modules Inductor generates), fasttrain's (its kernels' too) and that of the libraries
    fasttrain runs the step through."""
    import sysconfig

    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    try:  # the Python modules Inductor generates for compiled graphs (their ``call`` runs each step)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        roots.add(cache_dir())
    except (ImportError, OSError):  # pragma: no cover - a torch without it
        pass
    for name in ("torch", "fasttrain", "fasttrain.kernels", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "triton"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(os.path.dirname(module.__file__))
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


_LIBRARY_ROOTS: Optional[Tuple[str, ...]] = None
#: code objects already classified, by the answer
_USERS: Dict[types.CodeType, bool] = {}


def run_by_design(*functions: Callable) -> None:
    """Marks ``functions`` as code that may run uncompiled inside a captured step, as torch's and
    fasttrain's own does: a tool of the step's (a dispatch mode that records it), not the
    user's model code whose Python a replay would freeze (:meth:`FramesRun.uncompiled_reason`)."""
    codes = [inspect.unwrap(function).__code__ for function in functions]  # torch wraps __torch_dispatch__
    while codes:
        code = codes.pop()
        _USERS[code] = False
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]  # its generators


def _users_code(code: types.CodeType) -> bool:
    """Whether ``code`` is the user's (a model's forward, a helper of theirs), as opposed to
    Python's, torch's, fasttrain's or generated code (an FX graph's, ``<...>``)."""
    known = _USERS.get(code)
    if known is not None:
        return known
    global _LIBRARY_ROOTS
    if _LIBRARY_ROOTS is None:
        _LIBRARY_ROOTS = _library_roots()
    filename = code.co_filename
    users = not filename.startswith("<") and not os.path.realpath(filename).startswith(_LIBRARY_ROOTS)
    _USERS[code] = users
    return users


#: what a function may run and still read nothing but its arguments and constants: no attribute,
#: global, call, subscript or branch (Python 3.11 and 3.12 opcode names)
_READS_NOTHING = frozenset({
    "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "LOAD_CONST", "LOAD_FAST", "LOAD_FAST_CHECK",
    "LOAD_FAST_AND_CLEAR", "STORE_FAST", "DELETE_FAST", "POP_TOP", "COPY", "SWAP", "BUILD_TUPLE",
    "JUMP_FORWARD", "RETURN_VALUE", "RETURN_CONST",
})
_READS: Dict[types.CodeType, bool] = {}


def _reads_nothing(code: types.CodeType) -> bool:
    """Whether a function, run from its start, only moves its arguments and constants to its
    return (following its forward jumps): then nothing a replay would freeze is read there. Such
    frames run uncompiled by design: dynamo skips a function it traced no operation in, such as
    what is left of a hook after its last graph break (``return None``)."""
    known = _READS.get(code)
    if known is not None:
        return known
    listed = list(dis.get_instructions(code))
    at = {instruction.offset: index for index, instruction in enumerate(listed)}
    index, result = 0, False
    while index < len(listed):
        instruction = listed[index]
        if instruction.opname not in _READS_NOTHING:
            break
        if instruction.opname in ("RETURN_VALUE", "RETURN_CONST"):
            result = True
            break
        # forward only: no loop
        index = at.get(instruction.argval, len(listed)) if instruction.opname == "JUMP_FORWARD" else index + 1
    _READS[code] = result
    return result


try:  # the code object each compiled variant was made from (dynamo's own map)
    from torch._dynamo.utils import orig_code_map as _compiled_from
except ImportError:  # pragma: no cover - a torch without it: only the hooks' own frames are checked
    _compiled_from = None


class _Recorded:
    """A plain tensor argument of a recorded call: the tensor, weakly, and what a guard reads of
    it (:class:`_StandIn`), for when the step freed it."""

    __slots__ = ("tensor", "stand_in")

    def __init__(self, tensor: torch.Tensor, stand_in: "_StandIn"):
        self.tensor = weakref.ref(tensor)
        self.stand_in = stand_in


class _StandIn:
    """What dynamo's guards read of a tensor the step freed: dtype, device, shape, strides,
    storage offset, ``requires_grad``, and its storage (by the record's count, with its size).
    :meth:`tensor` makes one for a check: on a storage that owns no memory (data pointer 0, never
    read), made for the check and dropped after it, so that no tensor without data outlives it."""

    __slots__ = ("dtype", "device", "size", "stride", "offset", "requires_grad", "storage", "nbytes")

    def __init__(self, tensor: torch.Tensor, storage: int):
        self.dtype, self.device, self.requires_grad = tensor.dtype, tensor.device, tensor.requires_grad
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()
        self.storage, self.nbytes = storage, tensor.untyped_storage().nbytes()

    def tensor(self, made: dict) -> torch.Tensor:
        """The stand-in tensor; ``made``: those made for one check, and their storages (one
        stand-in met twice is one tensor)."""
        tensor = made.get(self)
        if tensor is not None:
            return tensor
        storage = made.get(self.storage)
        if storage is None:
            storage = made[self.storage] = _own_no_memory(0, self.device, self.nbytes)
        tensor = made[self] = torch.empty(0, dtype=self.dtype, device=self.device)
        tensor.set_(storage, self.offset, self.size, self.stride)
        return tensor.requires_grad_(self.requires_grad)


def _plain_map(value, leaf: Callable):
    """``value`` with ``leaf`` applied to everything but the plain lists, tuples and dicts in it,
    which are rebuilt around their items (a recorded call's arguments, as dynamo guards them)."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_plain_map(item, leaf) for item in value)
    if kind is dict:
        return {key: _plain_map(item, leaf) for key, item in value.items()}
    return leaf(value)


def _recorded(value, memo: dict):
    """``value``, an argument of a call a capture ran, with each plain tensor in it recorded
    (:class:`_Recorded`). Within one ``memo`` (one call's arguments, all alive) one tensor met
    twice is one record and tensors that share a storage have stand-ins that share one, so that
    dynamo's aliasing guards see what the call saw. Anything else is kept as it is (parameters,
    the trainer)."""

    def record(item):
        if type(item) is not torch.Tensor:
            return item
        kept = memo.get(id(item))
        if kept is None:
            stand_in = _stand_in(item, memo)
            # a tensor no stand-in can take the place of is kept with the record
            kept = memo[id(item)] = _Recorded(item, stand_in) if stand_in is not None else item
        return kept

    return _plain_map(value, record)


def _stand_in(tensor: torch.Tensor, memo: dict) -> Optional[_StandIn]:
    # None: a tensor no stand-in can take the place of (sparse, quantized, nested, one set_ refuses)
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested or _own_no_memory is None:
        return None
    storages = memo.setdefault("storages", {})
    key = tensor.untyped_storage()._cdata
    stand_in = _StandIn(tensor, storages.setdefault(key, len(storages)))
    try:
        stand_in.tensor({})  # made once here: a check must not meet an error of its own
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return stand_in


def _arguments(recorded: dict) -> Callable[[], dict]:
    """The arguments of a recorded call for each check, once the capture ended: a tensor still
    alive (a parameter, its gradient, the optimizer's state, the static batch, an output the
    graph keeps: held elsewhere anyway) as itself, since dynamo guards some by identity; one the
    step freed (an activation in the graphs' pool) as a tensor its :class:`_StandIn` makes for
    the check."""
    stand_ins = []

    def resolved(item):
        if type(item) is not _Recorded:
            return item
        tensor = item.tensor()
        if tensor is not None:
            return tensor
        stand_ins.append(item.stand_in)
        return item.stand_in

    arguments = _plain_map(recorded, resolved)
    if not stand_ins:
        return lambda: arguments

    def with_tensors():
        made = {}  # this check's tensors and their storages
        return _plain_map(arguments, lambda item: item.tensor(made) if type(item) is _StandIn else item)

    return with_tensors


_set_grad_enabled = torch._C._set_grad_enabled

#: a storage of a size at a data pointer it does not own (here 0: nothing is read)
_own_no_memory = getattr(torch._C, "_construct_storage_from_data_pointer", None)


#: the devices whose autocast state a frame inside the step may run under (the one the step's
#: mixed precision enters, or the CPU's)
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _ambient() -> tuple:
    """The state a frame's guards read besides its arguments that the step itself changes from
    one frame to the next: ``(grad mode, autocasting, autocast state)``, grad mode for
    ``no_grad`` in an optimizer step or an evaluation, autocast for mixed precision's forward.
    The rest of dynamo's global-state guard is checked by the hooks' own frames at the step's
    start."""
    autocast = (
        torch.is_autocast_cache_enabled(),
        tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
    )
    return torch.is_grad_enabled(), torch._C._is_any_autocast_enabled(), autocast


def _set_autocast(state: tuple) -> None:
    cache, devices = state
    torch.set_autocast_cache_enabled(cache)
    for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, devices):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)


class _AmbientSwitch:
    """Enters the ambient states of the frames' groups in turn and leaves the host's as it was.
    Between replays no device autocasts, as where a frame ran outside mixed precision's
    forward: then only the grad mode is set (the autocast settings are those the hooks' own
    frames checked)."""

    __slots__ = ("_grad", "_grad_now", "_autocast", "_autocast_now")

    def __init__(self):
        self._grad = self._grad_now = torch.is_grad_enabled()
        #: the host's autocast state, read where a group needs another one; None: untouched
        self._autocast = None
        self._autocast_now = None

    def enter(self, ambient: tuple) -> None:
        grad, autocasting, autocast = ambient
        if grad != self._grad_now:
            _set_grad_enabled(grad)  # torch.set_grad_enabled's own call, without its context object
            self._grad_now = grad
        if self._autocast is None:
            if not autocasting and not torch._C._is_any_autocast_enabled():
                return
            self._autocast = self._autocast_now = _ambient()[2]
        if autocast != self._autocast_now:
            _set_autocast(autocast)
            self._autocast_now = autocast

    def leave(self) -> None:
        if self._grad_now != self._grad:
            _set_grad_enabled(self._grad)
        if self._autocast is not None and self._autocast_now != self._autocast:
            _set_autocast(self._autocast)

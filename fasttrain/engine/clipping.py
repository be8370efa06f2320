"""Gradient clipping, once per optimizer update, without host synchronisation.

On CUDA the fused kernels of :mod:`fasttrain.kernels` do the work in a constant number of
launches; elsewhere their PyTorch reference runs. Both return the total norm as a device tensor
and never read it on the host.

Sharded gradients (FSDP2's DTensors) are clipped on each process's local shards: the kernels
measure the local sum of squares, one all-reduce over the shard group adds the sums (and the
non-finite flags) of all processes, and the same scale is applied locally everywhere
(:class:`ShardedGradients`). The norm is the one of the whole, unsharded gradient.

Gradients that share one storage (FSDP2's shards, views of one reduce-scatter output; DDP's
``gradient_as_bucket_view``; a flat gradient buffer) are clipped outside compiled graphs
(:meth:`GradientClipper.note_gradient_layout`). Inductor does not let one call of a mutating
custom op (the clipping kernels) update several views of one storage in place: for every view
after the first it clones the whole storage, runs the kernel on the clone and copies the view
back. torch 2.11's inductor reads that clone from the view's own data pointer instead of the
storage's start (the view's storage offset counted twice), so what is copied back is other
memory: wrong weights, with no error. torch 2.13 copies correctly, but still copies the whole
storage per view and update; run eagerly, the kernels clip in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


def gradients_of(parameters) -> List[torch.Tensor]:
    """The gradient tensors of ``parameters`` that exist."""
    return [p.grad for p in parameters if p.grad is not None]


def flag_on_device_of(parameters) -> Optional[torch.Tensor]:
    """A zeroed one-element float32 flag on the device of the first of ``parameters`` (None when
    there are none), the form the clipping kernels raise as ``found_inf``."""
    for p in parameters:
        return torch.zeros(1, dtype=torch.float32, device=p.device)
    return None


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


@torch.compiler.disable
def _outside_graphs(fn, *args):
    # a graph break: dynamo runs ``fn`` eagerly on the real tensors and resumes tracing after it
    return fn(*args)


def _local(grad: torch.Tensor) -> torch.Tensor:
    # this process's shard (or replica) of a DTensor gradient: a view of its storage, so that
    # the kernels' in-place scaling lands in the DTensor
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


@dataclass(frozen=True)
class ShardedGradients:
    """Where the gradients of a set of parameters live when some are sharded (DTensors).

    Decided once, from the parameters (a gradient has its parameter's layout): ``sharded`` are
    the parameters sharded over one dimension of their device mesh, whose process group
    (``group_name``, ``group_size`` processes) is the one the sums are added over; ``replicated``
    are the others (plain tensors such as parameters FSDP was told to ignore, and DTensors
    replicated on every dimension), whose full value every process of the group holds.
    Over HSDP's 2-D mesh the gradients are replicated along the other dimension, which the sums
    therefore leave out (adding there would count every shard once per replica).
    """

    sharded: Tuple[torch.nn.Parameter, ...]
    replicated: Tuple[torch.nn.Parameter, ...]
    group_name: str
    group_size: int
    group: Optional[object] = None  # the ProcessGroup named group_name

    @staticmethod
    def of(parameters) -> Optional["ShardedGradients"]:
        """The layout of ``parameters``, or None when none of them is sharded. Raises a
        ``ValueError`` saying what is supported for layouts one all-reduce cannot serve."""
        DTensor = _dtensor_type()
        parameters = list(parameters)
        if DTensor is None or not any(isinstance(p, DTensor) for p in parameters):
            return None
        sharded, replicated, groups = [], [], {}
        for p in parameters:
            if not isinstance(p, DTensor):
                replicated.append(p)
                continue
            if any(placement.is_partial() for placement in p.placements):
                raise ValueError(
                    f"gradient clipping: a parameter has placements {p.placements}, with a pending "
                    "(Partial) reduction; clip gradients that are sharded or replicated (FSDP2)"
                )
            dims = [i for i, placement in enumerate(p.placements) if placement.is_shard()]
            if not dims:
                replicated.append(p)
                continue
            if len(dims) > 1:
                raise ValueError(
                    f"gradient clipping: a parameter is sharded over {len(dims)} mesh dimensions "
                    f"({p.placements} on {p.device_mesh}); fasttrain clips gradients sharded over one "
                    "dimension (FSDP2's fully_shard, HSDP), with one all-reduce over that dimension"
                )
            group = p.device_mesh.get_group(dims[0])
            groups.setdefault(group.group_name, (group, p.device_mesh.size(dims[0])))
            sharded.append(p)
        if len(groups) > 1:
            raise ValueError(
                "gradient clipping: the parameters are sharded over different process groups "
                f"({sorted(groups)}); fasttrain clips gradients sharded over one group (one "
                "fully_shard mesh), adding their sums of squares with one all-reduce"
            )
        if not groups:  # DTensors replicated everywhere: every process holds whole gradients
            return ShardedGradients((), tuple(replicated), "", 1)
        name, (group, size) = next(iter(groups.items()))
        return ShardedGradients(tuple(sharded), tuple(replicated), name, size, group)

    def local_gradients(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """This process's part of the gradients that exist: (shards, replicated)."""
        with torch.no_grad():  # to_local() without autograd's bookkeeping
            shards = [p.grad.to_local() for p in self.sharded if p.grad is not None]
            whole = [_local(p.grad) for p in self.replicated if p.grad is not None]
        return shards, whole

    def global_sums(self, shards, whole, found_inf: torch.Tensor, with_sumsq: bool) -> torch.Tensor:
        """``[sum of squares of the whole gradient, number of processes that flagged]`` (or just
        the flag count without ``with_sumsq``), the same tensor on every process of the group.

        The replicated gradients' sum enters divided by the group size, so that the all-reduce
        counts it once (the mean over the processes, which is the value each holds)."""
        from fasttrain import kernels

        flag = found_inf.reshape(1)
        if with_sumsq:
            device = found_inf.device
            sumsq = kernels.grad_sumsq(shards, device=device)
            if whole:
                sumsq = sumsq + kernels.grad_sumsq(whole, device=device) / self.group_size
            packed = torch.cat([sumsq.reshape(1), flag])
        else:
            packed = flag.clone()  # reduced in place below: found_inf itself stays as it is
        if not self.group_name:
            return packed
        # COMMUNICATION: the one collective of a clipped update, 4-8 bytes, and no host read
        # (on GPUs the stream that uses the result waits for it, not the host). Traced, it is
        # the functional all-reduce, which torch.compile captures in the update's graph; run
        # eagerly, torch.distributed's in-place one, which skips the functional version's
        # wrapper tensor (measured 0.3-0.6 ms less per call with gloo on the CPU).
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(packed, "sum", self.group_name)
        torch.distributed.all_reduce(packed, group=self.group)
        return packed


class GradientClipper:
    """Clips the gradients of a fixed set of parameters by value and/or by global norm.

    With sharded parameters (FSDP2), the norm is that of the whole gradient over every process
    and the non-finite flag is raised on all processes when any of them saw a non-finite
    value; see :class:`ShardedGradients`.
    """

    def __init__(self, parameters, clip_value: Optional[float] = None, clip_norm: Optional[float] = None):
        # all of them: layers unfrozen during training (finetuning) get gradients later, and
        # gradients_of() skips the ones without
        self.parameters = list(parameters)
        self.clip_value = clip_value
        self.clip_norm = clip_norm
        self.enabled = clip_value is not None or clip_norm is not None
        # set to 1 by the kernels when a gradient is not finite; read only at flushes. Made here,
        # at set-up: created lazily inside the compiled update, its ``is None`` test became a guard
        # that failed on the second update and recompiled it (inside a CUDA graph capture, even)
        self.found_inf: Optional[torch.Tensor] = flag_on_device_of(self.parameters)
        #: None unless some parameters are DTensors; decided once, here
        self.sharding: Optional[ShardedGradients] = None
        self._unsupported: Optional[ValueError] = None
        try:
            self.sharding = ShardedGradients.of(self.parameters)
        except ValueError as error:
            if self.enabled:
                raise
            # a layout one all-reduce cannot serve matters only when something asks for the
            # gradients' norm or flag: with nonfinite="skip", at the first update
            self._unsupported = error
        #: set by :meth:`note_gradient_layout`: some gradients share a storage, so a compiled
        #: function clips them eagerly (the module's docstring says why)
        self.clips_outside_graphs = False

    def note_gradient_layout(self) -> None:
        """Look, once the gradients exist and before the first compiled update, whether two of
        them share a storage; a compiled caller then runs the clipping outside its graph. The
        layout stays for the run: FSDP2 reduce-scatters every update into a buffer laid out the
        same way, DDP's bucket views stay the gradients. No device work, no host read."""
        if self.sharding is not None:
            shards, whole = self.sharding.local_gradients()
            grads = shards + whole
        else:
            grads = gradients_of(self.parameters)
        storages = [g.untyped_storage().data_ptr() for g in grads]
        self.clips_outside_graphs = len(set(storages)) < len(storages)

    def prepare_tables(self) -> None:
        """Build the fused kernels' chunk tables for the gradients as they are now (host work and
        one queued copy, no host read): a CUDA graph that captures the clipping cannot build them,
        and the kernels' small cache may have evicted them since the last capture."""
        from fasttrain import kernels

        if self.sharding is not None:
            shards, whole = self.sharding.local_gradients()
            kernels.prepare_chunk_tables(shards + whole)
        else:
            kernels.prepare_chunk_tables(gradients_of(self.parameters))

    @property
    def always_communicates(self) -> bool:
        """True when every call takes part in a collective, whatever this process's gradients
        (so that no process waits for one that returned early)."""
        return self.sharding is not None and bool(self.sharding.group_name)

    def __call__(self, check_finite: bool = False) -> Optional[torch.Tensor]:
        """Clip in place; returns the total norm (before clipping) when clipping by norm.

        ``check_finite``: ``found_inf`` must end up raised exactly when some gradient is not
        finite, also when not clipping (the non-finite guard's check; without it, clipping by
        value alone needs no communication when sharded)."""
        if self.clips_outside_graphs and torch.compiler.is_compiling():
            return _outside_graphs(self._clip, check_finite)
        return self._clip(check_finite)

    def _clip(self, check_finite: bool) -> Optional[torch.Tensor]:
        if self.sharding is not None:
            return self._clip_sharded(check_finite)
        if self._unsupported is not None and check_finite:
            raise self._unsupported
        from fasttrain import kernels

        grads = gradients_of(self.parameters)
        if not grads:
            return None
        if self.found_inf is None or self.found_inf.device != grads[0].device:
            self.found_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        norm = None
        if self.clip_value is not None:
            kernels.clip_grad_value_(grads, self.clip_value, found_inf=self.found_inf)
        if self.clip_norm is not None:
            norm = kernels.clip_grad_norm_(grads, self.clip_norm, found_inf=self.found_inf)
        elif check_finite and self.clip_value is None:
            # an infinite limit makes the scale exactly 1, so the kernel only measures the norm
            # and raises found_inf; the gradients are left as they are
            kernels.clip_grad_norm_(grads, float("inf"), found_inf=self.found_inf)
        return norm

    def _clip_sharded(self, check_finite: bool) -> Optional[torch.Tensor]:
        from fasttrain import kernels

        sharding, found_inf = self.sharding, self.found_inf
        shards, whole = sharding.local_gradients()
        local = shards + whole
        if found_inf is None:  # no parameters at all
            return None
        if self.clip_value is not None:  # elementwise: the local shards are all there is to it
            kernels.clip_grad_value_(local, self.clip_value, found_inf=found_inf)
        if self.clip_norm is None and not check_finite:
            return None  # nobody reads the flag: no collective
        measure = self.clip_norm is not None or self.clip_value is None
        sums = sharding.global_sums(shards, whole, found_inf, with_sumsq=measure)
        flagged = sums[-1] > 0  # some process's value kernel saw a non-finite element
        if self.clip_norm is None:
            if measure:  # the check alone: a non-finite element makes the global sum non-finite
                flagged = flagged | ~torch.isfinite(sums[0])
            found_inf.copy_(torch.where(flagged, 1.0, found_inf))
            return None
        found_inf.copy_(torch.where(flagged, 1.0, found_inf))
        # raises found_inf itself when the global norm is not finite
        return kernels.clip_grad_norm_from_sumsq_(local, sums[0], self.clip_norm, found_inf=found_inf)


class UpdateClip:
    """The ``clip`` of a step context: clips once per update, after all micro-steps have
    accumulated, and returns the global norm as a device tensor when clipping by norm. With
    ``nonfinite="skip"`` the same kernels flag non-finite gradients on the device.

    :param guard: the run's non-finite guard (``checks_gradients``, ``clip(clipper)``).
    :param clipper: the run's :class:`GradientClipper`, or None.
    :param accelerator: the accelerator whose loss scaler (fp16) scales the gradients until the
        optimizer step; they are unscaled first so that the true values are clipped.
    """

    def __init__(self, guard, clipper: Optional[GradientClipper], accelerator=None):
        self._guard = guard
        self._clipper = clipper
        self.accelerator = accelerator
        self._decide()

    @property
    def guard(self):
        return self._guard

    @guard.setter
    def guard(self, guard) -> None:
        # train() replaces the guard once the engine is set up (prepare.set_up_training)
        self._guard = guard
        self._decide()

    @property
    def clipper(self) -> Optional[GradientClipper]:
        return self._clipper

    @clipper.setter
    def clipper(self, clipper: Optional[GradientClipper]) -> None:
        self._clipper = clipper
        self._decide()

    def _decide(self) -> None:
        #: whether an update has anything to clip or check: an attribute, kept up to date with
        #: the guard and the clipper, which an engine reads every update instead of calling this
        self.active = self._guard.checks_gradients or (self._clipper is not None and self._clipper.enabled)

    def __call__(self) -> Optional[torch.Tensor]:
        if not self.active:
            return None
        if self.accelerator is not None and self.accelerator.scaler is not None:
            self.accelerator.unscale_gradients()
        return self.guard.clip(self.clipper)

    def before_capture(self) -> None:
        """What a CUDA graph capture of the update cannot do itself: the kernels' chunk tables,
        for the clipping and for the masked skip's undo."""
        if self.active and self.clipper is not None:
            self.clipper.prepare_tables()
        self.guard.prepare_tables()

    def mutated_flags(self) -> tuple:
        """The device flags the kernels raise in place (restored when a failed step is undone)."""
        guard = self.guard
        return (
            getattr(self.clipper, "found_inf", None),
            getattr(guard, "found_inf", None),
            getattr(guard, "pending_skips", None),
        )

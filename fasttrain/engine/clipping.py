"""Gradient clipping, once per optimizer update, without host synchronisation.

On CUDA the fused kernels of :mod:`fasttrain.kernels` do the work in a constant number of
launches; elsewhere their PyTorch reference runs. Both return the total norm as a device tensor
and never read it on the host.
"""

from __future__ import annotations

from typing import List, Optional

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


class GradientClipper:
    """Clips the gradients of a fixed set of parameters by value and/or by global norm."""

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

    def __call__(self) -> Optional[torch.Tensor]:
        """Clip in place; returns the total norm (before clipping) when clipping by norm."""
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
        return norm


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
        self.guard = guard
        self.clipper = clipper
        self.accelerator = accelerator

    @property
    def active(self) -> bool:
        return self.guard.checks_gradients or (self.clipper is not None and self.clipper.enabled)

    def __call__(self) -> Optional[torch.Tensor]:
        if not self.active:
            return None
        if self.accelerator is not None and self.accelerator.scaler is not None:
            self.accelerator.unscale_gradients()
        return self.guard.clip(self.clipper)

    def mutated_flags(self) -> tuple:
        """The device flags the kernels raise in place (restored when a failed step is undone)."""
        guard = self.guard
        return (
            getattr(self.clipper, "found_inf", None),
            getattr(guard, "found_inf", None),
            getattr(guard, "pending_skips", None),
        )

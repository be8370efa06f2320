"""pytorch-accelerated's private forward-and-backward helper, kept on fasttrain's Trainer.

pytorch-accelerated ran each training micro-step through ``Trainer._perform_forward_and_backward_passes``;
its tests and some subclasses call or override it. fasttrain's step engines (eager, compiled,
CUDA-graphed) are built from the public hooks ``calculate_train_batch_loss`` and ``backward_step``
instead, so the helper is kept for callers, and a subclass that overrides it is told, when it is
defined, that the override is not used and which hooks to override.
"""

from __future__ import annotations

import warnings


class ForwardBackwardHelper:
    """Base of :class:`fasttrain.trainer.Trainer` holding the helper."""

    def _perform_forward_and_backward_passes(self, batch, step):
        """Compute the batch's loss with ``calculate_train_batch_loss``, scale it as the step
        loop does (by the accumulation steps; token-normalised losses by the number of
        processes) and pass it to ``backward_step``; returns the batch output."""
        batch_output = self.calculate_train_batch_loss(batch)
        self.backward_step(self._scale_loss(batch_output["loss"], batch_output))
        return batch_output

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        helper = ForwardBackwardHelper._perform_forward_and_backward_passes
        if cls._perform_forward_and_backward_passes is not helper:
            warnings.warn(
                f"{cls.__qualname__} overrides _perform_forward_and_backward_passes, which "
                "fasttrain's step loop does not call: override calculate_train_batch_loss "
                "(forward and loss) or backward_step instead.",
                UserWarning,
                stacklevel=2,
            )

"""Resumable training loaders, as Lightning keeps them across a checkpoint.

A training loader with ``state_dict()``/``load_state_dict()`` (Lightning's ``_Stateful``, such as
torchdata's ``StatefulDataLoader``) knows where it is in its epoch. Lightning writes the state of
each such loader of the fit into the checkpoint (``loops.fit_loop.state_dict.combined_loader``)
and loads it into the new loaders when a fit resumes, so a checkpoint saved inside an epoch goes
on with the batches that epoch had not yet given. A mid-epoch resume whose loaders are not all
resumable gets Lightning's warning instead: the epoch restarts at the loader's first batch.

In one process fasttrain iterates the loaders the user gave, so their state is theirs. Under
several processes it iterates accelerate's sharded copies, whose position the user's loaders do
not have: their states are neither written nor loaded there, and the warning says so.
"""

from __future__ import annotations

import math

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning


class LoaderStates:
    """The fit's training loaders (flattened, as Lightning's ``CombinedLoader.flattened``) and
    the loader states a checkpoint brought, until the fit's loaders are loaded."""

    def __init__(self) -> None:
        self.loaders: list = []
        #: whether every training loader keeps its position (one process only, see above)
        self.resumable = False
        self._to_load: list = []

    def set_loaders(self, loaders: list, processes: int) -> None:
        """The loaders of a fit, as it requests them (``processes``: those of the launch)."""
        self.loaders = [dl for dl in loaders if isinstance(dl, _Stateful)] if processes == 1 else []
        self.resumable = bool(loaders) and len(self.loaders) == len(loaders)

    def state(self) -> list:
        """Each resumable loader's ``state_dict()``, for the checkpoint (empty: none)."""
        return [loader.state_dict() for loader in self.loaders]

    def keep_for_loading(self, states: list) -> None:
        """The states a checkpoint holds, loaded by :meth:`load` once the fit has its loaders."""
        self._to_load = list(states)

    def load(self, restarting: bool) -> None:
        """Into the fit's loaders when the fit restarts from the checkpoint, as Lightning loads
        them, with its error when their number differs from the checkpoint's."""
        states, self._to_load = self._to_load, []
        if not restarting or not states:
            return
        if len(self.loaders) != len(states):
            raise RuntimeError(
                f"The CombinedLoader has {len(self.loaders)} stateful loaders, but found {len(states)} states"
                " in the checkpoint. Please make sure you define the same dataloaders that were used when saving"
                " the checkpoint."
            )
        for loader, state in zip(self.loaders, states):
            loader.load_state_dict(state)


def warn_if_not_resumable(trainer, global_step: int) -> None:
    """Lightning's warning for an epoch restarted inside itself whose loaders cannot continue."""
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return
    expected_steps = math.ceil(batches / trainer.accumulate_grad_batches)
    if global_step % expected_steps != 0 and not trainer._loader_states.resumable:
        rank_zero_warn(
            "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"
            " not resumable. This can cause unreliable results if further training is done."
            " Consider using an end-of-epoch checkpoint or make your dataloader resumable by implementing"
            " the `state_dict` / `load_state_dict` interface.",
            category=PossibleUserWarning,
        )

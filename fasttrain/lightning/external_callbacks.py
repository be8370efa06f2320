"""The callbacks installed packages add to every Trainer: Lightning's entry point group
``lightning.pytorch.callbacks_factory``, each entry a function returning a callback or a list of
them, called once per Trainer as Lightning calls it.

Finding the group's entries reads the metadata of every installed distribution (a few
milliseconds in an environment with a hundred packages, more in a larger one): a script that
builds a Trainer per fit (a sweep, a benchmark) paid that at each construction. The entries found
are kept per process, and looked up again where an installation may have changed them: when
``sys.path`` changes, or when one of its folders was modified (installing or removing a package
writes the folder its metadata lives in). The factories are still called once per Trainer, so
each Trainer gets callbacks of its own.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import entry_points
from typing import Any, Dict, List, Tuple

#: the entry point group Lightning reads for a Trainer's external callbacks
GROUP = "lightning.pytorch.callbacks_factory"

_log = logging.getLogger(__name__)

#: group -> (the installation's state when the entries were found, the entries)
_FOUND: Dict[str, Tuple[tuple, list]] = {}


def _installation_state() -> tuple:
    # each folder Python imports from, with the time it last changed (an installation adds or
    # removes the distribution's metadata folder there)
    state = []
    for folder in sys.path:
        try:
            state.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            state.append((folder, None))
    return tuple(state)


def _entries(group: str) -> list:
    state = _installation_state()
    found = _FOUND.get(group)
    if found is None or found[0] != state:
        found = _FOUND[group] = (state, list(entry_points(group=group)))
    return found[1]


def external_callbacks(group: str = GROUP) -> List[Any]:
    """The callbacks of the installed packages' factories in ``group``, new ones per call, in
    the order Lightning adds them."""
    callbacks: List[Any] = []
    for entry in _entries(group):
        made = entry.load()()
        made = made if isinstance(made, list) else [made]
        if made:
            _log.info(
                f"Adding {len(made)} callbacks from entry point '{entry.name}': "
                f"{', '.join(type(cb).__name__ for cb in made)}"
            )
        callbacks.extend(made)
    return callbacks

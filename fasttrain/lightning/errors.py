"""The exception fasttrain.lightning raises where Lightning raises ``MisconfigurationException``."""

from lightning.pytorch.utilities.exceptions import MisconfigurationException


class LightningConfigError(MisconfigurationException, ValueError):
    """A bad setting: Lightning's ``MisconfigurationException`` (what Lightning raises there, so
    ``except MisconfigurationException`` works unchanged) that is also a ``ValueError``."""

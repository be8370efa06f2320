"""Exceptions that cross layers: raised by callbacks, recognised by the engines, handled by the
trainer. Kept apart from the callback system so that the engines need not import it."""


class StopTrainingError(Exception):
    """Raised by a callback to end the current training (or evaluation) run cleanly."""

"""The one error a checkpoint folder raises when it cannot be served, with a message that says how to fix it."""


class ModelLoadError(ValueError):
    """A checkpoint folder that cannot be loaded: what is wrong, where, and what was expected."""

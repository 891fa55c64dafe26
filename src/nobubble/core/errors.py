"""Failures that are the world's fault, not the code's: reported in one line, no traceback."""


class NobubbleError(RuntimeError):
    """A run could not be done as asked (data unreachable, a rank died, ...)."""


class MissingExtra(ImportError):
    """An optional dependency (``nobubble[hf]``) is not installed; the message says the fix."""

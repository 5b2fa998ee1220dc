"""The CkptError hierarchy.

Every error a user can cause (a missing, torn, corrupt or hostile checkpoint, a bad option)
is a ``CkptError``. The CLI prints ``str(error)`` on one line and exits 1; anything else is a
bug and keeps its traceback. Messages say what happened, where, and what to do next.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class. ``str(e)`` is a complete one-line message for the user."""

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None) -> None:
        self.path = path
        self.hint = hint
        full = message
        if hint:
            full = f"{message}. {hint}" if not message.endswith(".") else f"{message} {hint}"
        super().__init__(full)


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """The path does not exist or holds no checkpoint."""


class IncompleteCheckpointError(CkptError):
    """No ``.metadata``: the save never committed."""


class CorruptCheckpointError(CkptError):
    """Metadata and files disagree, bytes are damaged, or the input is hostile."""


class IncompatibleCheckpointError(CkptError):
    """Keys, shapes, dtypes or rank counts do not match what was asked for."""


class ConfigError(CkptError, ValueError):
    """A bad option or configuration value."""


class HubError(CkptError):
    """A Hugging Face Hub operation failed."""

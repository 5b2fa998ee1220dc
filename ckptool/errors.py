"""The CkptError hierarchy.

Every error a user can cause (a missing, torn, corrupt or hostile checkpoint, a bad option)
is a ``CkptError``. The CLI prints ``str(error)`` on one line and exits 1; anything else is a
bug and keeps its traceback. Messages say what happened, where, and what to do next.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class. ``str(e)`` is a complete one-line message for the user; ``code`` is a stable
    name for scripts and for ``validate``'s findings (never parse the message)."""

    code = "error"

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None,
                 code: str | None = None) -> None:
        self.path = path
        self.hint = hint
        if code is not None:
            self.code = code
        full = message
        if hint:
            full = f"{message}. {hint}" if not message.endswith(".") else f"{message} {hint}"
        super().__init__(full)


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """The path does not exist or is not a checkpoint folder."""

    code = "not-a-checkpoint"


class NoCheckpointError(CheckpointNotFoundError):
    """The folder exists but holds no checkpoint (no ``.metadata``, no shards)."""

    code = "empty"


class IncompleteCheckpointError(CkptError):
    """No ``.metadata``: the save never committed."""

    code = "incomplete"


class CorruptCheckpointError(CkptError):
    """Metadata and files disagree, or bytes are damaged."""

    code = "corrupt"


class ChecksumError(CorruptCheckpointError):
    """Stored bytes do not match their CRC-32 (or checksum): damaged after the save."""

    code = "crc-mismatch"


class UnsafeInputError(CorruptCheckpointError):
    """A pickle names a global outside the allow-list: refused, nothing was run."""

    code = "unsafe-pickle"


class IncompatibleCheckpointError(CkptError):
    """Keys, shapes, dtypes or rank counts do not match what was asked for."""

    code = "incompatible"


class ConfigError(CkptError, ValueError):
    """A bad option or configuration value."""

    code = "config"


class HubError(CkptError):
    """A Hugging Face Hub operation failed."""

    code = "hub"

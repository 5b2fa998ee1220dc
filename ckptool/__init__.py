"""ckptool: checkpoint management for FSDP2 training with PyTorch Distributed Checkpoint.

The library returns data and never prints; heavy modules load on first use, so
``import ckptool`` stays fast and does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptool._version import __version__
from ckptool.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    CorruptCheckpointError,
    HubError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
)

_LAZY = {
    "validate": "ckptool.ops.validate:validate",
    "Report": "ckptool.ops.validate:Report",
    "Finding": "ckptool.ops.validate:Finding",
    "inspect": "ckptool.ops.inspect:inspect",
    "list_run": "ckptool.ops.inspect:list_run",
    "read_checkpoint": "ckptool.format.metadata:read_checkpoint",
    "consolidate": "ckptool.ops.consolidate:consolidate",
    "reshard": "ckptool.ops.reshard:reshard",
    "upload": "ckptool.ops.upload:upload",
    "estimate": "ckptool.ops.estimate:estimate",
    "Checkpointer": "ckptool.checkpoint:Checkpointer",
}

__all__ = [
    "__version__",
    "CkptError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "ConfigError",
    "HubError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value

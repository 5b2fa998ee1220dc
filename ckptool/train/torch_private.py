"""The one place in ``train/`` that reaches into torch's private modules and attributes.

torch offers no public API for these; each has been stable for several releases, and the
distributed tests exercise every one of them (``tests/dist/test_train*.py``). When a torch
upgrade moves one, only this module changes. (The torch names that checkpoint *pickles*
spell are ``format/pickle_globals.py``'s.)

* ``checkpoint_wrapper`` lives in ``torch.distributed.algorithms._checkpoint``; its wrapped
  module sits under the attribute ``_checkpoint_wrapped_module``.
* A ``DTensor`` shard's global offset comes from ``torch.distributed.tensor._utils``.
* A module's own buffers, persistent or not, are ``Module._buffers`` and
  ``Module._non_persistent_buffers_set``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

#: The name segment ``checkpoint_wrapper`` adds to parameter names (state_dict keys drop it).
AC_SEGMENT = "_checkpoint_wrapped_module."


def checkpoint_wrapped(module: nn.Module) -> nn.Module:
    """``module`` under non-reentrant activation checkpointing (before ``fully_shard``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def shard_offset(t: torch.Tensor) -> tuple[int, ...]:
    """The global index of the first element of this rank's shard of the DTensor ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offset)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of ``module``'s own buffers that ``state_dict()`` saves."""
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` back as ``module``'s buffer ``name``, keeping it persistent or not."""
    module._buffers[name] = value

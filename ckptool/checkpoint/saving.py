"""What a save writes besides DCP's files, and how an async save runs in the background.

``write_manifest`` puts the ``hf_assets/`` files and the ``ckptool.json`` manifest into a
checkpoint (rank 0, only after DCP committed it). ``start_async_save`` hands the state to
``dcp.async_save`` in a background process; ``PendingSave`` is that save until it finished.
``SaveStats`` is what saving cost training.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool.format import manifest as mf
from ckptool.format.hf_source import ASSETS_DIR
from ckptool.storage import Storage



@dataclass
class SaveStats:
    """Seconds spent saving. ``blocked_seconds`` is what training waited for; for a
    synchronous save it equals ``save_seconds``, for an async one it is the staging copy
    (plus waiting for the previous save, if it was still running)."""

    saves: int = 0
    save_seconds: float = 0.0
    blocked_seconds: float = 0.0
    last_save_seconds: float = 0.0
    last_blocked_seconds: float = 0.0

    def add(self, save_s: float | None, blocked_s: float | None) -> None:
        """Count a finished save (``save_s``) and/or the time ``save`` held training up."""
        if save_s is not None:
            self.saves += 1
            self.save_seconds += save_s
            self.last_save_seconds = save_s
        if blocked_s is not None:
            self.blocked_seconds += blocked_s
            self.last_blocked_seconds = blocked_s


@dataclass
class PendingSave:
    """An async save in flight: ``done`` is set once it finished on this rank (``error``
    then says whether it failed)."""

    step: int
    path: Path | str
    loss: float | None
    started: float
    future: Any
    stager: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def start_async_save(state: dict[str, Any], path: Path | str, group: Any) -> tuple[Any, Any]:
    """Start ``dcp.async_save`` of ``state`` to ``path`` in a background process (called on all
    ranks); its ``(future, stager)``. The stager must be closed once the future is done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # The default StagingOptions() want pinned memory and non-blocking copies, which need
    # an accelerator; a plain synchronous copy to CPU works everywhere.
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    future = dcp.async_save(state, checkpoint_id=str(path), process_group=group,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
    return future, stager


def write_manifest(storage: Storage, *, step: int | None, world_size: int, loss: float | None,
                   config: dict[str, Any], hf_assets: dict[str, bytes]) -> None:
    """Write ``hf_assets`` and then the manifest listing every file into a saved checkpoint
    (rank 0 only, after DCP wrote ``.metadata``)."""
    manifest = mf.build_manifest(storage, step=step, world_size=world_size, loss=loss, config=config)
    manifest.files.update(_write_assets(storage, hf_assets))
    mf.write_manifest(storage, manifest)


def _write_assets(storage: Storage, hf_assets: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Write the asset files into ``ASSETS_DIR``; their manifest entries."""
    out = {}
    for name, data in sorted(hf_assets.items()):
        rel = f"{ASSETS_DIR}/{name}"
        storage.makedirs(ASSETS_DIR)
        storage.write_bytes(rel, data)
        size, digest = mf.file_checksum(storage, rel)
        out[rel] = {"size": size, mf.CHECKSUM: digest}
    return out

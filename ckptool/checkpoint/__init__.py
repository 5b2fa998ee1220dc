"""``Checkpointer``: save, resume and retention for an FSDP2 training script, over DCP.

Owns the life of checkpoints in one run folder: ``step_N/`` written with ``dcp.save`` (or
``dcp.async_save`` in a background process), the ``ckptool.json`` manifest written by rank 0
only after the save has committed, retention of the last K committed checkpoints, and loading
the latest valid one (with load-time resharding, so the rank count may change). It leaves the
on-disk format to ``ckptool.format``, validity to ``ckptool.ops.validate`` and which folders
exist, resume and are deleted to ``ckptool.run_folder``.

The run folder may be an fsspec URL (``s3://bucket/run``): DCP then writes through its
``FsspecWriter`` (still ``.metadata`` last), and retention, which cannot rename a folder
atomically there, deletes a checkpoint's ``.metadata`` before its other files.

Keys in a checkpoint: ``model.*`` and ``optim.*`` (from ``get_state_dict``), plus whatever the
caller passes as ``extra`` (e.g. ``lr_scheduler``, ``train``, ``data``).

The package: ``checkpointer`` (the class), ``saving`` (manifest and assets, the async
machinery), ``loading`` (checks before DCP loads, pretrained weights) and ``ranks``
(process-group queries). Every public name is importable from ``ckptool.checkpoint``.

Example (on every rank, after ``fully_shard``)::

    ckpt = Checkpointer("runs/x", keep=3, async_save=True)
    start = ckpt.load_latest(model, optimizer, extra={"lr_scheduler": sched}) or 0
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:
            ckpt.save(step, model, optimizer, extra={"lr_scheduler": sched}, loss=loss.item())
    ckpt.close()
"""

from __future__ import annotations

from ckptool.checkpoint.checkpointer import RESERVED, Checkpointer
from ckptool.checkpoint.saving import ASSETS_DIR, SaveStats
from ckptool.run_folder import (deleting_leftovers, latest_valid, remove_checkpoint, remove_remote,
                                retain, retention_victims, step_checkpoints, validation_problem)

__all__ = ["ASSETS_DIR", "RESERVED", "Checkpointer", "SaveStats", "deleting_leftovers", "latest_valid",
           "remove_checkpoint", "remove_remote", "retain", "retention_victims", "step_checkpoints",
           "validation_problem"]

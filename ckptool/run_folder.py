"""A run folder's checkpoints: which exist, which resume, which retention deletes, and deleting
them without ever leaving a broken checkpoint that looks committed.

Used by ``Checkpointer`` (``ckptool.checkpoint``), ``ckptool train``'s checks before launch and the
crash benchmark. Only DCP ``step_N`` folders count: a step folder of safetensors (an HF-format
export) is never resumed from nor deleted.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from ckptool.errors import CkptError
from ckptool.format import checkpoint_dirs as layout
from ckptool.storage import Storage

logger = logging.getLogger(__name__)


def latest_valid(run: Storage | str | os.PathLike[str]) -> layout.CheckpointDir | None:
    """The newest ``step_N`` checkpoint in ``run`` that is committed and passes ``validate``."""
    from ckptool.ops.validate import validate

    for ckpt in reversed(step_checkpoints(run)):
        if ckpt.committed and validate(ckpt).ok:
            return ckpt
    return None


def step_checkpoints(run: Storage | str | os.PathLike[str]) -> list[layout.CheckpointDir]:
    """``step_N`` folders in ``run`` (committed or not), oldest first; [] if ``run`` is missing.

    ``run`` may be a local folder or an fsspec URL (listed fresh, never from fsspec's cache)."""
    storage = run if isinstance(run, Storage) else Storage.open(run)
    if not storage.isdir():
        return []
    # Only DCP folders: a step folder of safetensors (an HF-format export) is neither resumed
    # from nor deleted by retention.
    return [c for c in layout.list_checkpoints(storage)
            if c.step is not None and c.name == f"step_{c.step}" and c.kind == "dcp"]


def retention_victims(found: list[layout.CheckpointDir], keep: int, *,
                      inflight: int | None = None) -> list[layout.CheckpointDir]:
    """Which ``step_N`` folders retention deletes.

    Committed checkpoints beyond the newest ``keep`` (0 keeps all), and uncommitted (torn)
    folders older than the newest committed one. Never the newest committed checkpoint,
    never an uncommitted folder newer than it (it may be a save in flight elsewhere), never
    the step ``inflight``. With no committed checkpoint nothing is deleted.

    Example:
        >>> [c.name for c in retention_victims(step_checkpoints("runs/x"), keep=2)]
        ['step_100', 'step_150']
    """
    committed = [c for c in found if c.committed]
    if not committed:
        return []
    newest = committed[-1].step
    kept = committed[-keep:] if keep else committed
    return [c for c in found
            if (c.committed and c not in kept)
            or (not c.committed and c.step < newest and c.step != inflight)]


def retain(run: Storage, keep: int, *, inflight: int | None = None) -> list[layout.CheckpointDir]:
    """Apply ``retention_victims`` to ``run``: remove each victim with ``remove_checkpoint``,
    then the hidden leftovers of a removal a crash cut short. Returns the removed checkpoints.

    Called by one process only (``Checkpointer``: rank 0, after a save committed).
    """
    victims = retention_victims(step_checkpoints(run), keep, inflight=inflight)
    for c in victims:
        logger.info("retention: removing %s", c.url)
        remove_checkpoint(run, c.name)
    for leftover in deleting_leftovers(run):
        run.remove_tree(leftover)
    return victims


def remove_checkpoint(run: Storage, name: str) -> None:
    """Remove the checkpoint folder ``run/name`` so that no crash part-way leaves a broken
    checkpoint that looks committed.

    Where a folder renames atomically (local disks) it is first renamed to a hidden
    ``.name.deleting-*`` (``layout.list_checkpoints`` skips hidden folders, so it vanishes at
    once); elsewhere (object stores) its ``.metadata`` goes first (``remove_remote``).
    """
    if not run.atomic_rename:
        remove_remote(run, name)
        return
    hidden = f".{name}.deleting-{uuid.uuid4().hex[:8]}"
    try:
        run.rename(name, hidden)
    except FileNotFoundError:
        return
    run.remove_tree(hidden)


def remove_remote(root: Storage | str, name: str) -> None:
    """Remove the remote folder ``root/name``, ``.metadata`` first.

    An object store cannot rename a folder atomically (s3fs copies and deletes each object),
    so the rename of ``remove_checkpoint`` does not carry over. Deleting ``.metadata`` first
    makes the folder uncommitted at once: a crash part-way leaves a torn folder, which resume
    skips and the next retention pass removes, never a "committed" one with files missing.
    """
    storage = (root if isinstance(root, Storage) else Storage.open(root)).child(name)
    storage.remove_tree(layout.METADATA)  # removes a single file too
    storage.remove_tree()


def deleting_leftovers(run: Storage) -> list[str]:
    """Hidden ``.step_N.deleting-*`` folders a local removal left behind when it crashed
    (none where removal renames nothing)."""
    if not run.atomic_rename:
        return []
    try:
        return [e.name for e in run.listdir() if e.name.startswith(".step_") and ".deleting-" in e.name]
    except (CkptError, OSError):
        return []


def validation_problem(path: str | os.PathLike[str]) -> tuple[str | None, Any]:
    """(the first problem ``validate`` finds, or None; the parsed index when there is one)."""
    from ckptool.ops.validate import validate

    try:
        report = validate(path)
    except CkptError as e:  # missing path, not a checkpoint: every rank must hear about it
        return str(e), None
    meta = next(iter(report.metadata.values()), None)
    return (None if report.ok else str(report.errors[0])), meta

"""A run folder's checkpoints: which exist, which resume, which retention deletes, and deleting
them without ever leaving a broken checkpoint that looks committed.

Used by ``Checkpointer`` (``checkpoint.py``), ``ckptool train``'s checks before launch and the
crash benchmark. Only DCP ``step_N`` folders count: a step folder of safetensors (an HF-format
export) is never resumed from nor deleted.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from ckptool.errors import CkptError
from ckptool.format import checkpoint_dirs as layout
from ckptool.storage import Storage, is_url


def latest_valid(run: str | os.PathLike[str]) -> layout.CheckpointDir | None:
    """The newest ``step_N`` checkpoint in ``run`` that is committed and passes ``validate``."""
    from ckptool.ops.validate import validate

    for ckpt in reversed(step_checkpoints(run)):
        if ckpt.committed and validate(ckpt).ok:
            return ckpt
    return None


def step_checkpoints(run: str | os.PathLike[str]) -> list[layout.CheckpointDir]:
    """``step_N`` folders in ``run`` (committed or not), oldest first; [] if ``run`` is missing.

    ``run`` may be a local folder or an fsspec URL (listed fresh, never from fsspec's cache)."""
    if is_url(run):
        storage = Storage.open(run)
        if not storage.isdir():
            return []
        found = layout.list_checkpoints(storage)
    elif not os.path.isdir(run):
        return []
    else:
        found = layout.list_checkpoints(run)
    # Only DCP folders: a step folder of safetensors (an HF-format export) is neither resumed
    # from nor deleted by retention.
    return [c for c in found if c.step is not None and c.name == f"step_{c.step}"
            and c.kind == "dcp"]


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


def remove_remote(root: str, name: str) -> None:
    """Remove the remote folder ``root/name``, ``.metadata`` first.

    An object store cannot rename a folder atomically (s3fs copies and deletes each object),
    so ``remove_local``'s trick does not carry over. Deleting ``.metadata`` first makes the folder
    uncommitted at once: a crash part-way leaves a torn folder, which resume skips and the
    next retention pass removes, never a "committed" one with files missing.
    """
    storage = Storage.open(root).child(name)
    storage.remove_tree(layout.METADATA)  # removes a single file too
    storage.remove_tree()


def remove_local(root: Path, name: str) -> None:
    """Remove the folder ``root/name``, first renaming it to a hidden ``.name.deleting-*``.

    A crash in the middle of ``rmtree`` could otherwise leave ``.metadata`` beside a missing
    ``.distcp`` file: a committed checkpoint that fails validation. The rename is atomic, and
    ``layout.list_checkpoints`` skips hidden folders, so the checkpoint vanishes at once.
    """
    hidden = root / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(root / name, hidden)
    except FileNotFoundError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def deleting_leftovers(root: Path) -> list[str]:
    try:
        return [n for n in os.listdir(root) if n.startswith(".step_") and ".deleting-" in n]
    except OSError:
        return []


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the files themselves were synced
    finally:
        os.close(fd)


def validation_problem(path: str | os.PathLike[str]) -> tuple[str | None, Any]:
    """(the first problem ``validate`` finds, or None; the parsed index when there is one)."""
    from ckptool.ops.validate import validate

    try:
        report = validate(path)
    except CkptError as e:  # missing path, not a checkpoint: every rank must hear about it
        return str(e), None
    meta = next(iter(report.metadata.values()), None)
    return (None if report.ok else str(report.errors[0])), meta

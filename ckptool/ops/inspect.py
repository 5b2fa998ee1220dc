"""Describe checkpoints: ``inspect`` one (keys, shapes, bytes) and ``list_run`` a run folder.

Both read only ``.metadata``, the manifest and file sizes; no record is opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import CkptError
from ckptool.format import manifest as mf
from ckptool.format.checkpoint_dirs import (
    CheckpointDir,
    classify,
    list_checkpoints,
    resolve_checkpoint,
)
from ckptool.format.metadata import CheckpointMetadata, read_metadata
from ckptool.format.state_layout import StateLayout, describe, read_layout
from ckptool.format.text_enum import TextEnum
from ckptool.ops.validate import validate
from ckptool.storage import Storage

GROUPS = ("model", "optimizer", "other")


class KeyKind(TextEnum):
    """What a saved key holds. A ``str``: ``KeyKind.TENSOR == "tensor"``; JSON shows "tensor"."""

    TENSOR = "tensor"
    OBJECT = "object"  # any other value (step, RNG state, ...), pickled


class RunStatus(TextEnum):
    """A checkpoint's state in a run folder. A ``str``: ``RunStatus.COMPLETE == "complete"``."""

    COMPLETE = "complete"  # committed and structurally valid
    INCOMPLETE = "incomplete"  # not committed (no .metadata): the save never finished
    INVALID = "invalid"  # committed, but validate found an error


@dataclass(frozen=True)
class KeyInfo:
    fqn: str
    kind: KeyKind
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: int
    bytes: int


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int


@dataclass(frozen=True)
class Summary:
    path: str
    step: int | None
    world_size: int | None
    committed: bool
    total_bytes: int
    files: tuple[FileInfo, ...]
    groups: dict[str, tuple[KeyInfo, ...]]
    manifest: dict[str, Any] | None = None
    layout: str | None = None       # how the model's keys were found (state_layout.describe)
    note: str | None = None         # set when another reading was possible
    names: dict[str, str] = field(default_factory=dict)  # model key -> exported name

    def count(self, group: str) -> int:
        return len(self.groups.get(group, ()))

    def group_bytes(self, group: str) -> int:
        return sum(k.bytes for k in self.groups.get(group, ()))


def inspect(path: str | os.PathLike[str], *, model_key: str | None = None,
            keep_wrappers: bool = False) -> Summary:
    """Summarise one committed checkpoint.

    Args:
        path: checkpoint folder (local or fsspec URL).
        model_key, keep_wrappers: as for ``consolidate`` (which keys are the model, and their
            exported names).

    Returns:
        ``Summary`` with every key grouped into model / optimizer / other.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError.

    Example:
        >>> s = inspect("runs/demo/step_40"); s.world_size, s.count("model")
    """
    ckpt = resolve_checkpoint(path)
    groups: dict[str, list[KeyInfo]] = {g: [] for g in GROUPS}
    files: list[FileInfo] = []
    world_size = None
    man: mf.Manifest | None = None
    how = note = None
    names: dict[str, str] = {}
    for part in ckpt.parts:
        st = ckpt.part(part)
        meta = read_metadata(st)
        world_size = world_size or meta.world_size
        prefix = f"{part}/" if part else ""
        files += [FileInfo(prefix + e.name, e.size) for e in st.listdir() if not e.is_dir]
        part_man = _manifest(st)
        lay = read_layout(meta, model_key=model_key if part == ckpt.model_part else None,
                          keep_wrappers=keep_wrappers, ckptool_manifest=part_man is not None,
                          where=st.url)
        _group_keys(groups, meta, lay)
        if part == ckpt.model_part:
            how, note, names = describe(lay), lay.note, lay.names
        man = man or part_man
    step = ckpt.step if ckpt.step is not None else (man.step if man else None)
    return Summary(
        path=ckpt.url, step=step, world_size=world_size or (man.world_size if man else None),
        committed=ckpt.committed, total_bytes=sum(f.size for f in files), files=tuple(files),
        groups={g: tuple(v) for g, v in groups.items()},
        manifest=None if man is None else {"step": man.step, "world_size": man.world_size,
                                           "loss": man.loss, "config": man.config},
        layout=how, note=note, names=names,
    )


def _group_keys(groups: dict[str, list[KeyInfo]], meta: CheckpointMetadata,
                lay: StateLayout) -> None:
    """Add every key of one part's ``.metadata`` to its group (model / optimizer / other)."""
    for t in meta.tensors.values():
        groups[lay.groups[t.fqn].value].append(
            KeyInfo(t.fqn, KeyKind.TENSOR, t.dtype.name, t.shape, len(t.chunks), t.nbytes))
    for o in meta.objects.values():
        groups[lay.groups[o.fqn].value].append(
            KeyInfo(o.fqn, KeyKind.OBJECT, None, None, 1, o.storage.length if o.storage else 0))


def _manifest(st: Storage) -> mf.Manifest | None:
    try:
        return mf.read_manifest(st)
    except CkptError:
        return None


@dataclass(frozen=True)
class RunEntry:
    name: str
    path: str
    step: int | None
    status: RunStatus
    world_size: int | None
    bytes: int
    mtime: float | None
    latest_good: bool = False
    problems: tuple[str, ...] = field(default=())


def list_run(run: str | os.PathLike[str]) -> list[RunEntry]:
    """Every checkpoint in a run folder with its status; the newest complete one is marked.

    "complete" means committed and structurally valid (``validate`` without ``deep``).

    Example:
        >>> [e.name for e in list_run("runs/demo") if e.status == "complete"]
    """
    storage = Storage.open(run)
    own = classify(storage) if storage.isdir() else None
    found = [own] if own is not None else list_checkpoints(storage)  # a checkpoint lists itself
    entries = [_entry(c) for c in found]
    good = [i for i, e in enumerate(entries) if e.status is RunStatus.COMPLETE]
    if good:
        i = good[-1]
        e = entries[i]
        entries[i] = RunEntry(e.name, e.path, e.step, e.status, e.world_size, e.bytes, e.mtime,
                              True, e.problems)
    return entries


def _entry(ckpt: CheckpointDir) -> RunEntry:
    files = [f for p in ckpt.parts for f in ckpt.part(p).listdir() if not f.is_dir] \
        if ckpt.storage.exists() else []
    size = sum(f.size for f in files)
    mtime = max((f.mtime or 0 for f in files), default=None) or None
    if not ckpt.committed:
        return RunEntry(ckpt.name, ckpt.url, ckpt.step, RunStatus.INCOMPLETE, None, size, mtime)
    report = validate(ckpt)
    status = RunStatus.COMPLETE if report.ok else RunStatus.INVALID
    step = ckpt.step
    if step is None:  # final_model, step_300-ws4: the manifest knows the step
        man = _manifest(ckpt.part(ckpt.model_part))
        step = man.step if man is not None else None
    return RunEntry(ckpt.name, ckpt.url, step, status, report.world_size, size, mtime,
                    problems=tuple(f.message for f in report.errors))

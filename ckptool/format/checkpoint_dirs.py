"""Finding checkpoints on disk: which folder is a checkpoint, of which layout, committed or not.

Layouts recognised:

* a plain DCP folder (``.metadata`` + ``*.distcp``);
* run folders holding ``step_N/`` (ckptool), ``step-N/`` (torchtitan) or ``checkpoint_N`` /
  ``checkpoint-N`` (Accelerate, HF Trainer) checkpoint folders;
* Accelerate ``save_state`` output: a folder with ``pytorch_model_fsdp_0/`` (model) and
  ``optimizer_0/`` (optimizer), each a DCP folder;
* DCP's safetensors storage (``HuggingFaceStorageWriter``, torchtitan's ``last_save_in_hf``
  final ``step-N``): ``.safetensors`` files, an index, no ``.metadata``
  (``safetensors_source.py``).

A checkpoint counts as *committed* only when every DCP part has its ``.metadata``: DCP writes
it last, with an atomic rename. A safetensors checkpoint is committed when its index parses
and every file it names exists (the index is written last), or, without an index, when its
one file or its ``save_distributed`` shards have well-formed headers. Whether a committed
checkpoint is also *valid* is ``ops.validate``'s business, not this module's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ckptool.errors import CheckpointNotFoundError, NoCheckpointError
from ckptool.storage import Entry, Storage

METADATA = ".metadata"
_STEP_RE = re.compile(r"(?:step|checkpoint)[_-](\d+)")
_ACCEL_PART_RE = re.compile(r"(?:pytorch_model_fsdp|optimizer)_\d+")


def step_of(name: str) -> int | None:
    """The step number in a checkpoint folder name (``step_100``, ``step-100``), else None."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointDir:
    """One checkpoint folder.

    Attributes:
        storage: the checkpoint folder.
        step: step parsed from the folder name, if it follows a known pattern.
        kind: ``"dcp"`` (one DCP folder), ``"accelerate"`` (several DCP parts) or
            ``"safetensors"`` (DCP's safetensors storage).
        parts: DCP folders relative to ``storage`` (``""`` for the folder itself).
        committed: every part has ``.metadata`` (for ``"safetensors"``: see the module doc).
        reason: why a safetensors checkpoint is not committed, else None.
    """

    storage: Storage
    step: int | None
    kind: str
    parts: tuple[str, ...]
    committed: bool
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def url(self) -> str:
        return self.storage.url

    def part(self, rel: str) -> Storage:
        return self.storage.child(rel) if rel else self.storage

    @property
    def model_part(self) -> str:
        """The part that holds model weights."""
        for p in self.parts:
            if p.startswith("pytorch_model_fsdp"):
                return p
        return self.parts[0]


def _has_distcp(entries: list[Entry]) -> bool:
    return any(e.name.endswith(".distcp") for e in entries if not e.is_dir)


def _has_step_dirs(entries: list[Entry]) -> bool:
    return any(e.is_dir and step_of(e.name) is not None for e in entries)


def classify(storage: Storage, entries: list[Entry] | None = None) -> CheckpointDir | None:
    """Describe ``storage`` as a checkpoint folder, or None if it is not one."""
    if entries is None:
        entries = storage.listdir()
    names = {e.name for e in entries}
    step = step_of(storage.name)
    if METADATA in names or _has_distcp(entries):
        return CheckpointDir(storage, step, "dcp", ("",), METADATA in names)
    parts = sorted(e.name for e in entries if e.is_dir and _ACCEL_PART_RE.fullmatch(e.name))
    if parts:
        committed = all(storage.exists(f"{p}/{METADATA}") for p in parts)
        return CheckpointDir(storage, step, "accelerate", tuple(parts), committed)
    from ckptool.format.safetensors_source import find_layout

    found = find_layout(storage, entries)
    if found is not None and not (found.mode == "single" and _has_step_dirs(entries)):
        # (a run folder that also holds some .safetensors file is still a run folder)
        return CheckpointDir(storage, step, "safetensors", ("",), found.committed, found.reason)
    if step is not None:
        # An empty or torn step folder (the save died before writing any file).
        return CheckpointDir(storage, step, "dcp", ("",), False)
    return None


def resolve_checkpoint(path: str | os.PathLike[str], *, latest_in_run: bool = True) -> CheckpointDir:
    """Open ``path`` as one checkpoint (committed or not).

    A run folder (one holding ``step_N`` folders) stands for its newest committed checkpoint
    when ``latest_in_run`` is true, so ``ckptool validate runs/demo`` checks the latest save.

    Raises:
        CheckpointNotFoundError: the path is missing or holds no checkpoint.
    """
    storage = Storage.open(path)
    if not storage.exists():
        raise CheckpointNotFoundError(
            f"{storage.url} does not exist", path=storage.url,
            hint="Check the path; 'ckptool ls RUN_DIR' lists the checkpoints of a run",
        )
    if not storage.isdir():
        raise CheckpointNotFoundError(
            f"{storage.url} is a file, not a checkpoint folder", path=storage.url,
            hint="Pass the folder that holds .metadata and the *.distcp files",
        )
    entries = storage.listdir()
    ckpt = classify(storage, entries)
    if ckpt is not None:
        return ckpt
    found = list_checkpoints(storage, entries)
    committed = [c for c in found if c.committed]
    if committed and latest_in_run:
        return committed[-1]
    if found:
        names = ", ".join(c.name for c in found[-3:])
        raise CheckpointNotFoundError(
            f"{storage.url} is a run folder with no committed checkpoint", path=storage.url,
            hint=f"Its checkpoints ({names}) are all incomplete; run 'ckptool ls {storage.url}'",
        )
    raise NoCheckpointError(
        f"{storage.url} holds no checkpoint (no .metadata, no *.distcp files, no "
        ".safetensors files)", path=storage.url,
        hint="Pass a DCP checkpoint folder such as runs/demo/step_100",
    )


def list_checkpoints(run: Storage | str | os.PathLike[str],
                     entries: list[Entry] | None = None) -> list[CheckpointDir]:
    """Every checkpoint folder directly inside ``run``, oldest step first.

    Folders that follow a step pattern are listed even when torn or empty; other folders are
    listed only if they look like a checkpoint. Temporary folders (``.name.tmp-*``) are skipped.
    """
    storage = run if isinstance(run, Storage) else Storage.open(run)
    if entries is None:
        if not storage.exists():
            raise CheckpointNotFoundError(
                f"{storage.url} does not exist", path=storage.url,
                hint="Pass the --out folder of a training run",
            )
        entries = storage.listdir()
    found = []
    for e in entries:
        if not e.is_dir or e.name.startswith("."):
            continue
        child = storage.child(e.name)
        ckpt = classify(child)
        if ckpt is not None:
            found.append(ckpt)
    return sorted(found, key=lambda c: (c.step if c.step is not None else -1, c.name))


def latest_committed(run: Storage | str | os.PathLike[str]) -> CheckpointDir | None:
    """The committed checkpoint with the highest step in ``run`` (not checked further)."""
    for ckpt in reversed(list_checkpoints(run)):
        if ckpt.committed:
            return ckpt
    return None

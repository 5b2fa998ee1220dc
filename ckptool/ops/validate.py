"""Prove a checkpoint on disk is complete: committed, geometry exact, every referenced byte there.

``validate(path)`` never raises on a bad checkpoint: problems come back as ``Finding``s in a
``Report`` (``report.ok`` is False when any has severity "error"). Structural checks read only
``.metadata`` and stat the files; ``deep=True`` also reads every item record, checks it parses
to the declared dtype and shape, and verifies every CRC-32 (and the manifest's checksums).

A safetensors checkpoint of DCP's ``HuggingFaceStorageWriter`` (no ``.metadata``) is checked
from its index and headers (``format/safetensors_source.py``): the same geometry and file
checks, and ``deep=True`` reads every byte. Its files carry no checksum, and the report says
so (a "note" finding).

Here: the walk over a checkpoint's parts and the structural checks of files, records and the
manifest. Chunk geometry is ``chunk_geometry.py``'s, the ``--deep`` byte checks
``deep_check.py``'s, the result types (``Report``, ``Finding``, ``Severity``) ``validate_report.py``'s.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptool.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeInputError,
)
from ckptool.format import manifest as mf
from ckptool.format.checkpoint_dirs import CheckpointDir, resolve_checkpoint
from ckptool.format.metadata import CheckpointMetadata, StorageRef, read_metadata
from ckptool.ops.chunk_geometry import check_geometry
from ckptool.ops.validate_report import Finding, Report, Severity
from ckptool.storage import Storage

if TYPE_CHECKING:
    from ckptool.format import safetensors_source as sts

__all__ = ["Finding", "Report", "Severity", "require_valid", "validate"]


def validate(path: str | os.PathLike[str] | CheckpointDir, *, deep: bool = False,
             world_size: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> Report:
    """Check that a checkpoint is complete and intact.

    Args:
        path: a checkpoint folder (DCP, ``step_N``, or Accelerate ``save_state`` output), local
            or an fsspec URL, or a ``CheckpointDir``.
        deep: also read every record: parse it, compare dtype and shape, verify CRC-32 and the
            manifest's checksums.
        world_size: if given, the rank count the checkpoint must have been saved with.
        progress: with ``deep``, called as ``progress(bytes_done, bytes_total)`` from the
            calling thread as files are read.

    Returns:
        A ``Report``; ``report.ok`` tells whether it is complete.

    Example:
        >>> report = validate("runs/demo/step_40", deep=True)
        >>> report.ok, [str(f) for f in report.findings]
    """
    if isinstance(path, CheckpointDir):
        ckpt = path
    else:
        try:
            ckpt = resolve_checkpoint(path)
        except CkptError as e:  # e.code: "empty" or "not-a-checkpoint"
            return Report(path=os.fspath(path),
                          findings=(Finding(Severity.ERROR, e.code, str(e), str(path)),))
    checkers = [_PartCheck(ckpt.part(part), deep, progress) for part in ckpt.parts]
    for checker in checkers:
        checker.run()
    findings = [f for c in checkers for f in c.findings]
    metas = {p: c.meta for p, c in zip(ckpt.parts, checkers) if c.meta is not None}
    ws = next((c.world_size for c in checkers if c.meta is not None and c.world_size), None)
    if world_size is not None and ws is not None and ws != world_size:
        findings.append(Finding(
            Severity.ERROR, "world-size",
            f"saved by {ws} ranks, expected {world_size}; load it with {ws} ranks (DCP reshards "
            f"at load time) or run 'ckptool reshard {ckpt.url} --to {world_size}'", ckpt.url))
    return Report(path=ckpt.url, step=ckpt.step, world_size=ws, committed=ckpt.committed,
                  deep=deep, tensors=sum(len(m.tensors) for m in metas.values()),
                  files=sum(c.nfiles for c in checkers),
                  total_bytes=sum(c.total_bytes for c in checkers),
                  findings=tuple(findings), metadata=metas)


def require_valid(ckpt: CheckpointDir, *, action: str) -> Report:
    """Structural ``validate`` for an op about to read ``ckpt``; raise its first problem.

    Args:
        ckpt: the checkpoint (only its ``parts`` are checked).
        action: the verb for the message, e.g. "consolidate".

    Raises:
        IncompleteCheckpointError: not committed ("incomplete").
        CheckpointNotFoundError: nothing there ("empty", "not-a-checkpoint").
        CorruptCheckpointError: any other error finding; the message says how many more.
    """
    report = validate(ckpt)
    if report.ok:
        return report
    first, more = report.errors[0], len(report.errors) - 1
    cls = {"incomplete": IncompleteCheckpointError, "empty": CheckpointNotFoundError,
           "not-a-checkpoint": CheckpointNotFoundError}.get(first.code, CorruptCheckpointError)
    extra = (f" (and {more} more problem{'s' * (more > 1)}; 'ckptool validate {ckpt.url}' lists "
             "them)") if more else ""
    where = "" if ckpt.url in first.message else f" {ckpt.url}"
    raise cls(f"cannot {action}{where}: {first.message}{extra}", path=ckpt.url)


class _PartCheck:
    """All checks of one DCP folder; collects findings instead of raising."""

    def __init__(self, storage: Storage, deep: bool,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.st = storage
        self.deep = deep
        self.progress = progress
        self.findings: list[Finding] = []
        self.meta: CheckpointMetadata | None = None
        self.world_size: int | None = None
        self.total_bytes = 0
        self.nfiles = 0
        self.sizes: dict[str, int] = {}
        self.found: sts.Found | None = None  # a safetensors checkpoint's layout

    def add(self, code: str, message: str, *, fqn: str | None = None, rel: str | None = None,
            severity: Severity = Severity.ERROR) -> None:
        where = self.st.url_of(rel) if rel else self.st.url
        self.findings.append(Finding(severity, code, message, where, fqn))

    def run(self) -> None:
        entries = self.st.listdir()
        self.sizes = {e.name: e.size for e in entries if not e.is_dir}
        self.total_bytes = sum(self.sizes.values())
        self.nfiles = len(self.sizes)
        found = None
        if ".metadata" not in self.sizes and not any(e.name == ".metadata" for e in entries):
            from ckptool.format import safetensors_source as sts

            found = sts.find_layout(self.st, entries)
        if found is not None:
            self._read_safetensors(found)
        elif ".metadata" not in self.sizes and not any(e.name == ".metadata" for e in entries):
            n = sum(1 for name in self.sizes if name.endswith(".distcp"))
            if not entries:
                self.add("empty", f"{self.st.url} is empty: it holds no checkpoint (no .metadata, "
                         "no .distcp files); the save never started or the folder was cleared")
                return
            self.add("incomplete", f"no .metadata in {self.st.url}: the save was interrupted "
                     f"({n} .distcp files present); resume from an earlier checkpoint")
            return
        else:
            try:
                self.meta = read_metadata(self.st)
            except CkptError as e:
                code = e.code if isinstance(e, UnsafeInputError) else "bad-metadata"
                self.add(code, str(e), rel=".metadata")
                return
        if self.meta is None:
            return
        self.world_size = self.meta.world_size
        self._check_files()
        if found is not None:  # its files may sit in sharded/
            self.total_bytes, self.nfiles = sum(self.sizes.values()), len(self.sizes)
        for t in self.meta.tensors.values():
            check_geometry(t, self.add)
        for o in self.meta.objects.values():
            if o.storage is None:
                self.add("missing-storage", f"{o.fqn} has no storage entry in .metadata", fqn=o.fqn)
        self._check_manifest()
        if self.deep and self.meta is not None:
            from ckptool.ops.deep_check import DeepCheck  # (threads, mappings: --deep only)

            self.findings += DeepCheck(self, self._records_by_file(), self.progress).run()

    def _read_safetensors(self, found: sts.Found) -> None:
        """The index of a safetensors checkpoint, or its first problem as a finding."""
        from ckptool.format import safetensors_source as sts

        self.found = found
        try:
            self.meta = sts.read_index(self.st, found)
        except CkptError as e:
            self.add(getattr(e, "code", "bad-index"), str(e))
            return
        self.add("no-checksum", sts.NO_CHECKSUM if self.deep else "safetensors files carry no "
                 "checksum: damaged values cannot be detected; --deep reads every byte",
                 severity=Severity.NOTE)
        if found.mode == "sharded":
            self.add("inferred-shapes", "save_distributed shards without a consolidated copy: "
                     "DCP records no global shapes or rank count there, so shapes are the extent "
                     "of the shards found (a missing last rank could not be noticed)",
                     severity=Severity.NOTE)

    # -- files --------------------------------------------------------------------------------
    def _check_files(self) -> None:
        assert self.meta is not None
        self.safe_files: set[str] = set()
        for rel in self.meta.files():
            problem = _unsafe_path(rel)
            if problem is None and not self.st.realpath_inside(rel):
                problem = "a symlink leading out of the checkpoint folder"
            if problem is not None:
                self.add("path-outside", f"storage path {rel!r} is {problem}; refusing to read it "
                         "(possibly malicious)", rel=None)
                continue
            if self.st.isdir(rel):
                self.add("not-a-file", f"{rel} is a folder, not a .distcp file", rel=rel)
                continue
            if rel not in self.sizes and not self.st.exists(rel):
                self.add("missing-file", f"{rel} is missing (referenced by .metadata); the "
                         "checkpoint cannot be loaded without it", rel=rel)
                continue
            self.sizes.setdefault(rel, self.st.size(rel))
            self.safe_files.add(rel)
        for rel, refs in self._records_by_file().items():
            self._check_records(rel, refs)
        referenced = set(self.meta.files())
        for name in sorted(self.sizes):
            if name.endswith(".distcp") and name not in referenced:
                self.add("unreferenced-file", f"{name} is not referenced by .metadata (left over "
                         "from another save?)", rel=name, severity=Severity.WARNING)

    def _records_by_file(self) -> dict[str, list[tuple[StorageRef, str]]]:
        """(record, fqn) pairs of every file that is safe to read, by file."""
        assert self.meta is not None
        by_file: dict[str, list[tuple[StorageRef, str]]] = defaultdict(list)
        for fqn, ref in _refs(self.meta):
            if ref.relative_path in self.safe_files:
                by_file[ref.relative_path].append((ref, fqn))
        return by_file

    def _check_records(self, rel: str, refs: list[tuple[StorageRef, str]]) -> None:
        size = self.sizes[rel]
        refs.sort(key=lambda r: r[0].offset)
        end_prev, fqn_prev = 0, None
        for ref, fqn in refs:
            if ref.offset + ref.length > size:
                self.add("truncated-file", f"{rel} is {size} bytes but {fqn} needs bytes "
                         f"{ref.offset}..{ref.offset + ref.length}; the file was truncated",
                         fqn=fqn, rel=rel)
            if ref.offset < end_prev:
                self.add("record-overlap", f"{fqn} and {fqn_prev} claim overlapping bytes of {rel}",
                         fqn=fqn, rel=rel)
            end_prev, fqn_prev = max(end_prev, ref.offset + ref.length), fqn

    # -- manifest -----------------------------------------------------------------------------
    def _check_manifest(self) -> None:
        try:
            self.manifest = mf.read_manifest(self.st)
        except CkptError as e:
            self.manifest = None
            self.add("bad-manifest", str(e), rel=mf.MANIFEST)
            return
        if self.manifest is None:
            return
        if self.manifest.world_size and self.world_size is None:
            self.world_size = self.manifest.world_size
        for rel, info in sorted(self.manifest.files.items()):
            if rel not in self.sizes:
                if _unsafe_path(rel) is None and self.st.exists(rel):
                    continue
                self.add("missing-file", f"{rel} is listed in {mf.MANIFEST} but missing", rel=rel)
            elif self.sizes[rel] != info["size"]:
                self.add("manifest-size", f"{rel} is {self.sizes[rel]} bytes, {mf.MANIFEST} "
                         f"recorded {info['size']}: the file changed after the save", rel=rel)


def _refs(meta: CheckpointMetadata) -> list[tuple[str, StorageRef]]:
    out = [(t.fqn, c.storage) for t in meta.tensors.values() for c in t.chunks if c.storage]
    out += [(o.fqn, o.storage) for o in meta.objects.values() if o.storage]
    return out


def _unsafe_path(rel: str) -> str | None:
    if rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        return "an absolute path"
    parts = rel.replace("\\", "/").split("/")
    if ".." in parts:
        return "a path leading out of the checkpoint folder ('..')"
    if "\x00" in rel:
        return "not a valid file name"
    return None

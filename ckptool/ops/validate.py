"""Prove a checkpoint on disk is complete: committed, geometry exact, every referenced byte there.

``validate(path)`` never raises on a bad checkpoint: problems come back as ``Finding``s in a
``Report`` (``report.ok`` is False when any has severity "error"). Structural checks read only
``.metadata`` and stat the files; ``deep=True`` also reads every item record, checks it parses
to the declared dtype and shape, and verifies every CRC-32 (and the manifest's checksums).

A safetensors checkpoint of DCP's ``HuggingFaceStorageWriter`` (no ``.metadata``) is checked
from its index and headers (``format/safetensors_source.py``): the same geometry and file
checks, and ``deep=True`` reads every byte. Its files carry no checksum, and the report says
so (a "note" finding).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from ckptool.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeInputError,
)
from ckptool.format import manifest as mf
from ckptool.format.torch_records import RecordReader, RecordTemplate, TensorLocation
from ckptool.format.checkpoint_dirs import CheckpointDir, resolve_checkpoint
from ckptool.format.metadata import CheckpointMetadata, StorageRef, TensorEntry, read_metadata
from ckptool.format import safetensors_source as sts
from ckptool.format.reader import CheckpointReader
from ckptool.storage import BLOCK, RangeReader, Storage

MAX_GRID_CELLS = 1 << 20
#: --deep reads records up to this size in one call (fewer syscalls for many small tensors).
DEEP_PRELOAD = 1 << 20
#: Records up to this size may serve as a layout template (per-record overhead only matters
#: for small records); at most MAX_TEMPLATES per file, so memory stays bounded.
TEMPLATE_MAX_BYTES = 256 << 10
MAX_TEMPLATES = 16


@dataclass(frozen=True)
class Finding:
    """One problem. ``code`` is stable (for scripts); ``message`` is for people."""

    severity: str  # "error" | "warning" | "note" (a fact worth knowing, not a problem)
    code: str
    message: str
    path: str | None = None
    fqn: str | None = None

    def __str__(self) -> str:
        return f"{self.severity}: {self.code}: {self.message}"


@dataclass(frozen=True)
class Report:
    path: str
    step: int | None = None
    world_size: int | None = None
    committed: bool = False
    deep: bool = False
    tensors: int = 0
    files: int = 0
    total_bytes: int = 0
    findings: tuple[Finding, ...] = ()
    metadata: dict[str, CheckpointMetadata] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]


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
        except CkptError as e:
            code = e.code  # "empty" or "not-a-checkpoint"
            return Report(path=os.fspath(path), findings=(Finding("error", code, str(e), str(path)),))
    findings: list[Finding] = []
    metas: dict[str, CheckpointMetadata] = {}
    total = nfiles = ntensors = 0
    ws: int | None = None
    for part in ckpt.parts:
        checker = _PartCheck(ckpt.part(part), deep, progress)
        checker.run()
        findings += checker.findings
        if checker.meta is not None:
            metas[part] = checker.meta
            ntensors += len(checker.meta.tensors)
            ws = ws or checker.world_size
        total += checker.total_bytes
        nfiles += checker.nfiles
    if world_size is not None and ws is not None and ws != world_size:
        findings.append(Finding(
            "error", "world-size",
            f"saved by {ws} ranks, expected {world_size}; load it with {ws} ranks (DCP reshards "
            f"at load time) or run 'ckptool reshard {ckpt.url} --to {world_size}'", ckpt.url))
    return Report(path=ckpt.url, step=ckpt.step, world_size=ws, committed=ckpt.committed,
                  deep=deep, tensors=ntensors, files=nfiles, total_bytes=total,
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
            severity: str = "error") -> None:
        where = self.st.url_of(rel) if rel else self.st.url
        self.findings.append(Finding(severity, code, message, where, fqn))

    def run(self) -> None:
        entries = self.st.listdir()
        self.sizes = {e.name: e.size for e in entries if not e.is_dir}
        self.total_bytes = sum(self.sizes.values())
        self.nfiles = len(self.sizes)
        found = None
        if ".metadata" not in self.sizes and not any(e.name == ".metadata" for e in entries):
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
            self._check_geometry(t)
        for o in self.meta.objects.values():
            if o.storage is None:
                self.add("missing-storage", f"{o.fqn} has no storage entry in .metadata", fqn=o.fqn)
        self._check_manifest()
        if self.deep and self.meta is not None:
            self._deep()

    def _read_safetensors(self, found: sts.Found) -> None:
        """The index of a safetensors checkpoint, or its first problem as a finding."""
        self.found = found
        try:
            self.meta = sts.read_index(self.st, found)
        except CkptError as e:
            self.add(getattr(e, "code", "bad-index"), str(e))
            return
        self.add("no-checksum", sts.NO_CHECKSUM if self.deep else "safetensors files carry no "
                 "checksum: damaged values cannot be detected; --deep reads every byte",
                 severity="note")
        if found.mode == "sharded":
            self.add("inferred-shapes", "save_distributed shards without a consolidated copy: "
                     "DCP records no global shapes or rank count there, so shapes are the extent "
                     "of the shards found (a missing last rank could not be noticed)",
                     severity="note")

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
        by_file: dict[str, list[tuple[StorageRef, str]]] = defaultdict(list)
        for fqn, ref in _refs(self.meta):
            if ref.relative_path in self.safe_files:
                by_file[ref.relative_path].append((ref, fqn))
        for rel, refs in by_file.items():
            self._check_records(rel, refs)
        referenced = set(self.meta.files())
        for name in sorted(self.sizes):
            if name.endswith(".distcp") and name not in referenced:
                self.add("unreferenced-file", f"{name} is not referenced by .metadata (left over "
                         "from another save?)", rel=name, severity="warning")

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

    # -- geometry -------------------------------------------------------------------------------
    def _check_geometry(self, t: TensorEntry) -> None:
        shape = t.shape
        inside = []
        for c in t.chunks:
            if c.storage is None:
                self.add("missing-storage", f"{t.fqn}: chunk at {list(c.offsets)} has no storage "
                         "entry in .metadata", fqn=t.fqn)
            if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
                self.add("chunk-out-of-bounds", f"{t.fqn}: chunk {_box(c.offsets, c.sizes)} lies "
                         f"outside the tensor's shape {list(shape)}", fqn=t.fqn)
            elif c.storage is not None and c.storage.length < c.numel * t.dtype.itemsize:
                self.add("record-too-small", f"{t.fqn}: chunk {_box(c.offsets, c.sizes)} needs "
                         f"{c.numel * t.dtype.itemsize} bytes but its record is {c.storage.length}",
                         fqn=t.fqn)
            else:
                inside.append(c)
        overlap = _first_overlap(inside)
        if overlap is not None:
            a, b = overlap
            lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
            hi = tuple(min(x + s, y + z) for x, s, y, z in zip(a.offsets, a.sizes, b.offsets, b.sizes))
            self.add("chunk-overlap", f"{t.fqn}: region {_box(lo, tuple(h - l for l, h in zip(lo, hi)))}"
                     f" is saved twice (chunks at {list(a.offsets)} and {list(b.offsets)})", fqn=t.fqn)
            return
        covered = sum(c.numel for c in inside)
        if covered < t.numel and len(inside) == len(t.chunks):
            self.add("chunk-gap", f"{t.fqn}: {t.numel - covered} of {t.numel} elements are in no "
                     f"chunk, first missing region {_missing_region(shape, inside)}", fqn=t.fqn)

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

    # -- deep ---------------------------------------------------------------------------------
    def _deep(self) -> None:
        assert self.meta is not None
        by_file: dict[str, list[tuple[StorageRef, str]]] = defaultdict(list)
        for fqn, ref in _refs(self.meta):
            if ref.relative_path in self.safe_files:
                by_file[ref.relative_path].append((ref, fqn))
        jobs = sorted(by_file.items())
        workers = max(1, min(len(jobs), os.cpu_count() or 1, 4))  # pread and CRC-32 drop the GIL
        total, done = sum(self.sizes[rel] for rel, _ in jobs), 0
        with ThreadPoolExecutor(workers) as pool:
            futs = {pool.submit(self._deep_file, rel, refs): rel for rel, refs in jobs}
            results = {}
            for fut in as_completed(futs):
                results[futs[fut]] = fut.result()
                done += self.sizes[futs[fut]]
                if self.progress is not None:
                    self.progress(done, total)
        for rel, _ in jobs:  # findings in file order, whatever finished first
            self.findings.extend(results[rel])
        if self.manifest is not None:
            self._deep_manifest()
        if self.found is not None and self.found.copy and self.ok_so_far():
            self._deep_copy()

    def ok_so_far(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def _deep_copy(self) -> None:
        """The consolidated copy beside ``sharded/`` must hold the bytes of the saved shards."""
        assert self.meta is not None and self.found is not None
        copy = sts.read_copy(self.st, self.found)
        with CheckpointReader(self.st, self.meta) as ck:
            for name, t in self.meta.tensors.items():
                rel, c = copy[name]
                if _copy_differs(ck, t, ck.reader(rel), c.start):
                    why = " (torch's consolidation writes a 0-dim tensor as zeros)" if not t.shape else ""
                    self.add("copy-differs", f"{rel} holds {name} with other values than the "
                             f"shards DCP saved in {sts.SHARDED_DIR}/{why}; ckptool reads the "
                             "shards, but loading this folder's consolidated files gives wrong "
                             "values", fqn=name, rel=rel, severity="warning")

    def _deep_file(self, rel: str, refs: list[tuple[StorageRef, str]]) -> list[Finding]:
        assert self.meta is not None
        found: list[Finding] = []
        size = self.sizes[rel]
        templates: dict[int, RecordTemplate] = {}  # record length -> verified layout
        with self.st.reader(rel) as reader:
            for ref, fqn in sorted(refs, key=lambda r: r[0].offset):
                if ref.offset + ref.length > size:
                    continue  # already reported as truncated
                if ref.raw:
                    found += self._deep_raw(reader, rel, ref, fqn)
                    continue
                try:
                    tpl = templates.get(ref.length) if fqn in self.meta.tensors else None
                    if tpl is not None:  # the fast path: same layout as a verified record
                        buf = reader.pread(ref.offset, ref.length)
                        if tpl.matches(buf):
                            where = f"{self.st.url_of(rel)} (item {fqn})"
                            if not tpl.crc_ok(buf):
                                raise ChecksumError(
                                    f"{where}: CRC-32 mismatch in the tensor data: the bytes are "
                                    "damaged", path=where)
                            self._compare_location(tpl.loc, fqn, ref, where)
                            continue
                    where = f"{self.st.url_of(rel)} (item {fqn})"
                    rec = RecordReader(reader, ref, where, preload=DEEP_PRELOAD)
                    if fqn in self.meta.objects:
                        rec.load_object()
                    else:
                        loc = self._compare(rec, fqn, ref)
                    rec.verify_crc()
                    if (fqn in self.meta.tensors and rec._buf is not None
                            and ref.length <= TEMPLATE_MAX_BYTES and len(templates) < MAX_TEMPLATES):
                        templates.setdefault(ref.length, RecordTemplate(rec, loc, rec._buf))
                except CkptError as e:
                    code = e.code if isinstance(e, (ChecksumError, UnsafeInputError)) else "bad-record"
                    found.append(Finding("error", code, str(e), self.st.url_of(rel), fqn))
        return found

    def _deep_raw(self, reader: RangeReader, rel: str, ref: StorageRef, fqn: str) -> list[Finding]:
        """A safetensors range has no checksum: check every byte of it can be read."""
        pos, end = ref.offset, ref.offset + ref.length
        while pos < end:
            n = min(BLOCK, end - pos)
            got = len(reader.pread(pos, n))
            if got != n:
                return [Finding("error", "truncated-file", f"{self.st.url_of(rel)} (tensor {fqn}) "
                                f"ends at byte {pos + got}, its data needs bytes up to {end}",
                                self.st.url_of(rel), fqn)]
            pos += n
        return []

    def _compare(self, rec: RecordReader, fqn: str, ref: StorageRef) -> TensorLocation:
        loc = rec.tensor()
        self._compare_location(loc, fqn, ref, rec.where)
        return loc

    def _compare_location(self, loc: TensorLocation, fqn: str, ref: StorageRef, where: str) -> None:
        assert self.meta is not None
        t = self.meta.tensors[fqn]
        chunk = next(c for c in t.chunks if c.storage == ref)
        problem = None
        if loc.dtype != t.dtype:
            problem = f"record holds {loc.dtype} but .metadata declares {t.dtype}"
        elif loc.shape != chunk.sizes:
            problem = f"record holds shape {list(loc.shape)} but the chunk is {list(chunk.sizes)}"
        if problem:
            raise CorruptCheckpointError(f"{where}: {problem}", path=where,
                                         hint="The file is damaged; use an earlier checkpoint")

    def _deep_manifest(self) -> None:
        assert self.manifest is not None
        for rel, info in sorted(self.manifest.files.items()):
            want = info.get(mf.CHECKSUM)
            if want is None or rel not in self.sizes or self.sizes[rel] != info["size"]:
                continue
            _, got = mf.file_checksum(self.st, rel)
            if got != want:
                self.add("manifest-checksum", f"{rel} does not match the checksum in "
                         f"{mf.MANIFEST} ({mf.CHECKSUM} {got} != {want}): the bytes changed "
                         "after the save", rel=rel)


def _copy_differs(ck: CheckpointReader, t: TensorEntry, copy: RangeReader, start: int) -> bool:
    """Do the row-major bytes of ``t`` differ from ``copy``'s bytes at ``start``?"""
    blocks = t.row_blocks()
    if blocks is None:  # any other chunk layout: assemble the tensor (memory: one tensor)
        import numpy as np

        item = np.dtype(f"V{t.dtype.itemsize}")
        full = np.zeros(t.shape, item)
        for c in t.chunks:
            if c.numel:
                idx = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))
                full[idx] = np.frombuffer(ck.read_chunk(t, c), item).reshape(c.sizes)
        return copy.pread(start, t.nbytes) != full.tobytes()
    row = math.prod(t.shape[1:]) * t.dtype.itemsize
    for c in blocks:
        cb = ck.locate(t, c)
        base = start + (c.offsets[0] if c.offsets else 0) * row
        for pos in range(0, cb.nbytes, BLOCK):
            n = min(BLOCK, cb.nbytes - pos)
            if cb.reader.pread(cb.start + pos, n) != copy.pread(base + pos, n):
                return True
    return False


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


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _first_overlap(chunks: list) -> tuple | None:
    """A pair of chunks that share at least one element, else None (sweep along dim 0)."""
    live = [c for c in chunks if c.numel > 0]
    if not live or not live[0].offsets:
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda c: c.offsets)
    for i, a in enumerate(live):
        a_end = a.offsets[0] + a.sizes[0]
        for b in live[i + 1:]:
            if b.offsets[0] >= a_end:
                break
            if all(bo < ao + asz and ao < bo + bsz
                   for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return a, b
    return None


def _missing_region(shape: tuple[int, ...], chunks: list) -> str:
    """Name one box of the tensor that no chunk covers (coordinate-compressed grid)."""
    if not shape:
        return "[] (the scalar itself)"
    cuts = []
    for d, n in enumerate(shape):
        points = {0, n}
        for c in chunks:
            points |= {c.offsets[d], c.offsets[d] + c.sizes[d]}
        cuts.append(sorted(p for p in points if 0 <= p <= n))
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        return "(too fragmented to name)"
    import itertools

    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        if not any(all(o <= x < o + s for x, o, s in zip(lo, c.offsets, c.sizes)) for c in chunks):
            hi = tuple(cuts[d][i + 1] for d, i in enumerate(idx))
            return _box(lo, tuple(h - l for l, h in zip(lo, hi)))
    return "(none found)"

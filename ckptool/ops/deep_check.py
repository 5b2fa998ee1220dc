"""``validate --deep``: read every record, parse it, compare it with ``.metadata``, verify its CRC-32.

One worker per file (CRC-32 and the page-cache reads run without the GIL). A local file is
mapped (``format/mapped_file.py``): CRC-32 reads the cached pages in place, no copy. A tensor
record laid out like one already verified in full (in any file: rank r's chunk of a tensor is
laid out like rank r+1's) is checked against that one's template (``RecordTemplate`` without
its data): its bytes outside the data compared, its data's CRC-32 computed. Then the
manifest's checksums, and a safetensors checkpoint's consolidated copy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING

from ckptool.errors import (
    ChecksumError,
    CkptError,
    CorruptCheckpointError,
    UnsafeInputError,
)
from ckptool.format import manifest as mf
from ckptool.format.mapped_file import MappedFile
from ckptool.format.metadata import StorageRef, TensorEntry
from ckptool.format.torch_records import RecordReader, RecordTemplate, TensorLocation, record_outside
from ckptool.format.zip_records import range_crc
from ckptool.ops.validate_report import Finding, Severity
from ckptool.storage import BLOCK, RangeReader

if TYPE_CHECKING:
    from ckptool.format.reader import CheckpointReader
    from ckptool.ops.validate import _PartCheck

#: --deep reads records up to this size in one call where the file is not mapped (fewer
#: syscalls, or requests, for many small tensors).
DEEP_PRELOAD = 1 << 20
#: A record whose bytes outside its tensor data are at most this many may serve as a layout
#: template; at most MAX_TEMPLATES of them (one per record length), so memory stays bounded.
TEMPLATE_MAX_BYTES = 64 << 10
MAX_TEMPLATES = 256

Refs = list[tuple[StorageRef, str]]


class DeepCheck:
    """The deep checks of one DCP folder whose structure ``_PartCheck`` has checked."""

    def __init__(self, part: _PartCheck, by_file: dict[str, Refs],
                 progress: Callable[[int, int], None] | None) -> None:
        assert part.meta is not None
        self.part = part
        self.st = part.st
        self.meta = part.meta
        self.by_file = by_file
        self.progress = progress
        #: record length -> the verified layout of a tensor record that long (all files)
        self.templates: dict[int, RecordTemplate] = {}

    def run(self) -> list[Finding]:
        """Findings of every file (in file order), then of the manifest and the copy."""
        jobs = sorted(self.by_file.items())
        sizes = self.part.sizes
        workers = max(1, min(len(jobs), os.cpu_count() or 1, 4))
        total, done = sum(sizes[rel] for rel, _ in jobs), 0
        results: dict[str, list[Finding]] = {}
        with ThreadPoolExecutor(workers) as pool:
            futs = {pool.submit(self._file, rel, refs): rel for rel, refs in jobs}
            for fut in as_completed(futs):
                results[futs[fut]] = fut.result()
                done += sizes[futs[fut]]
                if self.progress is not None:
                    self.progress(done, total)
        findings = [f for rel, _ in jobs for f in results[rel]]
        if self.part.manifest is not None:
            findings += self._manifest()
        found = self.part.found
        if found is not None and found.copy and not any(
                f.severity is Severity.ERROR for f in self.part.findings + findings):
            findings += self._copy()
        return findings

    def _file(self, rel: str, refs: Refs) -> list[Finding]:
        """Every record of one file, in file order; a record's first problem is its finding."""
        size = self.part.sizes[rel]
        found: list[Finding] = []
        with self.st.reader(rel) as reader:
            mapped = MappedFile.open(reader.fileno)
            try:
                for ref, fqn in sorted(refs, key=lambda r: r[0].offset):
                    if ref.offset + ref.length > size:
                        continue  # already reported as truncated
                    if ref.raw:
                        found += self._raw(reader, rel, ref, fqn)
                        continue
                    try:
                        self._record(reader, mapped, rel, ref, fqn)
                    except CkptError as e:
                        code = e.code if isinstance(e, (ChecksumError, UnsafeInputError)) \
                            else "bad-record"
                        found.append(Finding(Severity.ERROR, code, str(e), self.st.url_of(rel),
                                             fqn))
            finally:
                if mapped is not None:
                    mapped.close()
        return found

    def _record(self, reader: RangeReader, mapped: MappedFile | None, rel: str,
                ref: StorageRef, fqn: str) -> None:
        """Check one record; raise its first problem."""
        where = f"{self.st.url_of(rel)} (item {fqn})"
        is_tensor = fqn in self.meta.tensors
        if mapped is not None:
            view = mapped.view(ref.offset, ref.length)
        elif ref.length <= DEEP_PRELOAD:  # one read for the whole record
            view = memoryview(reader.pread(ref.offset, ref.length))
        else:
            view = None
        tpl = self.templates.get(ref.length) if is_tensor else None
        if tpl is not None and self._like(tpl, reader, mapped, view, ref, where):
            self._compare_location(tpl.loc, fqn, ref, where)
            return
        rec = RecordReader(reader, ref, where, view=view,
                           resident=mapped.resident if mapped is not None else None)
        if not is_tensor:
            rec.load_object()
            rec.verify_crc()
            return
        loc = rec.tensor()
        self._compare_location(loc, fqn, ref, where)
        rec.verify_crc()
        if len(self.templates) < MAX_TEMPLATES and ref.length not in self.templates:
            outside = record_outside(reader, ref, loc.data_offset - ref.offset, loc.entry.size,
                                     view)
            if outside is not None and len(outside) <= TEMPLATE_MAX_BYTES:
                self.templates.setdefault(
                    ref.length, RecordTemplate(rec, loc, outside, data_left_out=True))

    def _like(self, tpl: RecordTemplate, reader: RangeReader, mapped: MappedFile | None,
              view: memoryview | None, ref: StorageRef, where: str) -> bool:
        """Is the record laid out like the verified ``tpl``, but for its data and serialization
        id (whose CRC-32s must then agree)? Then its data's CRC-32 is checked here (a mismatch
        raises); False: it is to be parsed in full."""
        size = tpl.loc.entry.size
        outside = record_outside(reader, ref, tpl.data_start, size, view)
        if outside is None or not tpl.matches(outside) or not tpl.crc_ok(outside):
            return False
        view_at = None
        if view is not None:
            view_at = lambda pos, n: view[pos - ref.offset:pos - ref.offset + n]  # noqa: E731
        try:
            crc = range_crc(reader, ref.offset + tpl.data_start, size, view_at=view_at,
                            resident=mapped.resident if mapped is not None else None)
        except EOFError:
            return False  # the full parse says where the file ends
        if crc != tpl.data_crc(outside):
            raise ChecksumError(f"{where}: CRC-32 mismatch in the tensor data: the bytes are "
                                "damaged", path=where)
        return True

    def _raw(self, reader: RangeReader, rel: str, ref: StorageRef, fqn: str) -> list[Finding]:
        """A safetensors range has no checksum: check every byte of it can be read."""
        pos, end = ref.offset, ref.offset + ref.length
        while pos < end:
            n = min(BLOCK, end - pos)
            got = len(reader.pread(pos, n))
            if got != n:
                return [Finding(Severity.ERROR, "truncated-file",
                                f"{self.st.url_of(rel)} (tensor {fqn}) ends at byte {pos + got}, "
                                f"its data needs bytes up to {end}", self.st.url_of(rel), fqn)]
            pos += n
        return []

    def _compare_location(self, loc: TensorLocation, fqn: str, ref: StorageRef, where: str) -> None:
        """The record's dtype and shape must be the ones ``.metadata`` declares for the chunk."""
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

    def _manifest(self) -> list[Finding]:
        """Every file the manifest gives a checksum must still have it."""
        manifest, sizes, out = self.part.manifest, self.part.sizes, []
        assert manifest is not None
        for rel, info in sorted(manifest.files.items()):
            want = info.get(mf.CHECKSUM)
            if want is None or rel not in sizes or sizes[rel] != info["size"]:
                continue
            _, got = mf.file_checksum(self.st, rel)
            if got != want:
                out.append(Finding(
                    Severity.ERROR, "manifest-checksum", f"{rel} does not match the checksum in "
                    f"{mf.MANIFEST} ({mf.CHECKSUM} {got} != {want}): the bytes changed after the "
                    "save", self.st.url_of(rel)))
        return out

    def _copy(self) -> list[Finding]:
        """The consolidated copy beside ``sharded/`` must hold the bytes of the saved shards."""
        from ckptool.format import safetensors_source as sts
        from ckptool.format.reader import CheckpointReader

        found = self.part.found
        assert found is not None
        copy, out = sts.read_copy(self.st, found), []
        with CheckpointReader(self.st, self.meta) as ck:
            for name, t in self.meta.tensors.items():
                rel, c = copy[name]
                if _copy_differs(ck, t, ck.reader(rel), c.start):
                    why = " (torch's consolidation writes a 0-dim tensor as zeros)" if not t.shape else ""
                    out.append(Finding(
                        Severity.WARNING, "copy-differs", f"{rel} holds {name} with other values "
                        f"than the shards DCP saved in {sts.SHARDED_DIR}/{why}; ckptool reads the "
                        "shards, but loading this folder's consolidated files gives wrong values",
                        self.st.url_of(rel), name))
        return out


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

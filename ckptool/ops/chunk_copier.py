"""Moving a consolidate plan's chunk bytes into the safetensors output files, on worker threads.

A ``Piece`` maps one row-block chunk (FSDP2 ``Shard(0)``) to one contiguous range of an output
file; ``whole`` pieces are tensors saved in other boxes, assembled in memory one at a time.
``Copier.run`` opens the outputs and runs the jobs (``copy_engine.run_jobs``):

- local source, bytes as saved: per source file, front to back, an in-kernel copy job
  (``copy_file_range``) and, when CRC-32s are checked, a check job reading the same file beside
  it, so the two overlap on two cores;
- local source, bytes through Python (a cast, ``verify``): per file one job reads each block
  once (``row_source.read_blocks``): CRC, cast, positioned write;
- remote source: the records are located (a job per file), then the bytes are read as jobs
  of one ranged request each (``REMOTE_BLOCK``: a block of a big record, or several small
  records in a row), written at their output offsets, so ``workers`` requests run at once;
  the blocks' CRC-32s are combined per record (``crc32_combine``) and checked at the end.

Memory: one block (plus its cast) per worker, and one full tensor for non-row-block layouts.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptool.errors import ChecksumError, CorruptCheckpointError
from ckptool.format.copy_engine import Progress, Ticker, run_jobs
from ckptool.format.crc import crc32, crc32_combine
from ckptool.format.dtypes import DType
from ckptool.format.metadata import Chunk, TensorEntry
from ckptool.format.reader import CheckpointReader, ChunkBytes, rowmajor
from ckptool.format.row_source import ByteRange, blocks_of, read_block, read_blocks
from ckptool.format.safetensors_writer import FileLayout, OutputFile, cast_bytes
from ckptool.storage import BLOCK

#: Parallel ranged requests for a remote source, and the most bytes each asks for: at most
#: 8 x 16 MiB in flight.
REMOTE_WORKERS = 8
REMOTE_BLOCK = 16 << 20
#: The most bytes between two records' data that one remote request reads over (headers).
_GAP = 256 << 10
#: How far ahead of an in-kernel copy the source is asked for.
READ_AHEAD = 4 * BLOCK
_FADVISE = hasattr(os, "posix_fadvise")


@dataclass(frozen=True)
class Piece:
    """Bytes of one chunk -> one contiguous range of an output file."""

    tensor: TensorEntry
    chunk: Chunk
    out: int          # index of the output file
    offset: int       # absolute offset in that file
    out_dtype: DType


@dataclass(frozen=True)
class _Part:
    """Bytes of a remote piece's record to read: ``check``: its CRC-32 counts for the record."""

    piece: int
    span: ByteRange
    check: bool


@dataclass(frozen=True)
class _Fetch:
    """One ranged request of a remote file: ``span`` covers ``parts`` (consecutive in the file,
    gaps of headers between them), at most ``REMOTE_BLOCK`` bytes."""

    span: ByteRange
    parts: tuple[_Part, ...]


class Copier:
    """Moves chunk bytes into open output files (see the module docstring for the jobs).

    ``inline``: the bytes pass through Python (a cast or ``verify``); ``track``: every write
    is hashed so ``OutputFile.verify`` can re-read it. Worker threads share ``ck``'s readers
    (opened here first): ``pread`` keeps no position, locally or remotely.
    """

    def __init__(self, ck: CheckpointReader, *, check_crc: bool, track: bool, inline: bool) -> None:
        self.ck, self.check_crc, self.track, self.inline = ck, check_crc, track, inline
        self.ticker = Ticker(None, 0)
        self.outs: list[OutputFile] = []

    def run(self, paths: list[Path], layouts: list[FileLayout], pieces: list[Piece],
            whole: list[Piece], workers: int | None, progress: Progress | None) -> None:
        """Write every piece into ``paths`` (laid out as ``layouts``); fsync them unless failed."""
        for rel in {c.storage.relative_path for p in pieces + whole for c in p.tensor.chunks
                    if c.storage}:
            self.ck.reader(rel)  # opened here, so worker threads only read
        self.ticker = Ticker(progress, sum(lay.data_bytes for lay in layouts))
        try:
            for path, lay in zip(paths, layouts):
                self.outs.append(OutputFile(path, lay, track=self.track))
            if self.ck.storage.is_local:
                self._run_local(pieces, whole, workers or 2)
            else:
                self._run_remote(pieces, whole, workers or REMOTE_WORKERS)
        finally:
            for o in self.outs:
                o.close(sync=not self.ticker.abort.is_set())

    def _run_local(self, pieces: list[Piece], whole: list[Piece], workers: int) -> None:
        jobs: list[Callable[[], object]] = []
        for ps in _by_file(pieces).values():
            jobs.append(functools.partial(self._copy_job, ps))
            if self.check_crc and not self.inline:
                jobs.append(functools.partial(self._check_job, ps))
        jobs += [functools.partial(self._whole_job, whole)] if whole else []
        run_jobs(self.ticker, lambda job: job(), jobs, workers)

    def _run_remote(self, pieces: list[Piece], whole: list[Piece], workers: int) -> None:
        # One locating job per file, front to back: a record's tail and the next record's
        # headers then come in one request (``storage.remote.RemoteFile.WINDOW``).
        files = _by_file(pieces)
        found = run_jobs(self.ticker, lambda ps: [self.ck.locate(p.tensor, p.chunk) for p in ps],
                         list(files.values()), workers)
        where = {id(p): cb for ps, cbs in zip(files.values(), found) for p, cb in zip(ps, cbs)}
        located = [where[id(p)] for p in pieces]
        parts: list[_Part] = []
        jobs: list[Callable[[], list[int] | None]] = []
        for i, (p, cb) in enumerate(zip(pieces, located)):
            if not cb.location.contiguous:
                jobs.append(functools.partial(self._gather_job, p, cb))
                continue
            span, check = self._span(cb)
            parts += [_Part(i, s, check) for s in blocks_of(span, REMOTE_BLOCK)]
        fetches = _coalesce(parts)
        jobs += [functools.partial(self._fetch_job, pieces, located, f) for f in fetches]
        jobs += [functools.partial(self._whole_job, whole)] if whole else []
        results = run_jobs(self.ticker, lambda job: job(), jobs, workers)
        crcs = [crc for r in results if r is not None for crc in r]
        self._check_parts(pieces, located, [q for f in fetches for q in f.parts], crcs)

    def _advance(self, n: int) -> None:
        self.ticker.add(n)  # raises Aborted once another job failed

    # -- row-block chunks -----------------------------------------------------------------
    def _copy_job(self, pieces: list[Piece]) -> None:
        buf = bytearray(BLOCK)
        for p in pieces:
            cb = self.ck.locate(p.tensor, p.chunk)
            loc = cb.location
            if not loc.contiguous:
                self._write(p, self._gather(p, cb))
            elif self.inline:  # (a cast, if any, is what makes out_dtype differ)
                self._stream(p, cb, buf)
            else:
                self._copy_in_kernel(p, cb)

    def _copy_in_kernel(self, p: Piece, cb: ChunkBytes) -> None:
        """``copy_file_range`` in blocks (so cancel and progress work), the source's next blocks
        asked for ahead (``POSIX_FADV_WILLNEED``): the kernel's own read-ahead of a cold file
        under ``copy_file_range`` is small, and the disk would idle between blocks."""
        fd, span = cb.reader.fileno, ByteRange(None, cb.reader, cb.start, 0, cb.nbytes)
        assert fd is not None
        for part in blocks_of(span, BLOCK):
            if _FADVISE and part.rel % READ_AHEAD == 0:
                os.posix_fadvise(fd, part.start + BLOCK, READ_AHEAD, os.POSIX_FADV_WILLNEED)
            self.outs[p.out].copy_from(fd, part.start, part.length, p.offset + part.rel)
            self._advance(part.length)

    def _check_job(self, pieces: list[Piece]) -> None:
        """CRC-32 of every record's data, read beside the in-kernel copy of the same file."""
        buf = bytearray(BLOCK)
        for p in pieces:
            cb = self.ck.locate(p.tensor, p.chunk)
            if not cb.has_crc:  # a safetensors range: no checksum to check
                continue
            crc = 0
            for data in read_blocks(self._span(cb)[0], buf, in_place=True):
                crc = crc32(data, crc)
                self._advance(0)
            self._check_crc(p, cb, crc)

    def _stream(self, p: Piece, cb: ChunkBytes, buf: bytearray) -> None:
        """Read the record's data in blocks: CRC all of it, cast and write the chunk's part."""
        span, check = self._span(cb)
        crc, pos = 0, span.start
        for data in read_blocks(span, buf):
            crc = crc32(data, crc) if check else crc
            self._place(p, cb, pos, data)
            pos += len(data)
        if check:
            self._check_crc(p, cb, crc)

    def _fetch_job(self, pieces: list[Piece], located: list[ChunkBytes], f: _Fetch) -> list[int]:
        """One ranged request; each part placed in the output; the parts' CRC-32s (0 where
        they do not count)."""
        self._advance(0)
        data, crcs = read_block(f.span), []
        for q in f.parts:
            view = data[q.span.start - f.span.start:q.span.start - f.span.start + q.span.length]
            self._place(pieces[q.piece], located[q.piece], q.span.start, view)
            crcs.append(crc32(view) if q.check else 0)
        return crcs

    def _span(self, cb: ChunkBytes) -> tuple[ByteRange, bool]:
        """What to read of the chunk's record, and whether to check it: all of the record's
        data when its CRC-32 is checked, else the chunk's own bytes."""
        loc = cb.location
        if self.check_crc and cb.has_crc:
            return ByteRange(None, cb.reader, loc.data_offset, 0, loc.entry.size), True
        return ByteRange(None, cb.reader, loc.start, 0, loc.nbytes), False

    def _place(self, p: Piece, cb: ChunkBytes, pos: int, data: memoryview) -> None:
        """Cast and write the part of ``data`` (read at file offset ``pos``) inside the chunk."""
        loc = cb.location
        a, b = max(pos, loc.start), min(pos + len(data), loc.start + loc.nbytes)
        if a < b:
            out = cast_bytes(data[a - pos:b - pos], loc.dtype, p.out_dtype)
            self.outs[p.out].pwrite(out, p.offset + (a - loc.start) * p.out_dtype.itemsize
                                    // loc.dtype.itemsize)
            self._advance(len(out))

    def _check_parts(self, pieces: list[Piece], located: list[ChunkBytes], parts: list[_Part],
                     crcs: list[int]) -> None:
        """Combine the remote parts' CRC-32s (in file order) per record and check them."""
        combined: dict[int, int] = {}
        for q, crc in zip(parts, crcs):
            if q.check:
                combined[q.piece] = crc32_combine(combined.get(q.piece, 0), crc, q.span.length)
        for i, crc in combined.items():
            self._check_crc(pieces[i], located[i], crc)

    def _check_crc(self, p: Piece, cb: ChunkBytes, crc: int) -> None:
        stored = cb.location.entry.crc
        if crc != stored:
            raise self._damaged(p, cb, f"CRC-32 mismatch (stored {stored:08x}, computed {crc:08x})")

    def _damaged(self, p: Piece, cb: ChunkBytes, what: str) -> CorruptCheckpointError:
        where = self.ck.storage.url_of(cb.reader.rel)
        return ChecksumError(
            f"{where} (item {p.tensor.fqn}): {what}: the bytes are damaged; nothing was written",
            path=where, hint="Use an earlier checkpoint; 'ckptool validate --deep' checks all records")

    # -- other layouts: one tensor at a time -------------------------------------------------
    def _gather(self, p: Piece, cb: ChunkBytes) -> memoryview:
        """One chunk's row-major bytes from any record (CRC-checked), cast to the output dtype."""
        loc = cb.location
        raw = read_block(ByteRange(None, cb.reader, loc.data_offset, 0, loc.entry.size))
        if self.check_crc and cb.has_crc and crc32(raw) != loc.entry.crc:
            raise self._damaged(p, cb, "CRC-32 mismatch")
        first = raw[loc.storage_offset * loc.dtype.itemsize:]
        return cast_bytes(memoryview(rowmajor(first, loc)), loc.dtype, p.out_dtype)

    def _gather_job(self, p: Piece, cb: ChunkBytes) -> None:
        self._write(p, self._gather(p, cb))

    def _whole_job(self, whole: list[Piece]) -> None:
        import numpy as np

        for p in whole:
            t, item = p.tensor, p.out_dtype.itemsize
            full = np.empty(t.shape, np.dtype(f"V{item}"))
            for c in t.chunks:
                if c.numel:
                    part = np.frombuffer(self._gather(p, self.ck.locate(t, c)), full.dtype)
                    idx = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
                    full[idx] = part.reshape(c.sizes)
                    self._advance(0)
            self._write(p, memoryview(full.reshape(-1).view(np.uint8)))

    def _write(self, p: Piece, data: memoryview) -> None:
        self.outs[p.out].pwrite(data, p.offset)
        self._advance(len(data))


def _by_file(pieces: list[Piece]) -> dict[str, list[Piece]]:
    """The pieces per source file, in their order (the plan's: file offset)."""
    files: dict[str, list[Piece]] = {}
    for p in pieces:
        files.setdefault(p.chunk.storage.relative_path, []).append(p)  # type: ignore[union-attr]
    return files


def _coalesce(parts: list[_Part]) -> list[_Fetch]:
    """Consecutive parts of one file (the plan's order) joined into requests of at most
    ``REMOTE_BLOCK`` bytes when only a small gap (a record's zip headers) lies between them:
    many small records then cost one request, not one each."""
    out: list[_Fetch] = []
    for q in parts:
        last = out[-1] if out else None
        if (last is not None and q.span.reader is last.span.reader
                and 0 <= q.span.start - (last.span.start + last.span.length) <= _GAP
                and q.span.start + q.span.length - last.span.start <= REMOTE_BLOCK):
            span = ByteRange(None, q.span.reader, last.span.start, 0,
                             q.span.start + q.span.length - last.span.start)
            out[-1] = _Fetch(span, (*last.parts, q))
        else:
            out.append(_Fetch(q.span, (q,)))
    return out

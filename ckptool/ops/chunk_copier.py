"""Moving a consolidate plan's chunk bytes into the safetensors output files, on worker threads.

A ``Piece`` maps one row-block chunk (FSDP2 ``Shard(0)``) to one contiguous range of an output
file; ``whole`` pieces are tensors saved in other boxes, assembled in memory one at a time.
``Copier.run`` opens the outputs and runs the jobs (``copy_engine.run_jobs``):

- local source, bytes as saved: one job copies the source files in the kernel
  (``copy_file_range``), front to back, one at a time (writes into one output file queue on
  its inode lock anyway), and, when CRC-32s are checked, another reads the same files beside
  it, so the two overlap on two cores;
- local source, bytes through Python (a cast, ``verify``): per file one job reads each block
  once (``row_source.read_blocks``): CRC, cast, positioned write;
- a local source's records, when they fit in half of the free memory, are first asked for
  front to back on a thread of their own (``storage.readahead``), so that a cold disk reads
  them at its sequential speed (2.2 GB, cold, 9 interleaved pairs: median 5.40 s, was 5.59 s;
  ``--no-crc-check``, 4 pairs: 5.90 s, was 6.43 s);
- remote source: per source file one job (``REMOTE_WORKERS`` at once) reads the file front to
  back over one streamed request (``storage.remote.StreamedFile``), dropping the bytes between
  the records it needs. A record of up to ``REMOTE_BLOCK`` bytes is read whole and copied from
  memory as a local one; a bigger one is placed block by block as it streams, where its local
  zip headers say its data starts, and its zip directory, read last, must agree (else that
  chunk is read again by ranged requests). Each record's CRC-32 is computed as its bytes
  pass and checked at its end.

Memory: one block (plus its cast) per worker, and one full tensor for non-row-block layouts.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import ChecksumError, CorruptCheckpointError
from ckptool.format.copy_engine import Progress, Ticker, run_jobs
from ckptool.format.crc import crc32
from ckptool.format.dtypes import DType
from ckptool.format.metadata import Chunk, StorageRef, TensorEntry
from ckptool.format.reader import CheckpointReader, ChunkBytes, rowmajor
from ckptool.format.row_source import ByteRange, blocks_of, read_block, read_blocks
from ckptool.format.safetensors_writer import FileLayout, OutputFile, cast_bytes
from ckptool.format.torch_records import tensor_from_head
from ckptool.storage import BLOCK
from ckptool.storage.readahead import Span, merged, read_ahead
from ckptool.storage.remote import StreamedFile

#: Remote source files read at once, and the most bytes a job reads at once (a record of up to
#: this size is read whole): at most 8 x 16 MiB in flight.
REMOTE_WORKERS = 8
REMOTE_BLOCK = 16 << 20
#: Of a bigger record, the first and the last bytes kept while it streams: its local zip
#: headers (``data.pkl`` and the data's, before the data) and its zip directory (after it).
_HEAD = 64 << 10
_TAIL = 128 << 10
#: How far ahead of an in-kernel copy the source is asked for.
READ_AHEAD = 4 * BLOCK
_FADVISE = hasattr(os, "posix_fadvise")
#: Records this close together are read ahead as one range.
_GAP = 1 << 20


@dataclass(frozen=True)
class Piece:
    """Bytes of one chunk -> one contiguous range of an output file."""

    tensor: TensorEntry
    chunk: Chunk
    out: int          # index of the output file
    offset: int       # absolute offset in that file
    out_dtype: DType


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
        self.ahead = False  # the whole local source is being read ahead (``storage.readahead``)

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
        self.ahead = read_ahead(self._source_spans(pieces, whole))  # (if they fit in memory)
        files = list(_by_file(pieces).values())
        jobs: list[Callable[[], object]]
        if self.inline:  # reading, casting and hashing in Python: a job per source file
            jobs = [functools.partial(self._copy_job, ps) for ps in files]
        else:  # in-kernel copies in one lane (writes into one file queue on its inode lock:
            # two copying threads spun on it, 11% of the CPU); the CRC checks in another
            jobs = [functools.partial(self._copy_files, files)]
            jobs += [functools.partial(self._check_files, files)] if self.check_crc else []
        jobs += [functools.partial(self._whole_job, whole)] if whole else []
        run_jobs(self.ticker, lambda job: job(), jobs, workers)

    def _run_remote(self, pieces: list[Piece], whole: list[Piece], workers: int) -> None:
        jobs: list[Callable[[], None]] = [functools.partial(self._file_job, rel, ps)
                                          for rel, ps in _by_file(pieces).items()]
        jobs += [functools.partial(self._whole_job, whole)] if whole else []
        run_jobs(self.ticker, lambda job: job(), jobs, workers)

    def _source_spans(self, pieces: list[Piece], whole: list[Piece]) -> list[Span]:
        """The records the pieces read, in the order they are read; close ones joined."""
        refs = [_ref(p) for p in pieces]
        refs += [c.storage for p in whole for c in p.tensor.chunks if c.storage is not None]
        return merged(((self.ck.storage.path(r.relative_path), r.offset, r.length) for r in refs),
                      gap=_GAP)

    def _advance(self, n: int) -> None:
        self.ticker.add(n)  # raises Aborted once another job failed

    # -- row-block chunks -----------------------------------------------------------------
    def _copy_files(self, files: list[list[Piece]]) -> None:
        for pieces in files:
            self._copy_job(pieces)

    def _check_files(self, files: list[list[Piece]]) -> None:
        for pieces in files:
            self._check_job(pieces)

    def _copy_job(self, pieces: list[Piece]) -> None:
        buf = bytearray(BLOCK)
        for p in pieces:
            self._copy(p, self.ck.locate(p.tensor, p.chunk), buf)

    def _copy(self, p: Piece, cb: ChunkBytes, buf: bytearray) -> None:
        if not cb.location.contiguous:
            self._write(p, self._gather(p, cb))
        elif self.inline or cb.reader.fileno is None:  # (a cast makes out_dtype differ)
            self._stream(p, cb, buf)
        else:
            self._copy_in_kernel(p, cb)

    def _copy_in_kernel(self, p: Piece, cb: ChunkBytes) -> None:
        """``copy_file_range`` in blocks (so cancel and progress work), the source's next blocks
        asked for ahead (``POSIX_FADV_WILLNEED``) unless the whole source already is: the
        kernel's own read-ahead of a cold file under ``copy_file_range`` is small, and the disk
        would idle between blocks."""
        fd, span = cb.reader.fileno, ByteRange(None, cb.reader, cb.start, 0, cb.nbytes)
        assert fd is not None
        for part in blocks_of(span, BLOCK):
            if _FADVISE and not self.ahead and part.rel % READ_AHEAD == 0:
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
            crc = self._take(p, cb, pos, data, crc)
            pos += len(data)
        if check:
            self._check_crc(p, cb, crc)

    def _take(self, p: Piece, cb: ChunkBytes, pos: int, data: memoryview, crc: int) -> int:
        """Place the chunk's part of ``data`` (read at file offset ``pos``); return the record's
        CRC-32 so far, ``crc``, with the part of ``data`` it covers added (if it is checked)."""
        self._place(p, cb, pos, data)
        span, check = self._span(cb)
        a, b = max(pos, span.start), min(pos + len(data), span.start + span.length)
        return crc32(data[a - pos:b - pos], crc) if check and a < b else crc

    # -- remote source: one streamed request per file ---------------------------------------
    def _file_job(self, rel: str, pieces: list[Piece]) -> None:
        """A remote file's records, front to back, over one streamed request; the bytes
        between them (zip headers, records not exported) are dropped as they pass."""
        pieces = sorted(pieces, key=lambda p: _ref(p).offset)
        end = _ref(pieces[-1]).offset + _ref(pieces[-1]).length
        with StreamedFile(self.ck.storage.fs, self.ck.storage.path(rel), end,
                          block=REMOTE_BLOCK) as s:
            for p in pieces:
                s.skip(_ref(p).offset - s.pos)
                self._record(p, s)

    def _record(self, p: Piece, s: StreamedFile) -> None:
        """One record from the stream (at its first byte): the chunk placed, its CRC-32 checked.

        A record of up to ``REMOTE_BLOCK`` bytes (or ``_HEAD + _TAIL``) is read whole and
        parsed from memory. A bigger one is placed block by block as it streams where its
        first bytes say (``_guess``), and its zip directory, read last, must agree. A strided
        tensor is gathered from memory, or from a big record by ranged requests."""
        ref = _ref(p)
        if ref.length <= max(REMOTE_BLOCK, _HEAD + _TAIL):
            data = s.read(ref.length)
            kept = _Kept(self.ck, ref.relative_path, [(ref.offset, data)])
            guess: ChunkBytes | None = kept.locate(p.tensor, p.chunk)
            crc = self._take(p, guess, ref.offset, data, 0) if guess.location.contiguous else 0
        else:
            kept = _Kept(self.ck, ref.relative_path, [(ref.offset, bytes(s.peek(_HEAD)))])
            guess = (kept.locate(p.tensor, p.chunk) if ref.raw
                     else _guess(p, kept, ref.offset + ref.length))
            crc = self._stream_record(p, s, kept, guess)
        cb = kept.locate(p.tensor, p.chunk)
        if guess is None or not guess.location.contiguous:
            self._copy(p, cb, bytearray(BLOCK))
        elif not _agree(guess, cb):
            raise self._damaged(p, cb, "its local zip headers disagree with its zip directory")
        elif self._span(cb)[1]:
            self._check_crc(p, cb, crc)

    def _stream_record(self, p: Piece, s: StreamedFile, kept: _Kept,
                       guess: ChunkBytes | None) -> int:
        """Read a big record from the stream in blocks, placing them where ``guess`` says (if
        anything); keep its last ``_TAIL`` bytes; return its data's CRC-32 as read."""
        ref = _ref(p)
        end = ref.offset + ref.length
        loc = guess.location if guess is not None else None
        d, e = (loc.data_offset, loc.data_offset + loc.entry.size) if loc else (ref.offset,) * 2
        crc = 0
        for a, b in _cuts(ref.offset, d, e, end):
            data = s.read(b - a)
            self._advance(0)
            if b > end - _TAIL:  # the zip directory's bytes, and those before it
                kept.keep(max(a, end - _TAIL), data[max(0, end - _TAIL - a):])
            crc = self._take(p, guess, a, data, crc) if guess is not None else crc
            del data  # one block at a time: not held while the next is read
        return crc

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


def _ref(p: Piece) -> StorageRef:
    assert p.chunk.storage is not None  # the plan's pieces all have one
    return p.chunk.storage


class _Kept(CheckpointReader):
    """``ck`` as one streamed record left it: its file's reads are answered from the bytes
    kept of the record (``pieces``: offset, bytes), any other range by a ranged request, so
    ``locate`` parses the record as it was read. It is that file's reader, too."""

    fileno = None

    def __init__(self, ck: CheckpointReader, rel: str, pieces: list[tuple[int, Any]]) -> None:
        super().__init__(ck.storage, ck.meta)
        self.rel, self.file, self.pieces = rel, ck.reader(rel), pieces

    def reader(self, rel: str) -> Any:
        return self

    def keep(self, offset: int, data: memoryview) -> None:
        """Keep ``data`` (read at ``offset``) too: one piece with the piece it follows."""
        start, last = self.pieces[-1]
        if start + len(last) == offset:
            self.pieces[-1] = (start, bytes(last) + bytes(data))
        else:
            self.pieces.append((offset, bytes(data)))

    def pread(self, offset: int, length: int) -> bytes:
        for start, data in self.pieces:
            if start <= offset and offset + length <= start + len(data):
                return bytes(data[offset - start:offset - start + length])
        return self.file.pread(offset, length)


def _cuts(start: int, data: int, data_end: int, end: int) -> list[tuple[int, int]]:
    """A big record's reads: its headers, its data in blocks from the data's first byte (so
    every block starts on an element, for casts), the rest in blocks."""
    at = sorted({start, *range(data, data_end, REMOTE_BLOCK), data_end,
                 *range(data_end, end, REMOTE_BLOCK), end})
    return list(zip(at, at[1:]))


def _guess(p: Piece, kept: _Kept, end: int) -> ChunkBytes | None:
    """Where a big record's chunk lies, from its first bytes (``tensor_from_head``), before
    its zip directory comes; None unless that is the index's chunk, row-major, inside the
    record."""
    loc = tensor_from_head(bytes(kept.pieces[0][1]), _ref(p).offset)
    if (loc is None or (loc.dtype, loc.shape) != (p.tensor.dtype, p.chunk.sizes)
            or not loc.contiguous or loc.data_offset + loc.entry.size > end):
        return None
    return ChunkBytes(p.chunk, loc, kept)  # type: ignore[arg-type]


def _agree(guess: ChunkBytes, cb: ChunkBytes) -> bool:
    """Did the guess take the bytes the zip directory says: the chunk's, and (for the CRC-32)
    all of the record data's?"""
    g, loc = guess.location, cb.location
    return loc.contiguous and (g.start, g.data_offset, g.entry.size) == (
        loc.start, loc.data_offset, loc.entry.size)

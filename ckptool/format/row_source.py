"""Row ranges of a checkpoint's tensors as byte pieces: the one block reader for writers.

``RowSource.pieces_of(t, lo, hi)`` yields rows ``[lo, hi)`` of tensor ``t`` in row-major order:
``ByteRange``s of open files for row-block chunks (copyable block by block with
``read_blocks``), or assembled bytes for other layouts. With ``track``, the CRC-32 of every
piece read is kept so ``check_crcs`` can prove each source record's stored CRC-32 (pieces
combined with ``crc32_combine``); damaged input is refused, never laundered.
``tensor_crc``/``tensor_digest`` give a whole tensor's row-major CRC-32 or xxh3 for
verification. ``read_block`` is the one read of a byte range (``read_blocks`` loops it;
``blocks_of`` cuts a range for parallel reads).
Torch-free (numpy for non-row-block layouts).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from ckptool.errors import CorruptCheckpointError
from ckptool.format.copy_engine import unverified
from ckptool.format.crc import crc32_combine
from ckptool.format.mapped_file import cached_window
from ckptool.format.metadata import Chunk, TensorEntry
from ckptool.format.reader import CheckpointReader, ChunkBytes
from ckptool.storage import BLOCK, RangeReader

_FADVISE = hasattr(os, "posix_fadvise")


class RowSource:
    """Row ranges of a checkpoint's tensors as byte pieces; tracks CRC-32 pieces if asked."""

    def __init__(self, ck: CheckpointReader, *, track: bool = False) -> None:
        self.ck = ck
        self.track = track
        self.pieces: list[tuple[tuple[str, tuple[int, ...]], int, int, int]] = []
        self.whole_check: set[tuple[str, tuple[int, ...]]] = set()
        self._locs: dict[tuple[str, tuple[int, ...]], ChunkBytes] = {}
        for rel in ck.meta.files():
            ck.reader(rel)  # open every file before threads share the reader table

    def locate(self, t: TensorEntry, c: Chunk) -> ChunkBytes:
        key = (t.fqn, c.offsets)
        if key not in self._locs:
            self._locs[key] = self.ck.locate(t, c)
        return self._locs[key]

    def pieces_of(self, t: TensorEntry, lo: int, hi: int) -> Iterator[ByteRange | bytes]:
        """Rows ``[lo, hi)`` of ``t`` in row-major order (a 0-dim tensor has one row)."""
        row = math.prod(t.shape[1:]) * t.dtype.itemsize
        blocks = t.row_blocks()
        if blocks is None:
            self.whole_check.update((t.fqn, c.offsets) for c in t.chunks)
            yield assemble_rows(self.ck, t, lo, hi)
            return
        for c in blocks:
            c0 = c.offsets[0] if c.offsets else 0
            a, b = max(lo, c0), min(hi, c0 + (c.sizes[0] if c.sizes else 1))
            if b <= a:
                continue
            cb = self.locate(t, c)
            loc = cb.location
            if not cb.has_crc:  # a safetensors range: the bytes as they are, nothing to check
                yield ByteRange(None, cb.reader, cb.start + (a - c0) * row, (a - c0) * row, (b - a) * row)
                continue
            if not loc.contiguous:
                self.whole_check.add((t.fqn, c.offsets))
                yield memoryview(self.ck.read_chunk(t, c))[(a - c0) * row:(b - c0) * row]
                continue
            exact = loc.storage_offset == 0 and loc.entry.size == loc.nbytes
            if not exact and self.track:
                self.whole_check.add((t.fqn, c.offsets))
            key = (t.fqn, c.offsets) if exact and self.track else None
            yield ByteRange(key, cb.reader, cb.start + (a - c0) * row, (a - c0) * row, (b - a) * row)

    def check_crcs(self) -> None:
        """Do the CRCs of the pieces read add up to each record's stored CRC-32?"""
        by_key: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
        for key, rel, length, crc in self.pieces:
            by_key[key].append((rel, length, crc))
        for (fqn, offsets), parts in by_key.items():
            t = self.ck.meta.tensors[fqn]
            entry = self.locate(t, chunk_at(t, offsets)).location.entry
            crc, pos = 0, 0
            for rel, length, part in sorted(parts):
                if rel != pos:
                    break
                crc, pos = crc32_combine(crc, part, length), pos + length
            if pos != entry.size:
                self.whole_check.add((fqn, offsets))
            elif crc != entry.crc:
                self._mismatch(fqn, chunk_at(t, offsets), entry.crc, crc)
        for fqn, offsets in sorted(self.whole_check):
            chunk = chunk_at(self.ck.meta.tensors[fqn], offsets)
            if chunk.numel and not chunk.storage.raw:  # type: ignore[union-attr]
                self.ck.record(chunk.storage, fqn).verify_crc()  # type: ignore[arg-type]


    def _mismatch(self, fqn: str, chunk: Chunk, stored: int, computed: int) -> None:
        """The pieces of a source record do not add up to its stored CRC-32: the source is
        damaged, or (pieces read from a copy) the copy differs. Raises which."""
        where = self.ck.storage.url_of(chunk.storage.relative_path)  # type: ignore[union-attr]
        source = f"{where} (item {fqn})"
        self.ck.record(chunk.storage, fqn).verify_crc()  # type: ignore[arg-type]  # raises if damaged
        raise unverified(where, f"the copy of {source} differs from it: CRC-32 mismatch "
                                f"(stored {stored:08x}, copy {computed:08x})")


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at ``start`` of an open file; ``rel``: offset in the record's data."""

    key: tuple[str, tuple[int, ...]] | None
    reader: RangeReader
    start: int
    rel: int
    length: int


def chunk_at(t: TensorEntry, offsets: tuple[int, ...]) -> Chunk:
    return next(c for c in t.chunks if c.offsets == offsets)


def assemble_rows(ck: CheckpointReader, t: TensorEntry, lo: int, hi: int) -> bytes:
    """Rows ``[lo, hi)`` of a tensor saved in arbitrary boxes (memory: those rows + a chunk)."""
    import numpy as np

    item = np.dtype(f"V{t.dtype.itemsize}")
    out = np.zeros((hi - lo,) + t.shape[1:], dtype=item)
    for c in t.chunks:
        a, b = max(lo, c.offsets[0]), min(hi, c.offsets[0] + c.sizes[0])
        if b <= a or not c.numel:
            continue
        src = np.frombuffer(ck.read_chunk(t, c), dtype=item).reshape(c.sizes)
        box = tuple(slice(o, o + n) for o, n in zip(c.offsets[1:], c.sizes[1:]))
        out[(slice(a - lo, b - lo), *box)] = src[a - c.offsets[0]:b - c.offsets[0]]
    return out.tobytes()


def read_blocks(r: ByteRange, buf: bytearray, *, in_place: bool = False) -> Iterator[memoryview]:
    """The range in pieces of at most ``len(buf)`` bytes (views of ``buf`` for local files),
    the next piece of a local file read ahead (``POSIX_FADV_WILLNEED``) meanwhile.

    ``in_place``: for bytes that are only looked at (checksums), a piece of a local file that
    the page cache holds is a view of a mapping of it, not a copy. Each view is valid until the
    next piece is taken."""
    parts, fd = blocks_of(r, len(buf)), r.reader.fileno
    for i, part in enumerate(parts):
        if in_place:
            with cached_window(fd, part.start, part.length) as cached:
                if cached is not None:
                    yield cached
                    continue
        if _FADVISE and fd is not None and i + 1 < len(parts):
            os.posix_fadvise(fd, parts[i + 1].start, parts[i + 1].length, os.POSIX_FADV_WILLNEED)
        yield read_block(part, buf)


def blocks_of(r: ByteRange, size: int) -> list[ByteRange]:
    """The range cut into consecutive ranges of at most ``size`` bytes (each readable alone,
    e.g. by parallel ranged requests)."""
    return [ByteRange(r.key, r.reader, r.start + i, r.rel + i, min(size, r.length - i))
            for i in range(0, r.length, size)]


def read_block(r: ByteRange, buf: bytearray | None = None) -> memoryview:
    """All of the range in one read: into ``buf`` (at least ``r.length`` bytes; a new buffer
    when None) from a local file, else the bytes one ranged request returns.

    Raises:
        CorruptCheckpointError: the file ends before the range does.
    """
    fd = r.reader.fileno
    if fd is None:
        data = memoryview(r.reader.pread(r.start, r.length))
        got = len(data)
    else:
        data, got = memoryview(buf if buf is not None else bytearray(r.length))[:r.length], 0
        while got < r.length:
            n = os.preadv(fd, [data[got:]], r.start + got)
            if not n:
                break
            got += n
    if got != r.length:
        where = r.reader.storage.url_of(r.reader.rel)
        raise CorruptCheckpointError(f"{where} is cut short at byte {r.start + got}",
                                     path=r.reader.storage.url,
                                     hint="Run 'ckptool validate --deep' for details")
    return data


def tensor_crc(src: RowSource, t: TensorEntry) -> tuple[int, int] | None:
    """(CRC-32, length) of the whole tensor in row-major order, from its records' stored CRCs
    (each checked against the bytes by the copy or by ``validate --deep``); None when some
    record's CRC covers more than the tensor's own bytes."""
    blocks = t.row_blocks()
    if blocks is None:
        return None
    crc = size = 0
    for c in blocks:
        cb = src.locate(t, c)
        loc = cb.location
        if not (cb.has_crc and loc.contiguous and loc.storage_offset == 0
                and loc.entry.size == loc.nbytes):
            return None
        crc, size = crc32_combine(crc, loc.entry.crc, loc.entry.size), size + loc.entry.size
    return crc, size


def tensor_digest(src: RowSource, t: TensorEntry) -> str:
    """xxh3-64 of the whole tensor in row-major order, read in pieces, whatever its layout."""
    import xxhash

    h, buf = xxhash.xxh3_64(), bytearray(BLOCK)
    n = t.shape[0] if t.shape else 1
    bands = [0, n]
    if t.row_blocks() is None:  # assemble between the chunks' row boundaries
        bands = sorted({0, n} | {c.offsets[0] + d for c in t.chunks for d in (0, c.sizes[0])})
    for lo, hi in zip(bands, bands[1:]):
        for piece in src.pieces_of(t, lo, hi):
            for data in (read_blocks(piece, buf) if isinstance(piece, ByteRange) else (piece,)):
                h.update(data)
    return h.hexdigest()

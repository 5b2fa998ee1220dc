"""One open DCP checkpoint for byte-moving ops: locate and read chunks, files opened once.

``CheckpointReader`` is the single walk over chunk bytes that consolidate and reshard share.
Row-block chunks are contiguous in the full tensor, so callers can copy them file-to-file
using ``locate()`` (absolute offset + length in an open file); everything else goes through
``read_chunk()``, which returns row-major bytes of one chunk (bounded by that chunk's size).

A chunk of a safetensors checkpoint (``StorageRef.raw``) is its row-major bytes themselves:
``locate()`` describes it as a contiguous record of exactly those bytes, and ``has_crc`` is
False (there is no checksum to check; callers skip the CRC-32 for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptool.errors import CorruptCheckpointError
from ckptool.format.torch_records import RecordReader, TensorLocation, ZipEntry, contiguous_strides
from ckptool.format.metadata import CheckpointMetadata, Chunk, StorageRef, TensorEntry, read_metadata
from ckptool.storage import RangeReader, Storage


@dataclass(frozen=True)
class ChunkBytes:
    """Where one chunk's row-major bytes are: ``reader`` file, ``[start, start + nbytes)``."""

    chunk: Chunk
    location: TensorLocation
    reader: RangeReader

    @property
    def start(self) -> int:
        return self.location.start

    @property
    def nbytes(self) -> int:
        return self.location.nbytes

    @property
    def has_crc(self) -> bool:
        """The record stores a CRC-32 of its data (False for a raw safetensors range)."""
        return not (self.chunk.storage is not None and self.chunk.storage.raw)


class CheckpointReader:
    """Read access to one DCP folder. Use as a context manager.

    Example:
        >>> with CheckpointReader(Storage.open("runs/demo/step_40")) as ck:
        ...     t = ck.meta.tensors["model.head.weight"]
        ...     data = b"".join(ck.read_chunk(t, c) for c in t.chunks)
    """

    def __init__(self, storage: Storage, meta: CheckpointMetadata | None = None) -> None:
        self.storage = storage
        self.meta = meta if meta is not None else read_metadata(storage)
        self._readers: dict[str, RangeReader] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def reader(self, rel: str) -> RangeReader:
        r = self._readers.get(rel)
        if r is None:
            r = self._readers[rel] = RangeReader(self.storage, rel)
        return r

    def record(self, ref: StorageRef, fqn: str) -> RecordReader:
        where = f"{self.storage.url_of(ref.relative_path)} (item {fqn})"
        return RecordReader(self.reader(ref.relative_path), ref, where)

    def locate(self, t: TensorEntry, chunk: Chunk) -> ChunkBytes:
        """Find the chunk's tensor inside its record and check it matches the index."""
        if chunk.storage is None:
            raise CorruptCheckpointError(
                f"{self.storage.url}: {t.fqn} chunk at {list(chunk.offsets)} has no storage entry",
                path=self.storage.url, hint="Run 'ckptool validate' for details")
        if chunk.storage.raw:
            return ChunkBytes(chunk, raw_location(t, chunk), self.reader(chunk.storage.relative_path))
        rec = self.record(chunk.storage, t.fqn)
        loc = rec.tensor()
        if loc.dtype != t.dtype or loc.shape != chunk.sizes:
            raise CorruptCheckpointError(
                f"{rec.where}: record holds {loc.dtype} {list(loc.shape)}, index declares "
                f"{t.dtype} {list(chunk.sizes)}", path=rec.where,
                hint="Run 'ckptool validate --deep' for details")
        return ChunkBytes(chunk, loc, rec.reader)

    def read_chunk(self, t: TensorEntry, chunk: Chunk) -> bytes:
        """The chunk's elements as row-major bytes (handles strided records too)."""
        cb = self.locate(t, chunk)
        loc = cb.location
        if loc.contiguous:
            data = cb.reader.pread(loc.start, loc.nbytes)
            if len(data) != loc.nbytes:
                raise CorruptCheckpointError(f"{self.storage.url}: {t.fqn} is cut short",
                                             path=self.storage.url)
            return data
        return _gather_strided(cb)

    def object_bytes(self, fqn: str) -> bytes:
        """The raw record of a non-tensor value (a complete ``torch.save`` archive)."""
        ref = self.meta.objects[fqn].storage
        if ref is None:
            raise CorruptCheckpointError(f"{self.storage.url}: {fqn} has no storage entry",
                                         path=self.storage.url)
        data = self.reader(ref.relative_path).pread(ref.offset, ref.length)
        if len(data) != ref.length:
            raise CorruptCheckpointError(f"{self.storage.url}: {fqn} is cut short",
                                         path=self.storage.url)
        return data


def raw_location(t: TensorEntry, chunk: Chunk) -> TensorLocation:
    """A raw range (``StorageRef.raw``) as a contiguous location of exactly the chunk's bytes.

    Its ``entry.crc`` is 0 and means nothing: check ``ChunkBytes.has_crc`` first.
    """
    ref = chunk.storage
    assert ref is not None and ref.raw
    nbytes = chunk.numel * t.dtype.itemsize
    if ref.length != nbytes:
        raise CorruptCheckpointError(
            f"{ref.relative_path}: {t.fqn} chunk at {list(chunk.offsets)} spans {ref.length} "
            f"bytes, its shape {list(chunk.sizes)} of {t.dtype} needs {nbytes}", path=ref.relative_path)
    entry = ZipEntry(name=ref.relative_path, method=0, crc=0, size=nbytes, header_offset=0)
    return TensorLocation(t.dtype, chunk.sizes, contiguous_strides(chunk.sizes), 0, chunk.numel,
                          ref.offset, entry)


def _gather_strided(cb: ChunkBytes) -> bytes:
    """Copy a non-contiguous view out of its storage into row-major order (numpy, no torch)."""
    loc = cb.location
    item = loc.dtype.itemsize
    span = 1 + sum((d - 1) * s for d, s in zip(loc.shape, loc.strides)) if loc.numel else 0
    raw = cb.reader.pread(loc.start, span * item)
    if len(raw) != span * item:
        raise CorruptCheckpointError("record is cut short", path=str(cb.reader.rel))
    return rowmajor(raw, loc).tobytes()


def rowmajor(raw: bytes | bytearray | memoryview, loc: TensorLocation):  # -> numpy uint8 array
    """The elements of ``loc``'s (possibly strided) view as row-major bytes.

    ``raw`` starts at the view's first element (``loc.start``) and reaches at least its last.
    """
    import numpy as np

    item = loc.dtype.itemsize
    buf = np.frombuffer(raw, dtype=np.dtype(f"V{item}"))
    view = np.lib.stride_tricks.as_strided(
        buf, shape=loc.shape, strides=tuple(s * item for s in loc.strides))
    out = np.ascontiguousarray(view)
    assert out.flags.c_contiguous  # (numpy ignores the strides of size-1 dims)
    return out.reshape(-1).view(np.uint8)

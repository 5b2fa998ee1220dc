"""Writing a DCP checkpoint without torch: ``torch.save`` records, ``.distcp`` files, ``.metadata``.

Owns the byte layout of what ckptool writes. A DCP item is one ``torch.save`` archive: an
uncompressed zip written by PyTorch's miniz-based ``PyTorchStreamWriter``. For one contiguous
tensor that archive has a fixed shape, reproduced here byte for byte (``tests/unit/
test_reshard_format.py`` compares with ``torch.save`` of the installed torch)::

    archive/data.pkl                  pickle (protocol 2): _rebuild_tensor_v2(persistent id, ...)
    archive/.format_version           b"1"
    archive/.storage_alignment        b"64"
    archive/byteorder                 b"little"
    archive/data/0                    the elements, row-major, 64-byte aligned
    archive/version                   b"3\\n"
    archive/.data/serialization_id    20 digits (hash of the record names) + 20 (hash of CRCs)

Every local header carries an ``FB`` extra field padding its data to 64 bytes, sizes and CRC go
into a data descriptor after the data (so the data can be streamed), and ZIP64 fields appear
exactly where miniz puts them (entries or offsets >= 4 GiB). Non-tensor records are copied
byte for byte by the caller. The ``.metadata`` pickle is encoded by ``_dcp_compat`` and written
last, through a temporary name (DCP's commit protocol).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from typing import Any

from ckptool.errors import CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import _dcp_compat
from ckptool.format.copy_engine import unverified
from ckptool.format.dtypes import DType
from ckptool.format.tensor_pickle import tensor_pickle
from ckptool.format.crc import crc32
from ckptool.format.metadata import METADATA, CheckpointMetadata, StorageRef
from ckptool.storage import BLOCK
from ckptool.storage.writeback import start_writeback

_FADVISE = hasattr(os, "posix_fadvise")
#: ``DistcpFile.copy_range`` asks the kernel to read this far ahead of the copy.
READ_AHEAD = 32 << 20
#: Bytes ``copy_range`` copies, then reads again, at a time: small enough that what the copy
#: just moved is still in the CPU's cache when it is read (copy, re-read of the source and of
#: the copy, 2.2 GB on 4 threads: about 2.3 s of CPU in 512 KiB steps, 3-5 s in 8 MiB steps).
COPY_STEP = 512 << 10
_MAX32 = 0xFFFFFFFF
_ALIGN = 64
_ARCHIVE = "archive/"
#: dtypes that torch.save writes with ``_rebuild_tensor_v2`` and a typed storage class.
#: (uint16/32/64 and float8 use ``_rebuild_tensor_v3`` + ``UntypedStorage``, which ckptool's
#: record reader does not parse yet.)
V2_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                       "int8", "uint8", "bool", "complex64"})
_SMALL_HEAD = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_VERSION = ("version", b"3\n")
_SERIALIZATION_ID = ".data/serialization_id"
#: First half of the serialization id: PyTorchStreamWriter's combined hash of the record names,
#: the same for every single-tensor record of this torch build (checked by the format test).
NAME_HASH = "15728199511854643026"


# ---------------------------------------------------------------------------------------------
# The zip structure (miniz with MZ_ZIP_FLAG_WRITE_ZIP64, as PyTorchStreamWriter drives it)


def _local_header(name: bytes, size: int, cursor: int) -> bytes:
    """Local header + extra fields (ZIP64 when needed, then FB padding) for an entry at cursor."""
    z64 = b""
    if size >= _MAX32 or cursor >= _MAX32:
        fields = (struct.pack("<QQ", size, 0) if size >= _MAX32 else b"")
        fields += struct.pack("<Q", cursor) if cursor >= _MAX32 else b""
        z64 = struct.pack("<HH", 1, len(fields)) + fields
    start = cursor + 30 + len(name) + 4 + len(z64)
    pad = (-start) % _ALIGN
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, _flags(size), 0, 0, 0, 0, 0, 0,
                       len(name), len(extra))
    return head + name + extra


def _flags(size: int) -> int:
    # UTF-8 names; a data descriptor follows the data unless the entry is empty (miniz).
    return 0x0808 if size else 0x0800


def _descriptor(crc: int, size: int, cursor: int) -> bytes:
    if size == 0:
        return b""
    if size >= _MAX32 or cursor >= _MAX32:
        return struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size)
    return struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)


def _central(name: bytes, crc: int, size: int, cursor: int) -> bytes:
    fields = struct.pack("<QQ", size, size) if size >= _MAX32 else b""
    fields += struct.pack("<Q", cursor) if cursor >= _MAX32 else b""
    extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
    head = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, _flags(size), 0, 0, 0, crc,
                       min(size, _MAX32), min(size, _MAX32), len(name), len(extra), 0, 0, 0, 0,
                       min(cursor, _MAX32))
    return head + name + extra


def _end_of_directory(count: int, cd_offset: int, cd_size: int) -> bytes:
    eocd64_offset = cd_offset + cd_size
    eocd64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, count, count,
                         cd_size, cd_offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_offset, 1)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(count, 0xFFFF),
                       min(count, 0xFFFF), min(cd_size, _MAX32), min(cd_offset, _MAX32), 0)
    return eocd64 + locator + eocd


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    mask = (1 << 64) - 1
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & mask) + (seed >> 2)) & mask)) & mask


class TensorRecord:
    """The ``torch.save`` record of one contiguous tensor, split around its data.

    Write ``head``, then exactly ``nbytes`` of row-major elements, then ``tail(crc)`` where
    ``crc`` is the CRC-32 of those elements. ``length`` is known before the data is.

    Example:
        >>> rec = TensorRecord(DTYPES["float32"], (2, 3))
        >>> blob = rec.head + data + rec.tail(zlib.crc32(data))
    """

    def __init__(self, dtype: DType, shape: tuple[int, ...]) -> None:
        if dtype.name not in V2_DTYPES:
            raise IncompatibleCheckpointError(
                f"cannot write {dtype} tensors: torch saves them in a record format "
                "(_rebuild_tensor_v3) that ckptool does not handle yet",
                hint="Reshard by loading with DCP on the new world size instead")
        self.shape = shape
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._dir: list[tuple[str, int, int, int]] = []  # (name, crc, size, local header at)
        parts, cursor = [], 0
        for name, data in (("data.pkl", tensor_pickle(dtype, shape)), *_SMALL_HEAD):
            parts.append(self._entry(self._dir, name, data, cursor))
            cursor += len(parts[-1])
        self._data_cursor = cursor
        parts.append(_local_header((_ARCHIVE + "data/0").encode(), self.nbytes, cursor))
        self.head = b"".join(parts)
        self.data_offset = len(self.head)
        self.length = self.data_offset + self.nbytes + len(self.tail(0))

    @staticmethod
    def _entry(directory: list, name: str, data: bytes, cursor: int) -> bytes:
        crc = crc32(data)
        directory.append((name, crc, len(data), cursor))
        full = (_ARCHIVE + name).encode()
        return _local_header(full, len(data), cursor) + data + _descriptor(crc, len(data), cursor)

    def tail(self, crc: int) -> bytes:
        """Everything after the data: descriptor, ``version``, serialization id, directory."""
        directory = [*self._dir, ("data/0", crc, self.nbytes, self._data_cursor)]
        out = [_descriptor(crc, self.nbytes, self._data_cursor)]
        cursor = self.data_offset + self.nbytes + len(out[0])
        out.append(self._entry(directory, *_VERSION, cursor))
        cursor += len(out[-1])
        combined = 0
        for _, c, size, _ in directory:  # PyTorchStreamWriter hashes every data descriptor
            if size:
                combined = _hash_combine(combined, c)
        sid = f"{NAME_HASH}{combined:020d}".encode()
        out.append(self._entry(directory, _SERIALIZATION_ID, sid, cursor))
        cursor += len(out[-1])
        cd = b"".join(_central((_ARCHIVE + name).encode(), c, size, at)
                      for name, c, size, at in directory)
        out.append(cd + _end_of_directory(len(directory), cursor, len(cd)))
        return b"".join(out)


def tensor_record(dtype: DType, shape: tuple[int, ...], data: bytes) -> bytes:
    """A complete ``torch.save`` record of ``data``, held in memory (for small tensors).

    Args:
        dtype, shape: the tensor's element type and shape.
        data: its elements, row-major, little-endian.

    Returns:
        The bytes ``torch.save`` writes for that tensor.

    Raises:
        ValueError: ``data`` has the wrong length.
        IncompatibleCheckpointError: ``dtype`` is not one of ``V2_DTYPES``.

    Example:
        >>> blob = tensor_record(DTYPES["float32"], (2,), struct.pack("<2f", 1.0, 2.0))
    """
    rec = TensorRecord(dtype, shape)
    if len(data) != rec.nbytes:
        raise ValueError(f"{len(data)} bytes given for {dtype} {list(shape)} ({rec.nbytes})")
    return rec.head + data + rec.tail(crc32(data))


# ---------------------------------------------------------------------------------------------
# Files


class DistcpFile:
    """One ``.distcp`` file written front to back, with its xxh3-64 computed on the way.

    ``copy_range`` appends bytes of another open file with an in-kernel copy
    (``os.copy_file_range``: no copy through Python), then reads the source's bytes, or the
    copy's, again (from the page cache, ``COPY_STEP`` at a time while the CPU's cache holds
    them) for the hash and the caller's CRC-32, and can compare the copy with the source.

    Example:
        >>> with DistcpFile("out/__0_0.distcp") as f:
        ...     ref = f.append_record(tensor_record(dtype, shape, data))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import xxhash

        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hash = xxhash.xxh3_64()
        self._kernel_copy = hasattr(os, "copy_file_range")
        self.size = 0
        self._written_out = 0  # bytes before this were handed to ``start_writeback``
        self._check: bytearray | None = None  # ``compare``'s read-back buffer

    def __enter__(self) -> DistcpFile:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(sync=exc_type is None)

    def write(self, data: Any, *, compare: bool = False) -> None:
        """Append bytes (any buffer); with ``compare``, read them back and require them equal
        (``CorruptCheckpointError`` if not)."""
        view = memoryview(data).cast("B")
        start = self.size
        self._hash.update(view)
        rest = view
        while rest:
            n = os.write(self._fd, rest)
            rest = rest[n:]
            self.size += n
        if compare and not self._reads_back(view, start):
            raise self._differs(f"bytes {start}..{self.size} read back differ from those "
                                "written", view, start)
        self._write_out()

    def copy_range(self, fd: int, offset: int, length: int, buf: bytearray,
                   where: str, *, read_back: bool = False,
                   compare: bool = False) -> Iterator[memoryview]:
        """Append ``length`` bytes at ``offset`` of the open file ``fd``; yield them step by
        step in views of ``buf`` (valid until the next one), read after the copy (from the
        page cache) for the hash and the caller's CRC-32.

        Without ``read_back`` they are ``fd``'s; with it, this file's, as the copy left them,
        for a caller comparing them with the source's stored CRC-32 (which proves source and
        copy at once). ``compare`` (for a source with no stored checksum) reads the copy too and
        requires it byte-equal to the source's bytes, so the CRC-32 the caller computes of them
        holds for the copy; without either, a verification reads the records back
        (``dcp_output.check_record``).

        Raises:
            CorruptCheckpointError: ``fd`` ends before (``where`` names it); with ``compare``,
                the copy differs from the source.
        """
        view, end = memoryview(buf)[:COPY_STEP], offset + length
        src, at = (self._fd, self.size - offset) if read_back else (fd, 0)
        advised = offset  # the source is asked for up to READ_AHEAD bytes ahead of the copy
        while offset < end:
            want = min(len(view), end - offset)
            if _FADVISE and advised < end and advised - offset < READ_AHEAD // 2:
                ahead = min(end, offset + READ_AHEAD)  # alone, the copy reads a cold file
                os.posix_fadvise(fd, advised, ahead - advised, os.POSIX_FADV_WILLNEED)
                advised = ahead  # in small steps
            n = self._copy(fd, offset, want, view)
            if n <= 0 or os.preadv(src, [view[:n]], offset + at) != n:
                raise CorruptCheckpointError(f"{where} ended while reading it (changed "
                                             "meanwhile?)", path=where, hint="Nothing was written")
            if compare and not self._reads_back(view[:n], self.size):
                raise self._differs(f"the copy of {where} (bytes {offset}..{offset + n}) "
                                    "differs from it", view[:n], self.size)
            self._hash.update(view[:n])
            self.size += n
            offset += n
            yield view[:n]
            self._write_out()

    def _reads_back(self, expected: memoryview, at: int) -> bool:
        """Do this file's bytes at ``at`` equal ``expected``? (Read back ``COPY_STEP`` at a
        time, compared with a memcmp.)"""
        check = self._check = self._check or bytearray(COPY_STEP)
        for i in range(0, len(expected), COPY_STEP):
            part = expected[i:i + COPY_STEP]
            n = len(part)
            if (os.preadv(self._fd, [memoryview(check)[:n]], at + i) != n
                    or (check if n == len(check) else check[:n]) != part):
                return False
        return True

    def _differs(self, what: str, expected: memoryview, at: int) -> CorruptCheckpointError:
        got = os.pread(self._fd, len(expected), at)
        return unverified(self.path, f"{what}: CRC-32 mismatch (source {crc32(expected):08x}, "
                                     f"copy {crc32(got):08x})")

    def _write_out(self) -> None:
        """Every ``BLOCK`` appended, have the disk start writing it (the final fsync waits less)."""
        if (self.size - self._written_out >= BLOCK
                and start_writeback(self._fd, self._written_out, self.size - self._written_out)):
            self._written_out = self.size  # (declined: asked again with the range grown)

    def _copy(self, fd: int, offset: int, want: int, view: memoryview) -> int:
        """Copy up to ``want`` bytes in the kernel; through ``view`` where it cannot (e.g.
        across file systems)."""
        if self._kernel_copy:
            try:
                return os.copy_file_range(fd, self._fd, want, offset)
            except OSError:
                self._kernel_copy = False
        n = os.preadv(fd, [view[:want]], offset)
        done = 0
        while done < n:
            done += os.write(self._fd, view[done:n])
        return n

    def append_record(self, record: bytes) -> StorageRef:
        start = self.size
        self.write(record)
        return StorageRef(self.name, start, len(record))

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()

    def close(self, *, sync: bool = True) -> None:
        if self._fd is not None:
            if sync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None  # type: ignore[assignment]


def write_metadata(folder: str | os.PathLike[str], meta: CheckpointMetadata, *,
                   checkpoint_id: str | None = None, sync: bool = True) -> int:
    """Write ``.metadata`` last, atomically (temporary name, fsync, rename), as DCP commits.

    Args:
        folder: the local checkpoint folder whose ``.distcp`` files are already written.
        meta: the index (tensors with chunk storage refs, objects, planner data, save id).
        checkpoint_id: recorded in ``storage_meta`` (DCP records the folder it saved to).
        sync: fsync it before the rename. False for a folder committed as a whole later: the
            caller fsyncs it before that commit (an fsync waits for the disk's cache flush,
            so the caller can verify the index meanwhile).

    Returns:
        The size of ``.metadata`` in bytes.

    Raises:
        IncompatibleCheckpointError: the index holds something DCP's format cannot express.

    Example:
        >>> write_metadata("out", meta, checkpoint_id="out")
    """
    data = _dcp_compat.encode_metadata(meta, checkpoint_id=checkpoint_id)
    tmp = os.path.join(os.fspath(folder), f"{METADATA}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(os.fspath(folder), METADATA))
    return len(data)

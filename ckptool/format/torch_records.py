"""Where an item's raw bytes sit inside its ``torch.save`` record, and what its pickle says.

DCP's ``FileSystemWriter`` writes every item as one ``torch.save`` archive appended to a
``.distcp`` file; its zip structure and CRC-32s are ``zip_records.py``'s. This module reads
``data.pkl`` with the allow-listed unpickler to learn the tensor's storage dtype, size,
offset, shape and strides (never assumed), or a non-tensor value's plain data.

Torch-free. Used by validate (``--deep``), consolidate and reshard.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from ckptool.errors import IncompatibleCheckpointError, UnsafeInputError
from ckptool.format.crc import crc32
from ckptool.format.dtypes import DType
from ckptool.format.metadata import StorageRef
from ckptool.format.pickle_globals import OBJECT_GLOBALS, TENSOR_GLOBALS, SavedBytes, _TensorStub, _storage_pid
from ckptool.format.safe_pickle import UnsafePickleError, safe_loads
from ckptool.format.zip_records import ZipEntry, ZipRecord
from ckptool.storage import RangeReader

__all__ = ["RecordReader", "RecordTemplate", "SavedBytes", "TensorLocation", "ZipEntry",
           "ZipRecord", "contiguous_strides", "record_outside", "tensor_from_head"]

_LOCAL = b"PK\x03\x04"  # a local zip header's signature


@dataclass(frozen=True)
class TensorLocation:
    """A tensor inside a record.

    ``data_offset`` is absolute in the ``.distcp`` file; the tensor's first element sits at
    ``data_offset + storage_offset * itemsize``. ``contiguous`` means the bytes
    ``[start, start + nbytes)`` are the tensor in row-major order, ready to copy as-is.
    """

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    data_offset: int
    entry: ZipEntry

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def start(self) -> int:
        return self.data_offset + self.storage_offset * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape) or self.numel <= 1


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class RecordReader(ZipRecord):
    """Parses one record (a ``StorageRef``) of an open ``.distcp`` file: its zip structure
    (``ZipRecord``) and the tensor or value its ``data.pkl`` describes."""

    def prefix(self) -> str:
        pkl = self.find("data.pkl")
        if pkl is None:
            raise self._bad("no data.pkl (not a torch.save record)")
        return pkl.name[: -len("data.pkl")]

    def tensor(self) -> TensorLocation:
        """Locate the tensor this record holds."""
        prefix = self.prefix()
        order = self.find("byteorder")
        if order is not None and self.read_entry(order, 16) != b"little":
            raise IncompatibleCheckpointError(f"{self.where} was saved big-endian", path=self.where)
        pkl = self.read_entry(self.find("data.pkl"))  # type: ignore[arg-type]
        try:
            obj = safe_loads(pkl, TENSOR_GLOBALS, persistent_load=_storage_pid)
        except UnsafePickleError as e:
            raise self._bad(f"data.pkl references {e.module}.{e.name}, which no tensor record "
                            "contains (possibly malicious; nothing was run)", UnsafeInputError) from None
        except Exception as e:  # noqa: BLE001
            raise self._bad(f"data.pkl is unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(obj, _TensorStub):
            raise self._bad(f"record holds a {type(obj).__name__}, not a tensor")
        entry = self.entries.get(f"{prefix}data/{obj.storage.key}")
        if entry is None:
            raise self._bad(f"storage data/{obj.storage.key} is missing from the record")
        st = obj.storage
        if entry.size != st.numel * st.dtype.itemsize:
            raise self._bad(f"storage holds {entry.size} bytes, data.pkl declares "
                            f"{st.numel} x {st.dtype.itemsize}")
        span = _span(obj.shape, obj.strides)
        if obj.offset + span > st.numel:
            raise self._bad("tensor view reaches past the end of its storage")
        return TensorLocation(st.dtype, obj.shape, obj.strides, obj.offset, st.numel,
                              self.data_offset(entry), entry)

    def load_object(self) -> Any:
        """The plain-data value of a non-tensor (bytes) record, via the safe unpickler.

        An ``io.BytesIO`` value comes back as a ``SavedBytes`` holding its bytes.
        """
        pkl = self.read_entry(self.find("data.pkl") or self._missing_pkl())
        try:
            return safe_loads(pkl, OBJECT_GLOBALS, persistent_load=_storage_pid)
        except UnsafePickleError as e:
            raise self._bad(f"data.pkl references {e.module}.{e.name}, which is not allowed in "
                            "a checkpoint value (possibly malicious; nothing was run)",
                            UnsafeInputError) from None
        except Exception as e:  # noqa: BLE001
            raise self._bad(f"data.pkl is unreadable ({type(e).__name__}: {e})") from None

    def _missing_pkl(self) -> ZipEntry:
        raise self._bad("no data.pkl (not a torch.save record)")


class RecordTemplate:
    """The layout of one fully verified tensor record, to check records shaped like it fast.

    DCP writes thousands of records that differ only in their tensor bytes, their random
    ``serialization_id`` and the CRC-32s of those two entries. A record of the same length
    whose every other byte equals the template's has the same verified structure and the
    same ``data.pkl`` (so the same dtype, shape and strides); only the two varying entries'
    CRC-32s are left to check. Anything that differs falls back to the full parse.

    With ``data_left_out``, the template and the records it checks are the record's bytes
    without the tensor's data (those before it, then those after: ``outside``), for a writer
    that proved the data by other means; the data's two stored CRC-32s must then agree, and
    ``data_crc`` gives them.
    """

    def __init__(self, rec: RecordReader, loc: TensorLocation, buf: bytes, *,
                 data_left_out: bool = False) -> None:
        self.data_start = loc.data_offset - rec.ref.offset
        cut = loc.entry.size if data_left_out else 0

        def at(pos: int) -> int:  # where a record byte sits in ``buf``
            return pos - cut if pos >= self.data_start + cut else pos

        varying = [e for e in rec.entries.values()
                   if e.name.endswith((f"/data/{loc.entry.name.rsplit('/', 1)[-1]}",
                                       ".data/serialization_id")) and e.shared[2] & 0x08]
        masks = []  # (start, end) byte ranges of ``buf`` allowed to differ
        self.crcs = []  # (data start, data end or None, descriptor crc pos, directory crc pos)
        self._data_crc: int | None = None  # where data_crc reads (empty data: not masked)
        for e in varying:
            start = rec.data_offset(e) - rec.ref.offset
            desc, cd = at(start + e.size + 4), at(e.cd_pos + 16)
            masks += [(desc, desc + 4), (cd, cd + 4)]
            if data_left_out and e.name == loc.entry.name:
                self.crcs.append((None, None, desc, cd))
                self._data_crc = desc
            else:
                masks.append((at(start), at(start + e.size)))
                self.crcs.append((at(start), at(start + e.size), desc, cd))
        self.segments, pos = [], 0
        for a, b in sorted(masks):
            self.segments.append((pos, a))
            pos = b
        self.segments.append((pos, len(buf)))
        self.buf = buf
        self.loc = loc  # dtype, shape and strides of every matching record (offsets differ)

    def matches(self, buf: bytes) -> bool:
        tpl = self.buf
        return len(buf) == len(tpl) and all(buf[a:b] == tpl[a:b] for a, b in self.segments)

    def crc_ok(self, buf: bytes) -> bool:
        view = memoryview(buf)
        for start, end, desc, cd in self.crcs:
            stored = struct.unpack_from("<I", buf, desc)[0]
            if stored != struct.unpack_from("<I", buf, cd)[0]:
                return False
            if start is not None and crc32(view[start:end]) != stored:
                return False
        return True

    def data_crc(self, outside: bytes) -> int:
        """The data's stored CRC-32 in a matching record's ``outside`` (``data_left_out``); for
        empty data (no data descriptor, nothing masked) the template's own."""
        if self._data_crc is None:
            return self.loc.entry.crc
        return struct.unpack_from("<I", outside, self._data_crc)[0]


def record_outside(reader: RangeReader, ref: StorageRef, start: int, size: int,
                   view: memoryview | None = None) -> bytes | None:
    """A record's bytes before and after its ``size`` data bytes at ``start`` (relative to the
    record): what a ``data_left_out`` template compares. Taken from ``view`` (the record's
    bytes in memory) where given, else read; None when the record is shorter than that."""
    if start < 0 or start + size > ref.length:
        return None
    if view is not None:
        head, tail = bytes(view[:start]), bytes(view[start + size:ref.length])
    else:
        head = reader.pread(ref.offset, start)
        tail = reader.pread(ref.offset + start + size, ref.length - start - size)
    return head + tail if len(head) + len(tail) == ref.length - size else None


def tensor_from_head(head: bytes, base: int) -> TensorLocation | None:
    """Where a tensor record's data lies, from its first bytes alone (``head``, read at file
    offset ``base``), before its zip directory at the end is read: ``data.pkl`` (the first
    entry) names the storage and gives dtype, shape and strides; the storage entry's local
    header says where its data starts. None unless all of that parses.

    A guess for reading a record as it streams: what the zip directory says (``RecordReader``)
    must be compared with it once it comes. The entry's CRC-32 and position are left 0."""
    try:
        if head[:4] != _LOCAL:
            return None
        nlen, xlen = struct.unpack_from("<HH", head, 26)
        pkl = head[30:30 + nlen].decode()
        obj = safe_loads(head[30 + nlen + xlen:], TENSOR_GLOBALS, persistent_load=_storage_pid)
        if not pkl.endswith("data.pkl") or not isinstance(obj, _TensorStub):
            return None
        name = (pkl[:-len("data.pkl")] + "data/" + obj.storage.key).encode()
        pos = head.find(_LOCAL, 4)
        while pos >= 0 and head[pos + 30:pos + 30 + len(name)] != name:
            pos = head.find(_LOCAL, pos + 4)
        if pos < 0 or struct.unpack_from("<H", head, pos + 26)[0] != len(name):
            return None
        extra = struct.unpack_from("<H", head, pos + 28)[0]
    except Exception:  # noqa: BLE001  (the zip directory, parsed later, says what is wrong)
        return None
    st = obj.storage
    if obj.offset < 0 or obj.offset + _span(obj.shape, obj.strides) > st.numel:
        return None
    entry = ZipEntry(name.decode(), 0, 0, st.numel * st.dtype.itemsize, pos)
    return TensorLocation(st.dtype, obj.shape, obj.strides, obj.offset, st.numel,
                          base + pos + 30 + len(name) + extra, entry)


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from the first to one past the last element addressed by a strided view."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


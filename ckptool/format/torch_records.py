"""Where an item's raw bytes sit inside its ``torch.save`` record, and whether they are intact.

DCP's ``FileSystemWriter`` writes every item as one ``torch.save`` archive: an uncompressed
zip (``archive/data.pkl``, ``archive/byteorder``, ``archive/data/0``, ...) appended to a
``.distcp`` file. This module parses the zip directory of one record with ranged reads,
reads ``data.pkl`` with the allow-listed unpickler to learn the tensor's storage dtype, size,
offset, shape and strides (never assumed), and checks each entry's CRC-32.

Torch-free. Used by validate (``--deep``), consolidate and reshard.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from ckptool.errors import (ChecksumError, CorruptCheckpointError, IncompatibleCheckpointError,
                            UnsafeInputError)
from ckptool.format.dtypes import BY_STORAGE, DType
from ckptool.format.metadata import StorageRef
from ckptool.format.safe_pickle import UnsafePickleError, safe_loads
from ckptool.storage import BLOCK, RangeReader

from ckptool.format.crc import crc32

_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_MAX_PKL = 64 << 20  # data.pkl of a tensor is ~200 bytes; of an object, small


@dataclass(frozen=True)
class ZipEntry:
    name: str
    method: int          # 0 = stored
    crc: int
    size: int            # uncompressed == compressed for stored entries
    header_offset: int   # of the local header, relative to the record start
    shared: bytes = b""  # version needed, flags, method, time, date: repeated in the local header
    cd_pos: int = -1     # of its central-directory record, relative to the record start


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


class RecordReader:
    """Parses one record (a ``StorageRef``) of an open ``.distcp`` file."""

    def __init__(self, reader: RangeReader, ref: StorageRef, where: str, *,
                 preload: int = 64 << 10) -> None:
        """``preload``: records up to this size are read in one call and parsed from memory."""
        self.reader = reader
        self.ref = ref
        self.where = where  # "<file> (item <fqn>)" for messages
        self._buf: bytes | None = None
        self._offsets: dict[str, int] = {}
        if ref.length <= preload:
            self._buf = reader.pread(ref.offset, ref.length)
            if len(self._buf) != ref.length:
                raise self._bad("record is cut short (file truncated)")
        if ref.transforms:
            raise IncompatibleCheckpointError(
                f"{where} uses DCP stream transforms {list(ref.transforms)} (e.g. compression), "
                "which ckptool does not read yet", path=where,
                hint="Save without storage extensions to use ckptool on it",
            )
        try:
            self.entries = self._directory()
        except (struct.error, ValueError, OverflowError) as e:
            raise self._bad(f"damaged zip directory ({e})") from None

    # -- zip directory ----------------------------------------------------------------------
    def _bad(self, what: str, cls: type[CorruptCheckpointError] = CorruptCheckpointError
             ) -> CorruptCheckpointError:
        return cls(f"{self.where}: {what}", path=self.where,
                   hint="The file is damaged; use an earlier checkpoint")

    def _read(self, rel_offset: int, length: int) -> bytes:
        if rel_offset < 0 or rel_offset + length > self.ref.length:
            raise self._bad("zip structure points outside the record")
        if self._buf is not None:
            return self._buf[rel_offset:rel_offset + length]
        data = self.reader.pread(self.ref.offset + rel_offset, length)
        if len(data) != length:
            raise self._bad("record is cut short (file truncated)")
        return data

    def _directory(self) -> dict[str, ZipEntry]:
        n = self.ref.length
        if n < 22:
            raise self._bad(f"record is {n} bytes, too short for a torch.save archive")
        tail_len = min(n, 65557)
        tail = self._read(n - tail_len, tail_len)
        pos = tail.rfind(_EOCD)
        if pos < 0 or len(tail) - pos < 22:
            raise self._bad("no zip directory (not a torch.save record, or truncated)")
        _, _, _, _, count, cd_size, cd_off, _ = struct.unpack_from("<4sHHHHIIH", tail, pos)
        if 0xFFFFFFFF in (cd_size, cd_off) or count == 0xFFFF:
            count, cd_size, cd_off = self._zip64(tail, pos)
        if cd_size > n or cd_off + cd_size > n:
            raise self._bad("zip directory lies outside the record")
        self._layout = (cd_off, cd_size, n - tail_len + pos, count)
        cd = self._read(cd_off, cd_size)
        self._cd_fixed: list[bytes] = []
        entries: dict[str, ZipEntry] = {}
        p = 0
        for _ in range(count):
            if cd[p:p + 4] != _CDIR or p + 46 > len(cd):
                raise self._bad("damaged zip directory")
            (_, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, _, _, _,
             hoff) = struct.unpack_from("<4sHHHHHHIIIHHHHHII", cd, p)
            name = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
            extra = cd[p + 46 + nlen:p + 46 + nlen + xlen]
            usize, csize, hoff = _zip64_extra(extra, usize, csize, hoff)
            if method != 0 or csize != usize:
                raise self._bad(f"entry {name} is compressed (method {method}); torch.save "
                                "records are stored uncompressed")
            if name in entries:
                raise self._bad(f"entry {name} appears twice")
            entries[name] = ZipEntry(name, method, crc, usize, hoff, cd[p + 6:p + 16], cd_off + p)
            # made-by, comment length, disk, attributes: the same for every entry torch writes
            self._cd_fixed.append(cd[p + 4:p + 6] + cd[p + 32:p + 42])
            if extra and not _padding_ok(extra):
                raise self._bad(f"extra field of {name} in the zip directory is damaged")
            p += 46 + nlen + xlen + clen
        if p != len(cd):
            raise self._bad("zip directory size disagrees with its entries")
        return entries

    def _zip64(self, tail: bytes, pos: int) -> tuple[int, int, int]:
        loc = tail.rfind(_EOCD64_LOC, 0, pos)
        if loc < 0:
            raise self._bad("zip64 record without its locator")
        (eocd64_off,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = self._read(eocd64_off, 56)
        if rec[:4] != _EOCD64:
            raise self._bad("damaged zip64 directory")
        count, cd_size, cd_off = struct.unpack_from("<QQQ", rec, 32)
        return count, cd_size, cd_off

    def data_offset(self, entry: ZipEntry) -> int:
        """Absolute file offset of an entry's first data byte (from its local header)."""
        cached = self._offsets.get(entry.name)
        if cached is not None:
            return cached
        head = self._read(entry.header_offset, 30)
        if head[:4] != _LOCAL:
            raise self._bad(f"local header of {entry.name} is damaged")
        nlen, xlen = struct.unpack_from("<HH", head, 26)
        start = entry.header_offset + 30 + nlen + xlen
        if start + entry.size > self.ref.length:
            raise self._bad(f"entry {entry.name} runs past the end of the record")
        self._offsets[entry.name] = self.ref.offset + start
        return self.ref.offset + start

    def _check_local(self, entry: ZipEntry) -> int:
        """Compare every local-header and data-descriptor byte of ``entry`` with what the
        zip directory implies; return the record offset just past the entry."""
        start = self.data_offset(entry) - self.ref.offset
        head = self._read(entry.header_offset, start - entry.header_offset)
        nlen = len(entry.name.encode())
        descriptor = bool(entry.shared[2] & 0x08)
        sizes = bytes(12) if descriptor else struct.pack("<III", entry.crc, entry.size, entry.size)
        xlen = len(head) - 30 - nlen
        expected = (_LOCAL + entry.shared + sizes + struct.pack("<HH", nlen, xlen)
                    + entry.name.encode())
        if head[:30 + nlen] != expected or not _padding_ok(head[30 + nlen:]):
            raise self._bad(f"local header of {entry.name} disagrees with the zip directory "
                            "(damaged bytes)")
        end = start + entry.size
        if not descriptor:
            return end
        big = entry.size >= 0xFFFFFFFF
        want = b"PK\x07\x08" + struct.pack("<IQQ" if big else "<III", entry.crc, entry.size, entry.size)
        if self._read(end, len(want)) != want:
            raise self._bad(f"data descriptor of {entry.name} is damaged")
        return end + len(want)

    def find(self, suffix: str) -> ZipEntry | None:
        for name, e in self.entries.items():
            if name.endswith(suffix) and name.count("/") == suffix.count("/") + 1:
                return e
        return None

    def prefix(self) -> str:
        pkl = self.find("data.pkl")
        if pkl is None:
            raise self._bad("no data.pkl (not a torch.save record)")
        return pkl.name[: -len("data.pkl")]

    def read_entry(self, entry: ZipEntry, limit: int = _MAX_PKL) -> bytes:
        if entry.size > limit:
            raise self._bad(f"entry {entry.name} is {entry.size} bytes, larger than expected")
        start = self.data_offset(entry) - self.ref.offset
        return self._read(start, entry.size)

    # -- checks -----------------------------------------------------------------------------
    def verify_structure(self) -> None:
        """Every byte outside the CRC-covered data is accounted for.

        Entries follow each other with no gap (local header, name, padding, data, data
        descriptor), the directory follows the last one, and the end records close the record.
        """
        cd_off, cd_size, eocd_pos, count = self._layout
        pos = 0
        for e in sorted(self.entries.values(), key=lambda x: x.header_offset):
            if e.header_offset != pos:
                raise self._bad(f"unaccounted bytes before {e.name} (damaged zip structure)")
            pos = self._check_local(e)
        if pos != cd_off or len(set(self._cd_fixed)) > 1:
            raise self._bad("zip directory does not follow the entries (damaged zip structure)")
        end = cd_off + cd_size
        if end != eocd_pos:  # zip64 end record + locator sit between directory and end record
            rec = self._read(end, 56)
            loc = self._read(eocd_pos - 20, 20)
            # miniz (torch's zip writer) always records made-by 0x031e, needed 45 (zip64)
            ok = (rec[:4] == _EOCD64 and struct.unpack_from("<QHH", rec, 4) == (44, 0x031E, 45)
                  and struct.unpack_from("<IIQQQQ", rec, 16) == (0, 0, count, count, cd_size, cd_off)
                  and loc[:4] == _EOCD64_LOC and struct.unpack_from("<IQI", loc, 4) == (0, end, 1)
                  and eocd_pos == end + 56 + 20)
            if not ok:
                raise self._bad("zip64 end record is damaged")
        eocd = self._read(eocd_pos, self.ref.length - eocd_pos)
        d0, d1, c0, c1, size, off, clen = struct.unpack_from("<HHHHIIH", eocd, 4)
        if (d0, d1, clen) != (0, 0, 0) or len(eocd) != 22 or c0 != c1 or c0 not in (count, 0xFFFF) \
                or size not in (cd_size, 0xFFFFFFFF) or off not in (cd_off, 0xFFFFFFFF):
            raise self._bad("zip end record is damaged")

    def verify_crc(self) -> None:
        """Check the zip structure and the CRC-32 of every entry, streaming in fixed blocks."""
        self.verify_structure()
        for e in self.entries.values():
            pos, left, crc = self.data_offset(e), e.size, 0
            while left:
                n = min(left, BLOCK)
                b = self._read(pos - self.ref.offset, n) if self._buf is not None \
                    else self.reader.pread(pos, n)
                if not b:
                    raise self._bad(f"entry {e.name} is cut short (file truncated)")
                crc = crc32(b, crc)
                pos += len(b)
                left -= len(b)
            if crc != e.crc:
                raise self._bad(f"CRC-32 mismatch in {e.name} (stored {e.crc:08x}, "
                                f"computed {crc:08x}): the bytes are damaged", ChecksumError)

    def tensor(self) -> TensorLocation:
        """Locate the tensor this record holds."""
        prefix = self.prefix()
        order = self.find("byteorder")
        if order is not None and self.read_entry(order, 16) != b"little":
            raise IncompatibleCheckpointError(f"{self.where} was saved big-endian", path=self.where)
        pkl = self.read_entry(self.find("data.pkl"))  # type: ignore[arg-type]
        try:
            obj = safe_loads(pkl, _TENSOR_GLOBALS, persistent_load=_storage_pid)
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
            return safe_loads(pkl, _OBJECT_GLOBALS, persistent_load=_storage_pid)
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
    """

    def __init__(self, rec: RecordReader, loc: TensorLocation, buf: bytes) -> None:
        varying = [e for e in rec.entries.values()
                   if e.name.endswith((f"/data/{loc.entry.name.rsplit('/', 1)[-1]}",
                                       ".data/serialization_id")) and e.shared[2] & 0x08]
        masks = []  # (start, end) relative byte ranges allowed to differ
        self.crcs = []  # (data start, data end, descriptor crc pos, directory crc pos)
        for e in varying:
            start = rec.data_offset(e) - rec.ref.offset
            masks += [(start, start + e.size), (start + e.size + 4, start + e.size + 8),
                      (e.cd_pos + 16, e.cd_pos + 20)]
            self.crcs.append((start, start + e.size, start + e.size + 4, e.cd_pos + 16))
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
            if stored != struct.unpack_from("<I", buf, cd)[0] or crc32(view[start:end]) != stored:
                return False
        return True


def _padding_ok(extra: bytes) -> bool:
    """Extra fields parse exactly; torch's alignment padding ("FB") is all 'Z'."""
    p = 0
    while p + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, p)
        body = extra[p + 4:p + 4 + size]
        if len(body) != size or tag not in (0x4246, 0x0001) or (tag == 0x4246 and body.strip(b"Z")):
            return False
        p += 4 + size
    return p == len(extra)


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from the first to one past the last element addressed by a strided view."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


@dataclass(frozen=True)
class _StorageStub:
    dtype: DType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorStub:
    storage: _StorageStub
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: DType


def _storage_pid(pid: Any) -> _StorageStub:
    # torch.save's zip format: ('storage', storage_type, key, location, numel)
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
            or type(pid[4]) is not int or pid[4] < 0 or not pid[2].isdigit()):
        raise ValueError(f"unexpected persistent id {pid!r}")
    return _StorageStub(pid[1].dtype, pid[2], pid[4])


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorStub:
    if not isinstance(storage, _StorageStub):
        raise ValueError("tensor without storage")
    dims = (offset, *size, *stride)
    if not all(type(x) is int and x >= 0 for x in dims) or len(size) != len(stride):
        raise ValueError("bad tensor geometry")
    return _TensorStub(storage, offset, tuple(size), tuple(stride))


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch", "Size"): lambda dims=(): tuple(dims),
    **{("torch", name): _StorageType(dt) for name, dt in BY_STORAGE.items()},
}


class SavedBytes:
    """An ``io.BytesIO`` value of a state dict, as data: its bytes, nothing else.

    DCP's default planner saves every non-tensor value with ``torch.save``, a ``BytesIO`` too,
    so its record pickles ``_io.BytesIO``: NEWOBJ (``BytesIO.__new__``) then BUILD with the
    object's state ``(value, position, __dict__)``. This stand-in accepts exactly that shape
    (type-checked) and keeps only ``data``; nothing in it can run code. (torchtitan's older
    ``train_state`` held three, each a ``torch.save`` archive of a list: opaque bytes here.)
    """

    __slots__ = ("data",)

    def __init__(self, initial: Any = b"") -> None:  # a hand-made REDUCE(BytesIO, (b"...",))
        self.data = _bytes_of(initial)

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and type(state[1]) is int
                and (state[2] is None or type(state[2]) is dict)):
            raise ValueError("bad state for io.BytesIO")
        self.data = _bytes_of(state[0])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SavedBytes) and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        return f"SavedBytes({len(self.data)} bytes)"


def _bytes_of(value: Any) -> bytes:
    if type(value) not in (bytes, bytearray):
        raise ValueError(f"io.BytesIO value is a {type(value).__name__}, not bytes")
    return bytes(value)


#: What a non-tensor value's record may name: the tensor globals (a value may hold tensors)
#: and ``io.BytesIO`` as ``SavedBytes``.
_OBJECT_GLOBALS: dict[tuple[str, str], Any] = {**_TENSOR_GLOBALS, ("_io", "BytesIO"): SavedBytes}


def _zip64_extra(extra: bytes, usize: int, csize: int, hoff: int) -> tuple[int, int, int]:
    """Replace 0xFFFFFFFF sizes/offsets with their values from the ZIP64 extra field."""
    p = 0
    while p + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, p)
        if tag == 0x0001:
            q = p + 4
            vals = []
            for flag in (usize, csize, hoff):
                if flag == 0xFFFFFFFF and q + 8 <= p + 4 + size:
                    vals.append(struct.unpack_from("<Q", extra, q)[0])
                    q += 8
                else:
                    vals.append(flag)
            return vals[0], vals[1], vals[2]
        p += 4 + size
    return usize, csize, hoff

"""The zip structure of one ``torch.save`` record inside a ``.distcp`` file, and its CRC-32s.

DCP's ``FileSystemWriter`` writes every item as one ``torch.save`` archive: an uncompressed
zip (``archive/data.pkl``, ``archive/byteorder``, ``archive/data/0``, ...) appended to a
``.distcp`` file. ``ZipRecord`` parses the zip directory of one record with ranged reads (or
from the record's bytes already in memory), accounts for every byte outside the entries'
data, and checks each entry's CRC-32. What the entries mean (the pickled tensor) is
``torch_records.py``'s.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ckptool.errors import (
    ChecksumError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from ckptool.format.crc import crc32
from ckptool.format.metadata import StorageRef
from ckptool.storage import BLOCK, RangeReader

_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_MAX_PKL = 64 << 20  # data.pkl of a tensor is ~200 bytes; of an object, small
#: Entries in memory are checksummed in windows of this size, each one in place if the page
#: cache holds it, else read.
CRC_WINDOW = 64 << 20


@dataclass(frozen=True)
class ZipEntry:
    name: str
    method: int          # 0 = stored
    crc: int
    size: int            # uncompressed == compressed for stored entries
    header_offset: int   # of the local header, relative to the record start
    shared: bytes = b""  # version needed, flags, method, time, date: repeated in the local header
    cd_pos: int = -1     # of its central-directory record, relative to the record start




class ZipRecord:
    """The zip structure of one record (a ``StorageRef``) of an open ``.distcp`` file."""

    def __init__(self, reader: RangeReader, ref: StorageRef, where: str, *,
                 preload: int = 64 << 10, view: memoryview | None = None,
                 resident: Callable[[int, int], bool] | None = None) -> None:
        """Parse the record's zip directory.

        Args:
            reader: the open ``.distcp`` file.
            ref: where the record lies in it.
            where: "<file> (item <fqn>)", for messages.
            preload: records up to this size are read in one call and parsed from memory.
            view: the record's bytes, already in memory (e.g. a slice of the mapped file):
                nothing is read through ``reader`` and nothing is copied.
            resident: with ``view``, ``resident(offset, length)`` (absolute file offsets) tells
                whether a window of data is in the page cache; one that is not is read through
                ``reader`` instead (large reads beat page faults on a cold cache).
        """
        self.reader = reader
        self.ref = ref
        self.where = where
        self._buf: bytes | memoryview | None = view
        self._resident = resident
        self._offsets: dict[str, int] = {}
        if view is None and ref.length <= preload:
            self._buf = reader.pread(ref.offset, ref.length)
        if self._buf is not None and len(self._buf) != ref.length:
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
            return bytes(self._buf[rel_offset:rel_offset + length])  # no copy if already bytes
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
            crc = self._entry_crc(e)
            if crc != e.crc:
                raise self._bad(f"CRC-32 mismatch in {e.name} (stored {e.crc:08x}, "
                                f"computed {crc:08x}): the bytes are damaged", ChecksumError)

    def _entry_crc(self, e: ZipEntry) -> int:
        """CRC-32 of an entry's data: in place where it is in memory, else read in blocks."""
        if self._buf is None:
            return self._range_crc(e, None)
        with memoryview(self._buf) as buf:  # released here, before a mapping is closed
            base = self.ref.offset
            return self._range_crc(e, lambda pos, n: buf[pos - base:pos - base + n])

    def _range_crc(self, e: ZipEntry, view_at: Callable[[int, int], memoryview] | None) -> int:
        try:
            return range_crc(self.reader, self.data_offset(e), e.size, view_at=view_at,
                             resident=self._resident)
        except EOFError:
            raise self._bad(f"entry {e.name} is cut short (file truncated)") from None


def range_crc(reader: RangeReader, pos: int, size: int, *,
              view_at: Callable[[int, int], memoryview] | None = None,
              resident: Callable[[int, int], bool] | None = None) -> int:
    """CRC-32 of the bytes ``[pos, pos + size)`` of the file ``reader`` reads.

    With ``view_at(pos, n)`` (the file's bytes already in memory, e.g. mapped), each window of
    ``CRC_WINDOW`` bytes is checksummed in place, unless ``resident(pos, n)`` says it is not in
    the page cache: that window is read in blocks instead (large reads beat page faults on a
    cold cache). Without ``view_at``, everything is read in blocks. Raises ``EOFError`` when
    the file ends first.
    """
    crc, end = 0, pos + size
    if view_at is None:
        return _read_crc(reader, pos, size, crc)
    for at in range(pos, end, CRC_WINDOW):
        n = min(CRC_WINDOW, end - at)
        if resident is None or resident(at, n):
            view = view_at(at, n)
            if len(view) != n:
                raise EOFError
            crc = crc32(view, crc)
        else:
            crc = _read_crc(reader, at, n, crc)
    return crc


def _read_crc(reader: RangeReader, pos: int, left: int, crc: int) -> int:
    """Continue ``crc`` over ``left`` bytes of the file at ``pos``, read in blocks."""
    while left:
        b = reader.pread(pos, min(left, BLOCK))
        if not b:
            raise EOFError
        crc = crc32(b, crc)
        pos += len(b)
        left -= len(b)
    return crc


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

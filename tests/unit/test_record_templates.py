"""The writer's read-back of records shaped like one already checked in full
(``check_record(templates=...)``): it reads only the bytes outside the data, and must still
catch any of them that differ, and fall back to the full parse for what does not match."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from ckptool.errors import CorruptCheckpointError
from ckptool.format.copy_engine import Ticker
from ckptool.format.dcp_output import write_rank_files, write_tensor
from ckptool.format.dcp_writer import TensorRecord, tensor_record
from ckptool.format.dtypes import DTYPES
from ckptool.format.torch_records import RecordReader

F32 = DTYPES["float32"]
ROWS = 8  # every item is one float32 tensor of this shape: one template per file


def _items(n: int) -> list[tuple[int, bytes]]:
    return [(i, struct.pack(f"<{ROWS}f", *range(i, i + ROWS))) for i in range(n)]


def _expected(item):
    return F32, (ROWS,)


def _writer(damage=None):
    """write_item: the record, data proven as written (as import's compare does); then
    ``damage(blob, item)`` may change the bytes on disk before the read-back."""

    def write(f, item, buf):
        start = f.size
        write_tensor(f, F32, (ROWS,), [[item[1]]], lambda n: None, buf)
        if damage is not None:
            blob = bytearray(os.pread(f._fd, f.size - start, start))
            if damage(blob, item):
                os.pwrite(f._fd, bytes(blob), start)
        return True

    return write


def _parses(monkeypatch) -> list[int]:
    """Count the full parses (RecordReader built) of the read-back."""
    count = [0]
    real = RecordReader.__init__

    def counting(self, *a, **k):
        count[0] += 1
        real(self, *a, **k)

    monkeypatch.setattr(RecordReader, "__init__", counting)
    return count


def test_records_like_a_checked_one_are_not_parsed_again(tmp_path, monkeypatch):
    parses = _parses(monkeypatch)
    [w] = write_rank_files(tmp_path, [_items(6)], _writer(), ticker=Ticker(None, 0), workers=1,
                           check=_expected)
    assert parses[0] == 1  # the first record; the other five matched its template
    # what the read-back found of every record is what the file holds
    for (i, data), ref in w.items:
        crc, size, shape = w.checked[(ref.offset, ref.length)]
        assert (crc, size, shape) == (zlib.crc32(data), len(data), (ROWS,))


_REC = TensorRecord(F32, (ROWS,))
_END = _REC.data_offset + _REC.nbytes  # where the bytes after the data start


@pytest.mark.parametrize("where", [
    10,                      # the first local header
    _REC.data_offset - 40,   # inside data.pkl's region / padding before the data
    _END + 5,                # the data descriptor's CRC-32
    _END + 60,               # inside version / serialization id entries
    -30,                     # the zip directory's end records
    -120,                    # the central directory
])
def test_a_damaged_byte_outside_the_data_of_a_later_record_is_caught(tmp_path, where):
    def damage(blob, item):
        if item[0] != 3:
            return False
        blob[where] ^= 0x01
        return True

    with pytest.raises(CorruptCheckpointError, match="verification failed"):
        write_rank_files(tmp_path, [_items(6)], _writer(damage), ticker=Ticker(None, 0),
                         workers=1, check=_expected)


def test_a_changed_serialization_id_is_caught(tmp_path):
    # the serialization id differs from record to record, so the template does not compare
    # its bytes: its CRC-32 must still match them
    def damage(blob, item):
        if item[0] != 2:
            return False
        sid = bytes(blob).find(b".data/serialization_id") + len(".data/serialization_id")
        pos = bytes(blob).find(b"PK\x07\x08", sid)  # its data ends at its descriptor
        blob[pos - 1] = ord("0") if blob[pos - 1] != ord("0") else ord("1")
        return True

    with pytest.raises(CorruptCheckpointError, match="verification failed"):
        write_rank_files(tmp_path, [_items(4)], _writer(damage), ticker=Ticker(None, 0),
                         workers=1, check=_expected)


def test_a_record_unlike_the_template_is_parsed_in_full(tmp_path, monkeypatch):
    parses = _parses(monkeypatch)
    # the same dtype, shape and length, but a record a template cannot vouch for (its
    # data.pkl bytes differ, as another writer's might): parsed, and refused for its shape
    other = tensor_record(F32, (ROWS // 2, 2), struct.pack(f"<{ROWS}f", *range(ROWS)))

    def write(f, item, buf):
        if item[0] == 2:
            assert len(other) == _REC.length
            f.write(other)
            return True
        return _writer()(f, item, buf)

    with pytest.raises(CorruptCheckpointError, match=r"holds float32 \[4, 2\]"):
        write_rank_files(tmp_path, [_items(4)], write, ticker=Ticker(None, 0), workers=1,
                         check=_expected)
    assert parses[0] == 2


def test_unproven_data_is_always_read_in_full(tmp_path, monkeypatch):
    parses = _parses(monkeypatch)

    def unproven(f, item, buf):
        write_tensor(f, F32, (ROWS,), [[item[1]]], lambda n: None, buf)
        return False

    write_rank_files(tmp_path, [_items(4)], unproven, ticker=Ticker(None, 0), workers=1,
                     check=_expected)
    assert parses[0] == 4


def test_empty_tensors_shaped_alike_are_checked(tmp_path, monkeypatch):
    # an empty tensor's record has no data descriptor: nothing of the data is masked
    parses = _parses(monkeypatch)

    def empty(f, item, buf):
        write_tensor(f, F32, (0, 4), [[b""]], lambda n: None, buf)
        return True

    [w] = write_rank_files(tmp_path, [[1, 2, 3]], empty, ticker=Ticker(None, 0), workers=1,
                           check=lambda item: (F32, (0, 4)))
    assert parses[0] == 1
    assert sorted(w.checked.values()) == [(0, 0, (0, 4))] * 3

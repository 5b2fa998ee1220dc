"""format.mapped_file.cached_window and row_source.read_blocks(in_place=True): the bytes of the
page cache where they lie, the same bytes a read gives, at any offset."""

from __future__ import annotations

import os

import pytest

from ckptool.format.crc import crc32
from ckptool.format.mapped_file import cached_window
from ckptool.format.row_source import ByteRange, read_blocks
from ckptool.storage import Storage


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(3 * (1 << 20) + 12345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("offset,length", [(0, 4096), (1, 100), (70001, 1 << 20), (12345, 3 << 20)])
def test_window_is_the_files_bytes(data_file, offset, length):
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        with cached_window(fd, offset, length) as view:
            if getattr(os, "RWF_NOWAIT", None) is not None:
                assert view is not None  # just written: in the page cache
            if view is not None:
                assert bytes(view) == data[offset:offset + length]
    finally:
        os.close(fd)


def test_no_window_without_a_file():
    with cached_window(None, 0, 10) as view:
        assert view is None
    with cached_window(0, 0, 0) as view:
        assert view is None


def test_in_place_blocks_give_the_same_bytes_and_see_a_flipped_one(data_file):
    path, data = data_file
    st = Storage.open(path.parent)
    with st.reader(path.name) as reader:
        r = ByteRange(None, reader, 777, 0, len(data) - 1000)
        buf = bytearray(1 << 20)
        copied = b"".join(bytes(b) for b in read_blocks(r, buf))
        in_place = b"".join(bytes(b) for b in read_blocks(r, buf, in_place=True))
    assert copied == in_place == data[777:len(data) - 223]
    flipped = bytearray(data)
    flipped[2_000_000] ^= 1
    path.write_bytes(flipped)
    with st.reader(path.name) as reader:
        r = ByteRange(None, reader, 777, 0, len(data) - 1000)
        crc = 0
        for b in read_blocks(r, bytearray(1 << 20), in_place=True):
            crc = crc32(b, crc)
    assert crc == crc32(bytes(flipped[777:len(data) - 223])) != crc32(data[777:len(data) - 223])

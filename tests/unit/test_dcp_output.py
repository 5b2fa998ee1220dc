"""format/dcp_output.py: the one per-rank output writer of reshard and import, and its
read-back check (what verification relies on: damaged output bytes are caught)."""

from __future__ import annotations

import os
import struct

import pytest

from ckptool.errors import ConfigError, CorruptCheckpointError
from ckptool.format.copy_engine import Ticker
from ckptool.format.dcp_output import (
    check_world_size,
    file_sizes,
    rank_file_name,
    write_rank_files,
    write_tensor,
)
from ckptool.format.dcp_writer import TensorRecord, tensor_record
from ckptool.format.dtypes import DTYPES
from ckptool.format.metadata import METADATA

F32 = DTYPES["float32"]


def _items(n: int) -> list[tuple[str, bytes]]:
    return [(f"t{i}", struct.pack(f"<{4 * (i + 1)}f", *range(4 * (i + 1)))) for i in range(n)]


def _write_whole(f, item, buf) -> None:
    _, data = item
    write_tensor(f, F32, (len(data) // 4,), [[data]], lambda n: None, buf)


def test_writes_one_file_per_rank_in_item_order(tmp_path):
    ranks = [_items(2), _items(3), []]
    written = write_rank_files(tmp_path, ranks, _write_whole, ticker=Ticker(None, 0), workers=2,
                               check=lambda item: (F32, (len(item[1]) // 4,)))
    assert [w.name for w in written] == [rank_file_name(r) for r in range(3)]
    for w, items in zip(written, ranks):
        blob = (tmp_path / w.name).read_bytes()
        assert w.size == len(blob)
        assert [item for item, _ in w.items] == items
        for (_, data), ref in ((item, ref) for item, ref in w.items):
            assert blob[ref.offset:ref.offset + ref.length] == tensor_record(
                F32, (len(data) // 4,), data)


def test_read_back_catches_bytes_that_differ_on_disk(tmp_path):
    def damaged(f, item, buf):  # the record claims the CRC of data it does not hold
        _, data = item
        blob = bytearray(tensor_record(F32, (len(data) // 4,), data))
        blob[TensorRecord(F32, (len(data) // 4,)).data_offset + 3] ^= 0xFF  # inside the data
        f.write(blob)

    with pytest.raises(CorruptCheckpointError, match="verification failed.*CRC-32 mismatch"):
        write_rank_files(tmp_path, [_items(3)], damaged, ticker=Ticker(None, 0), workers=1,
                         check=lambda item: (F32, (len(item[1]) // 4,)))
    # without the check the same bytes are written as they are
    write_rank_files(tmp_path, [_items(3)], damaged, ticker=Ticker(None, 0), workers=1)


def test_read_back_catches_a_record_of_another_shape(tmp_path):
    with pytest.raises(CorruptCheckpointError, match=r"verification failed.*written as float32"):
        write_rank_files(tmp_path, [_items(1)], _write_whole, ticker=Ticker(None, 0), workers=1,
                         check=lambda item: (F32, (99,)))


def test_write_tensor_returns_each_piece_crc(tmp_path):
    import zlib

    from ckptool.format.dcp_writer import DistcpFile

    a, b = b"\x00" * 8, bytes(range(8))
    with DistcpFile(tmp_path / "x") as f:
        parts = write_tensor(f, F32, (4,), [[a[:4], a[4:]], [b]], lambda n: None, bytearray(8))
    assert parts == [(zlib.crc32(a), 8), (zlib.crc32(b), 8)]
    assert (tmp_path / "x").read_bytes() == tensor_record(F32, (4,), a + b)


def test_world_size_and_file_sizes():
    with pytest.raises(ConfigError, match="positive integer"):
        check_world_size(0)
    files = {"__1_0.distcp": (5, "a"), "__0_0.distcp": (3, "b"), METADATA: (7, "c"),
             "hf_assets/config.json": (2, "d")}
    assert list(file_sizes(files).items()) == [("__0_0.distcp", 3), ("__1_0.distcp", 5),
                                               (METADATA, 7)]


def _flaky_copy(monkeypatch) -> None:
    """Every kernel copy leaves one byte in the file different from the source's."""
    from ckptool.format import dcp_writer

    original = dcp_writer.DistcpFile._copy

    def flaky(self, fd, offset, want, view):
        n = original(self, fd, offset, want, view)
        os.pwrite(self._fd, bytes([os.pread(self._fd, 1, self.size + 5)[0] ^ 1]), self.size + 5)
        return n

    monkeypatch.setattr(dcp_writer.DistcpFile, "_copy", flaky)


def test_reshard_refuses_output_that_differs_from_the_source(tmp_path, monkeypatch):
    """End to end: a copy whose bytes in the file differ from the source's."""
    import numpy as np

    from ckptool.format.dcp_writer import DistcpFile, write_metadata
    from ckptool.format.metadata import CheckpointMetadata, Chunk, TensorEntry
    from ckptool.ops.reshard import reshard

    src = tmp_path / "src"
    src.mkdir()
    data = np.arange(64 * 16, dtype=np.float32).tobytes()
    with DistcpFile(src / "__0_0.distcp") as f:
        ref = f.append_record(tensor_record(F32, (64, 16), data))
    t = TensorEntry("w", F32, (64, 16), (Chunk((0, 0), (64, 16), ref),))
    write_metadata(src, CheckpointMetadata(tensors={"w": t}, objects={}))
    _flaky_copy(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match="verification failed.*CRC-32 mismatch"):
        reshard(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert reshard(src, tmp_path / "out", world_size=2).verified


def test_import_refuses_output_that_differs_from_the_source(tmp_path, monkeypatch):
    import json

    from ckptool.ops.import_hf import import_hf

    data = struct.pack("<64f", *range(64))
    header = json.dumps({"w": {"dtype": "F32", "shape": [16, 4], "data_offsets": [0, 256]}})
    header += " " * (-len(header) % 8)
    src = tmp_path / "model.safetensors"
    src.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data)
    _flaky_copy(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match="verification failed.*CRC-32 mismatch"):
        import_hf(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert import_hf(src, tmp_path / "out", world_size=2).verified


def test_copy_range_falls_back_where_the_kernel_cannot_copy(tmp_path, monkeypatch):
    import errno
    import zlib

    import xxhash

    from ckptool.format.dcp_writer import DistcpFile

    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    data = bytes(range(256)) * 100
    (tmp_path / "src").write_bytes(b"head" + data)
    fd = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with DistcpFile(tmp_path / "out") as f:
            f.write(b"x")
            crc = 0
            for block in f.copy_range(fd, 4, len(data), bytearray(1000), "src"):
                crc = zlib.crc32(block, crc)
    finally:
        os.close(fd)
    assert crc == zlib.crc32(data)
    assert (tmp_path / "out").read_bytes() == b"x" + data
    assert f.size == 1 + len(data)
    assert f.digest == xxhash.xxh3_64(b"x" + data).hexdigest()


def test_meanwhile_sees_every_file_written_and_its_error_is_raised(tmp_path):
    seen = []

    def index(written):
        seen.append([(w.name, (tmp_path / w.name).stat().st_size == w.size) for w in written])
        raise CorruptCheckpointError("index failed")

    with pytest.raises(CorruptCheckpointError, match="index failed"):
        write_rank_files(tmp_path, [_items(2), _items(1)], _write_whole, ticker=Ticker(None, 0),
                         workers=2, meanwhile=index)
    assert seen == [[(rank_file_name(0), True), (rank_file_name(1), True)]]

"""``validate --deep`` checks a record laid out like one it verified in full, in any file and of
any size, against that one's template (its bytes outside the data compared, its data's CRC-32
computed): few full parses, and every damaged byte still found, in the data or outside it."""

from __future__ import annotations

import shutil
import struct
import warnings
from pathlib import Path

import pytest

from ckptool.format.mapped_file import MappedFile
from ckptool.ops import deep_check
from ckptool.ops.validate import validate

N = 4
ROWS = 1 << 17  # 512 KiB of float32 a record: larger than any whole-record buffer


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Four same-shape tensors, one record per file (as FSDP ranks' chunks of one tensor lie)."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("tpl") / "ck"
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(ROWS, generator=g) for i in range(N)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False))
    assert len(list(path.glob("*.distcp"))) == N
    return path


def _parses(monkeypatch) -> list[int]:
    """Count the records deep validation parses in full."""
    count = [0]
    real = deep_check.RecordReader

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(deep_check, "RecordReader", counting)
    return count


def _last_file(src: Path, dst: Path) -> Path:
    """A copy of ``src``; the path of its last ``.distcp`` file (checked last, by template)."""
    shutil.copytree(src, dst)
    return sorted(dst.glob("*.distcp"))[-1]


def _damage(f: Path, at, value=None) -> None:
    data = bytearray(f.read_bytes())
    pos = at(bytes(data))
    data[pos] = data[pos] ^ 0xFF if value is None else value
    f.write_bytes(bytes(data))


def _errors(path: Path) -> list[tuple[str, str]]:
    report = validate(path, deep=True)
    return [(f.code, f.fqn) for f in report.errors]


@pytest.mark.parametrize("resident", [True, False], ids=["in-place", "read"])
def test_records_alike_across_files_are_parsed_once(saved, monkeypatch, resident):
    monkeypatch.setattr(MappedFile, "resident", lambda self, offset, length: resident)
    monkeypatch.setattr(deep_check.os, "cpu_count", lambda: 1)  # one worker: files in order
    count = _parses(monkeypatch)
    assert validate(saved, deep=True).ok
    assert count[0] == 1  # the first record; the other three by its template


@pytest.mark.parametrize("resident", [True, False], ids=["in-place", "read"])
def test_a_flipped_data_byte_in_a_templated_record_is_found(saved, tmp_path, monkeypatch,
                                                             resident):
    monkeypatch.setattr(MappedFile, "resident", lambda self, offset, length: resident)
    f = _last_file(saved, tmp_path / "bad")
    _damage(f, lambda b: len(b) // 2)  # inside the 512 KiB of data
    assert _errors(tmp_path / "bad") == [("crc-mismatch", f"w{N - 1}")]


def _data_pkl_shape(b: bytes) -> int:
    """Where the shape's first dimension (BININT ROWS) lies in data.pkl."""
    return b.index(b"J" + struct.pack("<i", ROWS)) + 1


def test_a_changed_byte_outside_the_data_is_found(saved, tmp_path):
    f = _last_file(saved, tmp_path / "bad")
    _damage(f, _data_pkl_shape, value=0x01)  # data.pkl now says another shape; its CRC differs
    errors = _errors(tmp_path / "bad")
    assert len(errors) == 1 and errors[0][1] == f"w{N - 1}"


def test_disagreeing_stored_crcs_of_the_data_are_found(saved, tmp_path):
    """The data's CRC-32 in its data descriptor changed: the directory's no longer agrees."""
    f = _last_file(saved, tmp_path / "bad")

    def descriptor_crc(b: bytes) -> int:
        return b.index(b"PK\x07\x08", len(b) // 2) + 4  # the data entry's descriptor

    _damage(f, descriptor_crc)
    errors = _errors(tmp_path / "bad")
    assert len(errors) == 1 and errors[0][1] == f"w{N - 1}"

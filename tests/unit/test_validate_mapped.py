"""``validate --deep`` on mapped files: one flipped byte is found whether the bytes are checksummed
in place (page cache) or read (not cached), in one window or several; ``Severity`` stays a string.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ckptool.format.zip_records as zr
from ckptool.format.mapped_file import MappedFile
from ckptool.ops.validate import Severity, validate


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("mapped") / "ck"
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(3 << 18, generator=g), "small": torch.arange(10.0)}  # 3 MiB + 40 B
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True))
    return path


def _flip_in_big(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with one byte of the big tensor's data inverted."""
    import shutil

    shutil.copytree(src, dst)
    (f,) = dst.glob("*.distcp")
    data = bytearray(f.read_bytes())
    mid = len(data) // 2  # inside the 3 MiB of tensor data
    data[mid] ^= 0xFF
    f.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("resident", [True, False], ids=["in-place", "read"])
@pytest.mark.parametrize("window", [zr.CRC_WINDOW, 256 << 10], ids=["one-window", "windows"])
def test_flipped_byte_found(saved, tmp_path, monkeypatch, resident, window):
    asked = []
    monkeypatch.setattr(zr, "CRC_WINDOW", window)
    monkeypatch.setattr(MappedFile, "resident",
                        lambda self, offset, length: asked.append(length) or resident)
    assert validate(saved, deep=True).ok
    assert sum(asked) >= 3 << 20 and len(asked) >= (3 << 20) // window  # the mapped path ran
    bad = validate(_flip_in_big(saved, tmp_path / "bad"), deep=True)
    assert not bad.ok
    assert [(f.severity, f.code, f.fqn) for f in bad.errors] == [("error", "crc-mismatch", "big")]
    assert bad.errors[0].severity is Severity.ERROR


def test_resident_tells_cached_from_not(saved):
    import os

    (f,) = saved.glob("*.distcp")
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, os.fstat(fd).st_size, 0)  # now cached
        mapped = MappedFile.open(fd)
        assert mapped is not None
        assert mapped.resident(0, mapped.size)
        assert bytes(mapped.view(0, 4)) == f.read_bytes()[:4]
        mapped.close()
    finally:
        os.close(fd)


def test_json_severity_is_the_plain_string(saved, tmp_path):
    bad = _flip_in_big(saved, tmp_path / "bad")
    proc = subprocess.run([sys.executable, "-m", "ckptool", "validate", str(bad), "--deep",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert [f["severity"] for f in out["findings"]] == ["error"]
    assert str(validate(bad, deep=True).errors[0]).startswith("error: crc-mismatch: ")

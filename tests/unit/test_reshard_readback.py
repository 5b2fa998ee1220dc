"""reshard checks the copy's bytes, not the source's, against the source's stored CRC-32s.

A row block copied in the kernel is re-read from the output; those bytes must add up to the
source record's stored CRC-32. One read proves the source and the copy, so a copy that differs
is refused even with ``verify=False``, and damaged input is still named as damaged input.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from ckptool.errors import CorruptCheckpointError  # noqa: E402
from ckptool.format import dcp_writer  # noqa: E402
from ckptool.format.reader import CheckpointReader  # noqa: E402
from ckptool.ops.reshard import reshard  # noqa: E402
from ckptool.ops.validate import validate  # noqa: E402
from ckptool.storage import Storage  # noqa: E402
from factory import make_single_checkpoint  # noqa: E402
from _dist import load_tensors  # noqa: E402


def _source(path):
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(64, 16, generator=g), "b": torch.randn(40, generator=g)}
    make_single_checkpoint(path, tensors)
    return tensors


def _corrupting_copy(monkeypatch) -> None:
    """Every kernel copy leaves one byte in the output different from the source's."""
    original = dcp_writer.DistcpFile._copy

    def corrupting(self, fd, offset, want, view):
        n = original(self, fd, offset, want, view)
        at = self.size + n // 2
        os.pwrite(self._fd, bytes([os.pread(self._fd, 1, at)[0] ^ 1]), at)
        return n

    monkeypatch.setattr(dcp_writer.DistcpFile, "_copy", corrupting)


@pytest.mark.parametrize("verify", [True, False])
def test_a_copy_that_differs_is_refused_even_unverified(tmp_path, monkeypatch, verify):
    _source(tmp_path / "src")
    _corrupting_copy(monkeypatch)
    with pytest.raises(CorruptCheckpointError,
                       match=r"verification failed.*the copy of .*differs from it: CRC-32 mismatch"):
        reshard(tmp_path / "src", tmp_path / "out", world_size=2, verify=verify)
    assert not (tmp_path / "out").exists()


def test_damaged_input_is_named_as_damaged(tmp_path):
    _source(tmp_path / "src")
    with CheckpointReader(Storage.open(tmp_path / "src")) as ck:
        t = ck.meta.tensors["model.w"]
        start = ck.locate(t, t.chunks[0]).start
        path = tmp_path / "src" / t.chunks[0].storage.relative_path
    data = bytearray(path.read_bytes())
    data[start + 100] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="the bytes are damaged") as e:
        reshard(tmp_path / "src", tmp_path / "out", world_size=2, verify=False)
    assert "verification failed" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("verify", [True, False])
def test_output_records_hold_the_bytes_their_crcs_say(tmp_path, verify):
    tensors = _source(tmp_path / "src")
    reshard(tmp_path / "src", tmp_path / "out", world_size=3, verify=verify)
    assert validate(str(tmp_path / "out"), deep=True).ok
    got = load_tensors(tmp_path / "out")
    for k, v in tensors.items():
        assert torch.equal(got[f"model.{k}"], v)

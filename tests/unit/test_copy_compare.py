"""A copy from a source with no stored checksum is compared with the source as it is made.

``DistcpFile.copy_range(compare=True)`` reads each copied step back and requires it equal to
the source's bytes; ``import`` (safetensors) and ``reshard`` of a checkpoint in DCP's
safetensors storage use it when verifying, so their records' data is proven without a second
read-back. A copy that differs is refused, naming both CRC-32s; without verification nothing
is compared.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from ckptool.errors import CorruptCheckpointError  # noqa: E402
from ckptool.format.dcp_writer import COPY_STEP, DistcpFile  # noqa: E402
from ckptool.ops.reshard import reshard  # noqa: E402
from _dist import load_tensors  # noqa: E402


def _hf_storage_checkpoint(path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    g = torch.Generator().manual_seed(3)
    state = {"model.w": torch.randn(96, 40, generator=g), "model.b": torch.randn(50, generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.clone() for k, v in state.items()},
                 storage_writer=HuggingFaceStorageWriter(str(path)), no_dist=True)
    return state


def _flip_one_byte_per_copy(monkeypatch) -> list[int]:
    """Every kernel copy leaves one byte of the output different from the source's."""
    original, calls = DistcpFile._copy, []

    def flipping(self, fd, offset, want, view):
        n = original(self, fd, offset, want, view)
        at = self.size + n // 2
        os.pwrite(self._fd, bytes([os.pread(self._fd, 1, at)[0] ^ 0x10]), at)
        calls.append(n)
        return n

    monkeypatch.setattr(DistcpFile, "_copy", flipping)
    return calls


def test_copy_range_compare_passes_an_exact_copy_in_steps(tmp_path):
    data = os.urandom(2 * COPY_STEP + 1000)
    (tmp_path / "src").write_bytes(b"hd" + data)
    fd = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with DistcpFile(tmp_path / "out") as f:
            steps = [len(b) for b in f.copy_range(fd, 2, len(data), bytearray(8 << 20), "src",
                                                  compare=True)]
    finally:
        os.close(fd)
    assert steps == [COPY_STEP, COPY_STEP, 1000]
    assert (tmp_path / "out").read_bytes() == data


def test_copy_range_compare_refuses_a_copy_that_differs(tmp_path, monkeypatch):
    _flip_one_byte_per_copy(monkeypatch)
    data = os.urandom(3000)
    (tmp_path / "src").write_bytes(data)
    fd = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with DistcpFile(tmp_path / "out") as f:
            with pytest.raises(CorruptCheckpointError,
                               match=r"verification failed.*the copy of src \(bytes 0\.\.3000\) "
                                     r"differs from it: CRC-32 mismatch \(source [0-9a-f]{8}, "
                                     r"copy [0-9a-f]{8}\)"):
                list(f.copy_range(fd, 0, len(data), bytearray(4096), "src", compare=True))
            # without compare (the caller verifies later) the copy is not read back
            assert len(list(f.copy_range(fd, 0, len(data), bytearray(4096), "src"))) == 1
    finally:
        os.close(fd)


def test_reshard_of_dcp_safetensors_storage_compares_each_copy(tmp_path, monkeypatch):
    state = _hf_storage_checkpoint(tmp_path / "src")
    calls = _flip_one_byte_per_copy(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match="the copy of .*differs from it"):
        reshard(tmp_path / "src", tmp_path / "out", world_size=2)
    assert calls and not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert reshard(tmp_path / "src", tmp_path / "out", world_size=2).verified
    got = load_tensors(tmp_path / "out")
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_reshard_unverified_does_not_compare(tmp_path, monkeypatch):
    _hf_storage_checkpoint(tmp_path / "src")
    compared = []
    original = DistcpFile._reads_back
    monkeypatch.setattr(DistcpFile, "_reads_back",
                        lambda self, *a: (compared.append(1), original(self, *a))[1])
    reshard(tmp_path / "src", tmp_path / "u", world_size=2, verify=False)
    assert not compared
    reshard(tmp_path / "src", tmp_path / "v", world_size=2)
    assert compared


def _write_flipping_big_buffers(monkeypatch) -> list[int]:
    """``os.write`` of a buffer over 4 KiB (tensor data) writes one byte flipped."""
    from ckptool.format import dcp_writer

    original, calls = os.write, []

    def flipping(fd, data):
        if len(data) > 4096:
            data = bytearray(data)
            data[len(data) // 2] ^= 0x01
            calls.append(len(data))
        return original(fd, data)

    monkeypatch.setattr(dcp_writer.os, "write", flipping)
    return calls


def _bf16_safetensors(path) -> torch.Tensor:
    from safetensors.torch import save_file

    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    save_file({"w": w}, str(path))
    return w


def test_import_cast_compares_each_block_as_written(tmp_path, monkeypatch):
    from ckptool.ops.import_hf import import_hf

    w = _bf16_safetensors(tmp_path / "model.safetensors")
    calls = _write_flipping_big_buffers(monkeypatch)
    with pytest.raises(CorruptCheckpointError,
                       match=r"verification failed.*bytes \d+\.\.\d+ read back differ from "
                             r"those written: CRC-32 mismatch"):
        import_hf(tmp_path / "model.safetensors", tmp_path / "out", world_size=2)
    assert calls and not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert import_hf(tmp_path / "model.safetensors", tmp_path / "out", world_size=2).verified
    got = load_tensors(tmp_path / "out")
    assert got["model.w"].dtype == torch.float32 and torch.equal(got["model.w"], w.float())

"""consolidate from a real S3 API on loopback (moto server): parallel ranged reads give the
same bytes as a local export, and a damaged record is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from factory import make_single_checkpoint

import ckptool.ops.chunk_copier as chunk_copier
from ckptool.errors import CorruptCheckpointError
from ckptool.format.reader import CheckpointReader
from ckptool.ops.consolidate import consolidate
from ckptool.storage import Storage


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "emb.weight": torch.randn(300, 64, generator=g),   # a record over the 64 KiB preload
        "proj.weight": torch.randn(16, 24, generator=g).t(),  # a strided record
        "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "pos": torch.arange(7),
    }
    return make_single_checkpoint(tmp_path_factory.mktemp("remote") / "step_3", tensors)


def _put(s3_server, local, remote):
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_server, skip_instance_cache=True).put(
        str(local), remote, recursive=True)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_s3_export_equals_local_export(s3_server, s3_bucket, src, tmp_path, monkeypatch, dtype):
    _put(s3_server, src, f"{s3_bucket}/run/step_3")
    monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", 4096)  # many ranged blocks per record
    local = consolidate(src, tmp_path / "local.safetensors", dtype=dtype)
    remote = consolidate(f"s3://{s3_bucket}/run/step_3", tmp_path / "remote.safetensors",
                         dtype=dtype, workers=5, verify=True)
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert (remote.tensors, remote.bytes, remote.verified) == (local.tensors, local.bytes, True)


def test_cli_on_s3_equals_local(s3_server, s3_bucket, src, tmp_path):
    _put(s3_server, src, f"{s3_bucket}/c/step_3")
    consolidate(src, tmp_path / "local.safetensors")
    proc = subprocess.run([sys.executable, "-m", "ckptool", "consolidate", f"s3://{s3_bucket}/c/step_3",
                           str(tmp_path / "cli.safetensors")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cli.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_damaged_block_on_s3_is_refused(s3_server, s3_bucket, src, tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with CheckpointReader(Storage.open(bad)) as ck:
        t = ck.meta.tensors["model.emb.weight"]
        cb = ck.locate(t, t.chunks[0])
        path, pos = bad / cb.reader.rel, cb.start + cb.nbytes - 10  # in the record's last block
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    _put(s3_server, bad, f"{s3_bucket}/bad/step_3")
    monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", 4096)
    with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
        consolidate(f"s3://{s3_bucket}/bad/step_3", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    consolidate(f"s3://{s3_bucket}/bad/step_3", tmp_path / "ok.safetensors", check_crc=False)

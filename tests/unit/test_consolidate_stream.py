"""consolidate from a remote source reads each source file front to back over ONE request
(``storage.remote.StreamedFile``): one streamed GET per ``.distcp`` on a real S3 API (moto
server on loopback), sequential ranged reads where the file system has no streamed files
(``memory://``); the output equals a local export byte for byte and damaged bytes are refused.
"""

from __future__ import annotations

import collections
import shutil
import uuid

import pytest
import torch
from factory import make_single_checkpoint

import ckptool.ops.chunk_copier as chunk_copier
from ckptool.errors import CorruptCheckpointError
from ckptool.format.reader import CheckpointReader
from ckptool.ops.consolidate import consolidate
from ckptool.storage import Storage

SMALL_BLOCK = 4096  # records over 192 KiB (``_HEAD + _TAIL``) then stream in many blocks


def _tensors(strided: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {
        "emb.weight": torch.randn(700, 96, generator=g),  # 269 KB: placed as it streams
        "norm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
        "blocks.0.w": torch.randn(40, 96, generator=g),  # read whole
        "pos": torch.arange(11),
    }
    if strided:  # a record the local headers cannot place (transposed): read again by range
        out["proj.weight"] = torch.randn(300, 240, generator=g).t()
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_single_checkpoint(tmp_path_factory.mktemp("stream") / "step_5", _tensors(True))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_single_checkpoint(tmp_path_factory.mktemp("plain") / "step_6", _tensors(False))


@pytest.fixture()
def memory_root():
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/stream-{uuid.uuid4().hex[:8]}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _to_memory(fs, root, local) -> str:
    """``local`` copied under ``root`` (same folder name: the output header names it)."""
    for f in local.iterdir():
        fs.pipe_file(f"{root}/{local.name}/{f.name}", f.read_bytes())
    return f"memory://{root}/{local.name}"


def _flip(src, dst, fqn: str, where: float) -> None:
    """A copy of ``src`` at ``dst`` with one byte of ``fqn``'s data flipped."""
    shutil.copytree(src, dst)
    with CheckpointReader(Storage.open(dst)) as ck:
        t = ck.meta.tensors[fqn]
        cb = ck.locate(t, t.chunks[0])
        path, pos = dst / cb.reader.rel, cb.start + int(cb.nbytes * where)
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("block", [None, SMALL_BLOCK])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_memory_export_equals_local(src, memory_root, tmp_path, monkeypatch, block, dtype):
    if block:
        monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", block)
    url = _to_memory(*memory_root, src)
    local = consolidate(src, tmp_path / "local.safetensors", dtype=dtype)
    remote = consolidate(url, tmp_path / "remote.safetensors", dtype=dtype, verify=True)
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert (remote.tensors, remote.bytes, remote.verified) == (local.tensors, local.bytes, True)


@pytest.mark.parametrize("block", [None, SMALL_BLOCK])
def test_memory_file_read_once_front_to_back(plain, memory_root, tmp_path, monkeypatch, block):
    """Without streamed files, a source file is read by ranged requests that follow each other
    (each byte once, in file order), a block at a time: no request per record."""
    fs, root = memory_root
    if block:
        monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", block)
    url = _to_memory(fs, root, plain)
    reads = collections.defaultdict(list)
    cat_file = type(fs).cat_file

    def counting(self, path, start=None, end=None, **kw):
        if path.endswith(".distcp"):
            reads[path].append((start, end))
        return cat_file(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(type(fs), "cat_file", counting)
    consolidate(url, tmp_path / "m.safetensors")
    consolidate(plain, tmp_path / "local.safetensors")
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    with CheckpointReader(Storage.open(plain)) as ck:
        ends = {}
        for t in ck.meta.tensors.values():
            for c in t.chunks:
                ends[c.storage.relative_path] = max(ends.get(c.storage.relative_path, 0),
                                                    c.storage.offset + c.storage.length)
    assert sorted(p.rsplit("/", 1)[1] for p in reads) == sorted(ends)
    for path, spans in reads.items():
        end = ends[path.rsplit("/", 1)[1]]
        assert spans[-1][1] == end, spans
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no byte twice
        # one request for the whole file; in blocks, at most two a block (one at each seam)
        assert len(spans) == 1 if block is None else len(spans) <= 2 * -(-end // block), spans


@pytest.mark.parametrize("fqn,where", [("model.emb.weight", 0.5), ("model.emb.weight", 0.999),
                                       ("model.blocks.0.w", 0.3), ("model.proj.weight", 0.6)])
def test_memory_damaged_byte_is_refused(src, memory_root, tmp_path, monkeypatch, fqn, where):
    monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", SMALL_BLOCK)
    _flip(src, tmp_path / "bad" / src.name, fqn, where)
    url = _to_memory(*memory_root, tmp_path / "bad" / src.name)
    with pytest.raises(CorruptCheckpointError, match=f"item {fqn}.*CRC-32 mismatch"):
        consolidate(url, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temporary output left either


@pytest.fixture()
def s3_gets(s3_server, monkeypatch):
    """(key, Range header or None) of every GET of an object the loopback server answers."""
    import moto.s3.responses as responses

    seen: list[tuple[str, str | None]] = []
    get = responses.S3Response._key_response_get

    def counting(self, query, key_name):
        if not query:  # a plain GetObject (not ?acl, ?tagging, ...)
            seen.append((key_name, self.headers.get("range")))
        return get(self, query, key_name)

    monkeypatch.setattr(responses.S3Response, "_key_response_get", counting)
    return seen


def _put(s3_server, local, remote):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server, skip_instance_cache=True)
    fs.put(str(local), remote, recursive=True)
    return fs


@pytest.mark.parametrize("source,block", [("fsdp3", None), ("plain", SMALL_BLOCK)])
def test_s3_one_get_per_source_file(request, s3_server, s3_bucket, s3_gets, tmp_path,
                                    monkeypatch, source, block):
    """3 ranks of model + AdamW (records of the optimizer between the model's), or one rank
    with a record streamed in many blocks: one unranged GET per ``.distcp``, exact output."""
    local = request.getfixturevalue(source)
    local = local[0] if isinstance(local, tuple) else local
    if block:
        monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", block)
    _put(s3_server, local, f"{s3_bucket}/run/{local.name}")
    s3_gets.clear()
    consolidate(f"s3://{s3_bucket}/run/{local.name}", tmp_path / "s3.safetensors")
    shards = sorted(f.name for f in local.iterdir() if f.name.endswith(".distcp"))
    got = sorted((key.rsplit("/", 1)[1], rng) for key, rng in s3_gets if key.endswith(".distcp"))
    assert got == [(name, None) for name in shards]
    consolidate(local, tmp_path / "local.safetensors")
    assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_s3_damaged_byte_is_refused(s3_server, s3_bucket, plain, tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_copier, "REMOTE_BLOCK", SMALL_BLOCK)
    _flip(plain, tmp_path / "bad", "model.emb.weight", 0.5)
    _put(s3_server, tmp_path / "bad", f"{s3_bucket}/bad/step_6")
    with pytest.raises(CorruptCheckpointError, match="model.emb.weight.*CRC-32 mismatch"):
        consolidate(f"s3://{s3_bucket}/bad/step_6", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_s3_stream_skip_and_close(s3_server, s3_bucket, s3_gets):
    """Short skips are read through on the one GET; a skip longer than a block ends it (its
    response closed) and ranged GETs go on from there; leaving the ``with`` closes it."""
    import s3fs

    from ckptool.storage.remote import StreamedFile

    data = bytes(range(256)) * 4096  # 1 MiB

    fs = s3fs.S3FileSystem(endpoint_url=s3_server, skip_instance_cache=True)
    path = f"{s3_bucket}/blob"
    fs.pipe_file(path, data)
    s3_gets.clear()
    with StreamedFile(fs, path, len(data) - 100, block=64 << 10) as s:
        assert bytes(s.read(10)) == data[:10]
        body = s._stream.r  # the GET's response (s3fs)
        s.skip(60_000)
        assert bytes(s.read(70_000)) == data[60_010:130_010]
        s.skip(200_000)
        assert body.raw_stream.closed and s._stream is None
        assert bytes(s.read(5)) == data[330_010:330_015]
        s.skip(len(data))
        assert bytes(s.read(10)) == b""
    assert [rng for _, rng in s3_gets] == [None, "bytes=330010-395545"]
    with pytest.raises(ZeroDivisionError), StreamedFile(fs, path, len(data), block=1 << 20) as s:
        s.read(1)
        body = s._stream.r
        1 / 0
    assert body.raw_stream.closed

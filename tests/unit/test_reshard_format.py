"""The torch-free DCP writer: records byte-identical to torch.save, .metadata equal to DCP's.

These tests pin ``ckptool.format.dcp_writer`` and ``ckptool.format._dcp_compat`` to the
installed torch: a torch upgrade that changes either format fails here first.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import zlib

import pytest

from ckptool.errors import IncompatibleCheckpointError
from ckptool.format import _dcp_compat
from ckptool.format.dcp_writer import V2_DTYPES, DistcpFile, TensorRecord, tensor_record, write_metadata
from ckptool.format.crc import crc32_combine
from ckptool.format.dtypes import DTYPES
from ckptool.format.metadata import (BytesEntry, CheckpointMetadata, Chunk, TensorEntry,
                                     parse_metadata, read_metadata)
from ckptool.storage import Storage

SHAPES = [(), (0,), (0, 6), (3,), (2, 3), (13, 6), (2, 3, 4, 5), (70000,)]


def _raw(t) -> bytes:
    import torch

    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


@pytest.mark.parametrize("dtype", sorted(V2_DTYPES))
def test_records_are_byte_identical_to_torch_save(dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        t = (torch.randn(shape, generator=g) * 100).to(getattr(torch, dtype))
        buf = io.BytesIO()
        torch.save(t, buf)
        mine = tensor_record(DTYPES[dtype], shape, _raw(t))
        assert mine == buf.getvalue(), (dtype, shape)
        assert TensorRecord(DTYPES[dtype], shape).length == len(mine)


def test_zip64_record_matches_torch():
    # Captured from torch 2.13's torch.save of a 4.1 GiB uint8 tensor (zeros, last byte 7)
    # written to a file named "archive": ZIP64 extras in the data entry's local and central
    # headers, 24-byte descriptors and 64-bit offsets after it, cd offset 0xFFFFFFFF in EOCD.
    n = int(4.1 * 2**30)
    rec = TensorRecord(DTYPES["uint8"], (n,))
    assert (rec.data_offset, rec.length) == (704, 4402343069)
    assert hashlib.sha256(rec.head).hexdigest() == (
        "09e421b80f5734b1dce9d5a92de3272655a9e847b3bf296cfe9cdeebce8f89cf")
    assert hashlib.sha256(rec.tail(403700866)).hexdigest() == (
        "d0142e6e55fee153c1aaecdfd31613f97d3fc4603e604d83689e17aa60c7d5d1")


def test_unsupported_dtype_is_refused():
    with pytest.raises(IncompatibleCheckpointError, match="cannot write uint16 tensors"):
        TensorRecord(DTYPES["uint16"], (2,))


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    data = os.urandom(100_000)
    for _ in range(50):
        cut = rng.randrange(len(data) + 1)
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(data), 0, 0) == zlib.crc32(data)


def _index(tmp_path) -> CheckpointMetadata:
    """Two files: a 2-chunk float32 tensor, a 0-dim bf16 tensor and an int value."""
    import torch

    x = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    s = torch.tensor(1.5, dtype=torch.bfloat16)
    obj = io.BytesIO()
    torch.save(7, obj)
    refs = []
    for name, recs in (("__0_0.distcp", [tensor_record(DTYPES["float32"], (3, 3), _raw(x[:3])),
                                         obj.getvalue()]),
                       ("__1_0.distcp", [tensor_record(DTYPES["float32"], (2, 3), _raw(x[3:])),
                                         tensor_record(DTYPES["bfloat16"], (), _raw(s))])):
        with DistcpFile(tmp_path / name) as f:
            refs += [f.append_record(r) for r in recs]
    w = TensorEntry("model.w", DTYPES["float32"], (5, 3),
                    (Chunk((0, 0), (3, 3), refs[0]), Chunk((3, 0), (2, 3), refs[2])))
    scale = TensorEntry("model.scale", DTYPES["bfloat16"], (), (Chunk((), (), refs[3]),))
    return CheckpointMetadata(
        tensors={"model.w": w, "model.scale": scale},
        objects={"step": BytesEntry("step", refs[1])},
        planner_data={"model.w": ("model", "w"), "model.scale": ("model", "scale"),
                      "step": ("step",)},
        version="1.0.0", save_id="abc")


def _torch_metadata(meta: CheckpointMetadata, checkpoint_id: str):
    """The same index built from torch's own dataclasses."""
    import torch
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    sdm, storage = {}, {}
    for fqn, t in meta.tensors.items():
        sdm[fqn] = md.TensorStorageMetadata(
            md.TensorProperties(dtype=getattr(torch, t.dtype.name)), torch.Size(t.shape),
            [md.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks])
        for i, c in enumerate(t.chunks):
            s = c.storage
            storage[md.MetadataIndex(fqn, c.offsets, i)] = _StorageInfo(s.relative_path, s.offset,
                                                                        s.length)
    for fqn, o in meta.objects.items():
        sdm[fqn] = md.BytesStorageMetadata()
        s = o.storage
        storage[md.MetadataIndex(fqn)] = _StorageInfo(s.relative_path, s.offset, s.length)
    return md.Metadata(sdm, planner_data=meta.planner_data, storage_data=storage,
                       storage_meta=md.StorageMeta(checkpoint_id=checkpoint_id, save_id="abc"),
                       version="1.0.0")


def test_metadata_equals_dcp_dataclasses_pinned(tmp_path):
    import torch

    assert torch.__version__.startswith(_dcp_compat.TESTED_TORCH), (
        f"torch {torch.__version__}: re-check ckptool/format/_dcp_compat.py against this version's "
        "torch/distributed/checkpoint/{metadata,filesystem}.py, then add it to TESTED_TORCH")
    meta = _index(tmp_path)
    data = _dcp_compat.encode_metadata(meta, checkpoint_id=str(tmp_path))
    loaded = pickle.loads(data)  # trusted: we just wrote it
    expected = _torch_metadata(meta, str(tmp_path))
    assert loaded == expected
    assert [k.index for k in loaded.storage_data] == [k.index for k in expected.storage_data]
    assert all(v.transform_descriptors is None for v in loaded.storage_data.values())
    # ckptool's own safe reader gets the index back unchanged
    again = parse_metadata(data)
    assert again.tensors == meta.tensors and again.objects == meta.objects
    assert again.planner_data == meta.planner_data and again.save_id == "abc"


def test_written_checkpoint_loads_with_dcp(tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    meta = _index(tmp_path)
    write_metadata(tmp_path, meta, checkpoint_id=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert read_metadata(Storage.open(tmp_path)).tensors == meta.tensors
    state = {"model": {"w": torch.zeros(5, 3), "scale": torch.zeros((), dtype=torch.bfloat16)},
             "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert torch.equal(state["model"]["w"], torch.arange(15, dtype=torch.float32).reshape(5, 3))
    assert state["model"]["scale"].item() == 1.5 and state["step"] == 7


def test_non_plain_planner_data_is_refused(tmp_path):
    import dataclasses

    meta = dataclasses.replace(_index(tmp_path), planner_data={"model.w": object()})
    with pytest.raises(IncompatibleCheckpointError, match="not plain data"):
        _dcp_compat.encode_metadata(meta)

"""format/_dcp_compat.py writes ``.metadata``'s pickle opcodes directly: every value it can
hold must load (with torch's own classes) as the index built from DCP's dataclasses, and
read back unchanged through ckptool's safe reader. Beyond the small index of
test_reshard_format.py: memo indexes past 255, ints of every pickle width, 4-d shapes,
non-ASCII names, transforms, and every kind of plain planner data."""

from __future__ import annotations

import pickle

import pytest

from ckptool.format import _dcp_compat
from ckptool.format.dtypes import DTYPES
from ckptool.format.metadata import (
    BytesEntry,
    CheckpointMetadata,
    Chunk,
    StorageRef,
    TensorEntry,
    parse_metadata,
)

torch = pytest.importorskip("torch")
md = pytest.importorskip("torch.distributed.checkpoint.metadata")
_StorageInfo = pytest.importorskip("torch.distributed.checkpoint.filesystem")._StorageInfo

BIG = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40 + 3, 2**63 + 5]
PLANNER = {"model.w.0": ("model", "w", 0), "opt": ["a", 1.5, None, True, False, -7],
           "deep": {"k": (1, 2, 3, 4), 3: [{"x": 2**70}]}, "ünï": "ç"}


def _meta() -> CheckpointMetadata:
    tensors = {}
    for i in range(300):  # 300 names, each memoized and recalled: memo indexes past 255
        fqn = f"model.layers.{i}.wëight"
        rows = min(BIG[i % len(BIG)], 2**34) + 2  # the reader refuses absurd sizes
        chunks = tuple(Chunk((r * rows // 2, 0, 0, 0), (rows // 2 + r * (rows % 2), 3, 1, 2),
                             StorageRef(f"__{r}_0.distcp", BIG[(i + r) % len(BIG)], 70000 + i,
                                        ("zstd",) if i % 7 == 0 else ()))
                       for r in range(2))
        tensors[fqn] = TensorEntry(fqn, DTYPES[("float32", "bfloat16", "int64")[i % 3]],
                                   (rows, 3, 1, 2), chunks)
    tensors["scalar"] = TensorEntry("scalar", DTYPES["float16"], (),
                                    (Chunk((), (), StorageRef("__0_0.distcp", 5, 9)),))
    objects = {"step": BytesEntry("step", StorageRef("__1_0.distcp", 2**33, 600))}
    return CheckpointMetadata(tensors=tensors, objects=objects, planner_data=PLANNER,
                              version="1.0.0", save_id="abc")


def _dcp(meta: CheckpointMetadata, checkpoint_id: str):
    sdm, storage = {}, {}
    for fqn, t in meta.tensors.items():
        sdm[fqn] = md.TensorStorageMetadata(
            md.TensorProperties(dtype=getattr(torch, t.dtype.name)), torch.Size(t.shape),
            [md.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
             for c in t.chunks])
        for i, c in enumerate(t.chunks):
            s = c.storage
            storage[md.MetadataIndex(fqn, c.offsets, i)] = _StorageInfo(
                s.relative_path, s.offset, s.length, list(s.transforms) or None)
    for fqn, o in meta.objects.items():
        sdm[fqn] = md.BytesStorageMetadata()
        s = o.storage
        storage[md.MetadataIndex(fqn)] = _StorageInfo(s.relative_path, s.offset, s.length)
    return md.Metadata(sdm, planner_data=meta.planner_data, storage_data=storage,
                       storage_meta=md.StorageMeta(checkpoint_id=checkpoint_id, save_id="abc"),
                       version="1.0.0")


def test_every_value_loads_as_dcps_own_index():
    meta = _meta()
    data = _dcp_compat.encode_metadata(meta, checkpoint_id="/ckpt/ü")
    loaded = pickle.loads(data)  # trusted: we just wrote it
    expected = _dcp(meta, "/ckpt/ü")
    assert loaded == expected
    assert list(loaded.storage_data.items()) == list(expected.storage_data.items())
    assert loaded.state_dict_metadata["scalar"].size == torch.Size([])
    assert type(loaded.state_dict_metadata["model.layers.0.wëight"].size) is torch.Size
    again = parse_metadata(data)  # ckptool's allow-listed reader gets it back unchanged
    assert again.tensors == meta.tensors and again.objects == meta.objects
    assert again.planner_data == PLANNER and again.save_id == "abc"


def test_repeated_names_are_written_once():
    data = _dcp_compat.encode_metadata(_meta())
    assert data.count(b"__0_0.distcp") == 1 and data.count(b"relative_path") == 1
    assert data.count(b"torch.distributed.checkpoint.metadata\nMetadataIndex\n") == 1

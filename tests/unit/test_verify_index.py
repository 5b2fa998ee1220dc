"""The last step of reshard's and import's verification: the written ``.metadata`` must point
every chunk at the record that holds its rows.

Each record was read back (and its CRC-32 proven) as it was written; the check combines the
CRC-32s of the records the index names, per tensor, and compares them with the source's, so an
index that points a chunk at another record of the same shape is refused, nothing committed.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from ckptool.errors import CorruptCheckpointError  # noqa: E402
from ckptool.format.metadata import CheckpointMetadata  # noqa: E402
from ckptool.ops import import_hf as import_mod  # noqa: E402
from ckptool.ops import reshard as reshard_mod  # noqa: E402
from factory import make_single_checkpoint  # noqa: E402


def _swap_first_two_chunks(meta: CheckpointMetadata, fqn: str) -> CheckpointMetadata:
    t = meta.tensors[fqn]
    a, b, *rest = sorted(t.chunks, key=lambda c: c.offsets)
    assert a.sizes == b.sizes  # same shape: only the bytes tell them apart
    swapped = (dataclasses.replace(a, storage=b.storage), dataclasses.replace(b, storage=a.storage))
    tensors = {**meta.tensors, fqn: dataclasses.replace(t, chunks=(*swapped, *rest))}
    return dataclasses.replace(meta, tensors=tensors)


def test_import_refuses_an_index_that_swaps_two_chunks(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    src = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32).reshape(16, 4)}, str(src))
    original = import_mod._metadata
    monkeypatch.setattr(import_mod, "_metadata",
                        lambda plan, written: _swap_first_two_chunks(original(plan, written),
                                                                     "model.w"))
    with pytest.raises(CorruptCheckpointError,
                       match="verification failed.*model.w differs from the source rows"):
        import_mod.import_hf(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert import_mod.import_hf(src, tmp_path / "out", world_size=2).verified


def test_reshard_refuses_an_index_that_swaps_two_chunks(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(5)
    make_single_checkpoint(tmp_path / "src", {"w": torch.randn(32, 8, generator=g)})
    original = reshard_mod._output_metadata
    monkeypatch.setattr(reshard_mod, "_output_metadata",
                        lambda *a, **k: _swap_first_two_chunks(original(*a, **k), "model.w"))
    with pytest.raises(CorruptCheckpointError,
                       match="verification failed.*model.w differs from the source"):
        reshard_mod.reshard(tmp_path / "src", tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert reshard_mod.reshard(tmp_path / "src", tmp_path / "out", world_size=2).verified

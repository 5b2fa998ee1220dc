"""The .metadata and record readers: real DCP files in, plain data out; hostile pickles refused."""

from __future__ import annotations

import pickle
import sys

import pytest

from ckptool.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckptool.format.torch_records import RecordReader
from ckptool.format.metadata import parse_metadata, read_metadata
from ckptool.format.state_layout import read_layout
from ckptool.storage import Storage


def test_reads_real_metadata_without_torch_classes(single_ckpt):
    meta = read_metadata(Storage.open(single_ckpt))
    w = meta.tensors["model.w"]
    assert (w.dtype.name, w.shape, len(w.chunks)) == ("float32", (5, 3), 1)
    assert meta.tensors["model.b"].dtype.name == "bfloat16"
    assert meta.tensors["model.scale"].shape == ()
    assert "step" in meta.objects
    assert meta.world_size == 1
    assert read_layout(meta).names == {"model.w": "w", "model.b": "b", "model.scale": "scale"}
    assert meta.planner_data["model.w"] == ("model", "w")


def test_record_locates_exact_tensor_bytes(single_ckpt):
    import torch

    st = Storage.open(single_ckpt)
    meta = read_metadata(st)
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(5, 3, generator=g)
    chunk = meta.tensors["model.w"].chunks[0]
    with st.reader(chunk.storage.relative_path) as r:
        rec = RecordReader(r, chunk.storage, "w")
        loc = rec.tensor()
        rec.verify_crc()
        raw = r.pread(loc.start, loc.nbytes)
    assert loc.contiguous and loc.shape == (5, 3) and loc.dtype.name == "float32"
    got = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(5, 3)
    assert torch.equal(got, expected)


def test_record_reads_plain_objects(single_ckpt):
    st = Storage.open(single_ckpt)
    meta = read_metadata(st)
    ref = meta.objects["step"].storage
    with st.reader(ref.relative_path) as r:
        assert RecordReader(r, ref, "step").load_object() == 3


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Evil(marker))
    with pytest.raises(CorruptCheckpointError, match=r"refused: it references (posix|os)\.system"):
        parse_metadata(data, where="x/.metadata")
    assert not marker.exists()
    # and the same bytes really are dangerous with a plain pickle.load
    pickle.loads(data)
    assert marker.exists()


def test_hostile_global_nested_inside_real_structure(single_ckpt):
    data = (single_ckpt / ".metadata").read_bytes()
    # swap one allowed global for a builtin callable of the same length class
    evil = data.replace(b"\x8c\x05torch\x94\x8c\x04Size", b"\x8c\x08builtins\x94\x8c\x04eval", 1)
    assert evil != data
    with pytest.raises(CorruptCheckpointError, match="refused: it references builtins.eval"):
        parse_metadata(evil)


@pytest.mark.parametrize("cut", [0, 1, 10, 100])
def test_truncated_metadata_is_a_clean_error(single_ckpt, cut):
    data = (single_ckpt / ".metadata").read_bytes()[:cut]
    with pytest.raises(CorruptCheckpointError, match="not a readable DCP index"):
        parse_metadata(data)


def test_missing_metadata_is_incomplete(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match="no .metadata"):
        read_metadata(Storage.open(tmp_path))


def test_reader_never_imports_torch(single_ckpt):
    import subprocess

    code = ("import sys; from ckptool.ops.validate import validate; "
            f"r = validate({str(single_ckpt)!r}, deep=True); assert r.ok, r.findings; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_memory_url(single_ckpt):
    import fsspec

    from ckptool.ops.validate import validate

    fs = fsspec.filesystem("memory")
    for p in single_ckpt.iterdir():
        fs.pipe_file(f"/ckpts/one/{p.name}", p.read_bytes())
    report = validate("memory://ckpts/one", deep=True)
    assert report.ok, report.findings
    assert report.tensors == 3


def test_deep_finds_a_flipped_bit_anywhere_in_a_shard(single_ckpt, tmp_path):
    """Every byte of a .distcp file is covered: CRC-32 for data, structure checks for the rest."""
    import shutil

    from ckptool.ops.validate import validate

    shard = next(single_ckpt.glob("*.distcp"))
    data = shard.read_bytes()
    work = tmp_path / "c"
    shutil.copytree(single_ckpt, work)
    target = work / shard.name
    missed = []
    for i in range(0, len(data), 5):  # every 5th byte keeps this to a few seconds
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        target.write_bytes(bytes(flipped))
        if validate(work, deep=True).ok:
            missed.append(i)
    assert missed == []
    target.write_bytes(data)
    assert validate(work, deep=True).ok


def test_deep_fast_path_for_same_shaped_records_still_finds_damage(tmp_path):
    """Records laid out like an already verified one are checked against it: damage in their
    data, their CRCs or their structure is still found, and named on the right key."""
    import torch

    from factory import make_single_checkpoint

    from ckptool.format.reader import CheckpointReader
    from ckptool.ops.validate import validate

    g = torch.Generator().manual_seed(1)
    ckpt = make_single_checkpoint(tmp_path / "c", {f"w{i}": torch.randn(7, 3, generator=g)
                                                   for i in range(12)})
    assert validate(ckpt, deep=True).ok
    with CheckpointReader(Storage.open(ckpt)) as ck:
        t = ck.meta.tensors["model.w9"]
        cb = ck.locate(t, t.chunks[0])
        ref = t.chunks[0].storage
    shard = ckpt / ref.relative_path
    good = shard.read_bytes()
    for pos in (cb.start + 5, ref.offset + 3, ref.offset + ref.length - 30, cb.start - 20):
        bad = bytearray(good)
        bad[pos] ^= 0x10
        shard.write_bytes(bytes(bad))
        report = validate(ckpt, deep=True)
        assert [f.fqn for f in report.errors] == ["model.w9"], (pos, report.findings)
    shard.write_bytes(good)

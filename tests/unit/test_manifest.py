"""The ``ckptool.json`` manifest (issue 7): what it covers, and that ``validate`` names a size
mismatch always and a checksum mismatch with ``deep=True``. Without a manifest, structure and
per-item CRC-32 still catch damage. Also the Checkpointer's commit order and crash-safe retention.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import xxhash

from factory import break_checkpoint, make_single_checkpoint
from ckptool.format.manifest import MANIFEST, build_manifest, read_manifest, write_manifest
from ckptool.ops.validate import validate
from ckptool.storage import Storage


@pytest.fixture()
def with_manifest(tmp_path) -> Path:
    ckpt = make_single_checkpoint(tmp_path / "ckpt")
    st = Storage.open(ckpt)
    write_manifest(st, build_manifest(st, step=3, world_size=1, loss=1.5))
    return ckpt


def _codes(path: Path, *, deep: bool) -> set[str]:
    return {f.code for f in validate(path, deep=deep).errors}


def _edit_manifest(ckpt: Path, rel: str, **changes) -> None:
    st = Storage.open(ckpt)
    m = read_manifest(st)
    files = {k: dict(v) for k, v in m.files.items()}
    files[rel].update(changes)
    write_manifest(st, dataclasses.replace(m, files=files))


def test_manifest_covers_metadata_and_every_shard(with_manifest):
    m = read_manifest(Storage.open(with_manifest))
    on_disk = sorted(p.name for p in with_manifest.iterdir()
                     if p.name == ".metadata" or p.suffix == ".distcp")
    assert sorted(m.files) == on_disk and ".metadata" in m.files
    for rel, info in m.files.items():
        data = (with_manifest / rel).read_bytes()
        assert info == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    assert (m.step, m.world_size, m.loss) == (3, 1, 1.5)
    assert not (with_manifest / f".{MANIFEST}.tmp").exists()  # written under a temp name
    assert validate(with_manifest, deep=True).ok


def test_manifest_size_mismatch_named_without_deep(with_manifest):
    rel = sorted(p.name for p in with_manifest.glob("*.distcp"))[0]
    _edit_manifest(with_manifest, rel, size=(with_manifest / rel).stat().st_size + 1)
    report = validate(with_manifest)
    assert [f.code for f in report.errors] == ["manifest-size"]
    assert rel in report.errors[0].message and "changed after the save" in report.errors[0].message


def test_file_grown_after_save_is_a_size_mismatch(with_manifest):
    rel = sorted(p.name for p in with_manifest.glob("*.distcp"))[0]
    with open(with_manifest / rel, "ab") as f:
        f.write(b"\0")  # past every record: only the manifest can tell
    assert _codes(with_manifest, deep=False) == {"manifest-size"}


def test_manifest_checksum_mismatch_named_with_deep(with_manifest):
    _edit_manifest(with_manifest, ".metadata", xxh3_64="0" * 16)
    assert validate(with_manifest).ok  # sizes agree: only --deep reads the bytes
    report = validate(with_manifest, deep=True)
    assert [f.code for f in report.errors] == ["manifest-checksum"]
    assert ".metadata" in report.errors[0].message and "0" * 16 in report.errors[0].message


def test_flipped_byte_caught_by_checksum_and_crc(with_manifest, tmp_path):
    bad = break_checkpoint(with_manifest, tmp_path / "bad", "flipped-byte")
    assert validate(bad).ok
    assert _codes(bad, deep=True) == {"manifest-checksum", "crc-mismatch"}


def test_no_manifest_still_validated_by_structure_and_crc(tmp_path):
    ckpt = make_single_checkpoint(tmp_path / "ckpt")
    assert not (ckpt / MANIFEST).exists() and validate(ckpt, deep=True).ok
    assert _codes(break_checkpoint(ckpt, tmp_path / "flip", "flipped-byte"), deep=True) == {"crc-mismatch"}
    assert "truncated-file" in _codes(break_checkpoint(ckpt, tmp_path / "cut", "truncated-shard"), deep=False)


def test_bad_manifest_json_named(with_manifest):
    (with_manifest / MANIFEST).write_text("{not json")
    assert _codes(with_manifest, deep=False) == {"bad-manifest"}


# -- Checkpointer: commit order and retention ------------------------------------------------

def _save_steps(root: Path, steps, keep: int):
    import torch

    from ckptool.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(root, keep=keep)
    for s in steps:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        ckpt.save(s, model, opt, loss=float(s))
    ckpt.close()


def test_save_writes_manifest_after_metadata_and_retention_is_atomic(tmp_path):
    import warnings

    warnings.simplefilter("ignore")
    root = tmp_path / "run"
    root.mkdir()
    cut_short = root / ".step_0.deleting-0000abcd"  # a removal a crash interrupted
    shutil.copytree(make_single_checkpoint(tmp_path / "x"), cut_short)
    (root / "step_2").mkdir()  # torn, will be replaced by the new save of step 2
    (root / "step_2" / "__0_0.distcp").write_bytes(b"torn")
    _save_steps(root, [1, 2, 3, 4], keep=2)
    assert sorted(os.listdir(root)) == ["step_3", "step_4"]  # no hidden leftovers either
    for name in ("step_3", "step_4"):
        m = read_manifest(Storage.open(root / name))
        assert m.step == int(name[-1]) and set(m.files) == {".metadata", "__0_0.distcp"}
        assert validate(root / name, deep=True).ok

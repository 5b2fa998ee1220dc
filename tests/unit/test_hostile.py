"""Hostile and broken input: one clear error, no traceback, no code run (issue 7's reader cases).

Each case builds its bad file with torch's own dataclasses (a trusted writer), then hands it to
ckptool's reader, which must treat it as data.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.errors import CkptError
from ckptool.format.metadata import parse_metadata
from ckptool.ops.validate import validate


def _meta(ckpt: Path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp.FileSystemReader(str(ckpt)).read_metadata()


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    meta = _meta(dst)
    edit(meta)
    (dst / ".metadata").write_bytes(pickle.dumps(meta))
    return dst


def _cli_fails(path: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "ckptool", "validate", str(path), *extra],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def _w(meta):
    return meta.state_dict_metadata["model.w"]


def _first_ref(meta, fqn="model.w"):
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


CASES = {
    "absolute-path": (lambda m: setattr(_first_ref(m), "relative_path", "/etc/passwd"),
                      "path-outside", "an absolute path"),
    "dotdot-path": (lambda m: setattr(_first_ref(m), "relative_path", "../x.distcp"),
                    "path-outside", "leading out"),
    "petabytes": (lambda m: setattr(_w(m), "size", __import__("torch").Size([1 << 40, 1 << 20])),
                  "bad-metadata", "an absurd size"),
    "negative-offset": (lambda m: setattr(_w(m).chunks[0], "offsets", __import__("torch").Size([-1, 0])),
                        "bad-metadata", "expected an integer >= 0"),
    "chunk-outside": (lambda m: setattr(_w(m).chunks[0], "offsets", __import__("torch").Size([3, 0])),
                      "chunk-out-of-bounds", "outside the tensor's shape"),
    "overlap": (lambda m: _w(m).chunks.append(_w(m).chunks[0]), "chunk-overlap", "saved twice"),
    "unknown-dtype": (lambda m: setattr(_w(m).properties, "dtype", __import__("torch").qint8),
                      "bad-metadata", "not a supported tensor dtype"),
    "huge-offset": (lambda m: setattr(_first_ref(m), "offset", 1 << 50), "truncated-file",
                    "was truncated"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_metadata_named(single_ckpt, tmp_path, case):
    edit, code, words = CASES[case]
    bad = _rewrite(single_ckpt, tmp_path / "c", edit)
    report = validate(bad, deep=True)
    assert code in [f.code for f in report.errors], report.findings
    assert any(words in f.message for f in report.errors), report.findings
    assert code in _cli_fails(bad)


def test_symlink_leading_out(single_ckpt, tmp_path):
    bad = tmp_path / "c"
    shutil.copytree(single_ckpt, bad)
    shard = next(bad.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    report = validate(bad)
    assert [f.code for f in report.errors] == ["path-outside"]
    assert "symlink" in report.errors[0].message


def test_distcp_that_is_a_directory(single_ckpt, tmp_path):
    bad = tmp_path / "c"
    shutil.copytree(single_ckpt, bad)
    shard = next(bad.glob("*.distcp"))
    shard.unlink()
    shard.mkdir()
    assert [f.code for f in validate(bad).errors] == ["not-a-file"]
    _cli_fails(bad)


def test_compressed_entry_and_wrong_crc(single_ckpt, tmp_path):
    import struct

    bad = tmp_path / "c"
    shutil.copytree(single_ckpt, bad)
    shard = next(bad.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    # mark the first central-directory entry as deflated (method 8)
    cd = data.find(b"PK\x01\x02")
    struct.pack_into("<H", data, cd + 10, 8)
    shard.write_bytes(bytes(data))
    report = validate(bad, deep=True)
    assert any("compressed" in f.message for f in report.errors), report.findings
    # a wrong stored CRC in the directory
    data2 = bytearray((single_ckpt / shard.name).read_bytes())
    struct.pack_into("<I", data2, data2.find(b"PK\x01\x02") + 16, 0xDEADBEEF)
    shard.write_bytes(bytes(data2))
    assert not validate(bad, deep=True).ok


def test_duplicate_storage_entries(single_ckpt):
    """Two storage entries for one chunk (a dict pickled with a repeated key) are refused."""
    import collections
    import io

    meta = _meta(single_ckpt)
    items = list(meta.storage_data.items())
    from torch.distributed.checkpoint.metadata import MetadataIndex

    k, v = next((k, v) for k, v in items if k.fqn == "model.w")
    items.append((MetadataIndex(k.fqn, k.offset), v))  # an equal key, a second object
    target = meta.storage_data = type("Dup", (dict,), {})(meta.storage_data)  # not exact dict:
    # reducer_override is only consulted for objects that are not exact builtins

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is target:  # SETITEMS with every pair, the duplicate included
                return (collections.OrderedDict, (), None, None, iter(items))
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf).dump(meta)
    with pytest.raises(CkptError, match="two storage entries"):
        parse_metadata(buf.getvalue())


# -- property: any mutation of a real .metadata gives a consistent model or a CkptError -------

_GOOD: dict[str, bytes] = {}


def _good_metadata() -> bytes:
    if "m" not in _GOOD:
        import tempfile

        from factory import make_single_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            path = make_single_checkpoint(Path(tmp) / "c")
            _GOOD["m"] = (path / ".metadata").read_bytes()
    return _GOOD["m"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_metadata_is_model_or_ckpt_error(data):
    raw = bytearray(_good_metadata())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del raw[i:i + data.draw(st.integers(1, 64))]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        if not raw:
            raw = bytearray(b"\x80")
    try:
        meta = parse_metadata(bytes(raw))
    except CkptError:
        return
    # a model that parses must be internally consistent
    for t in meta.tensors.values():
        assert all(isinstance(d, int) and d >= 0 for d in t.shape)
        assert t.dtype.itemsize > 0
        for c in t.chunks:
            assert len(c.offsets) == len(c.sizes) == len(t.shape)
            assert all(isinstance(x, int) and x >= 0 for x in (*c.offsets, *c.sizes))
            if c.storage is not None:
                assert c.storage.offset >= 0 and c.storage.length >= 0
    assert isinstance(meta.files(), list)


def test_error_codes_are_typed_not_parsed_from_messages():
    """Scripts and validate's findings read ``e.code``; the English message may change."""
    from ckptool import errors as E

    assert E.NoCheckpointError("anything").code == "empty"
    assert E.CheckpointNotFoundError("x").code == "not-a-checkpoint"
    assert E.ChecksumError("x").code == "crc-mismatch"
    assert E.UnsafeInputError("x").code == "unsafe-pickle"
    assert isinstance(E.UnsafeInputError("x"), E.CorruptCheckpointError)
    assert E.CorruptCheckpointError("x", code="bad-header").code == "bad-header"

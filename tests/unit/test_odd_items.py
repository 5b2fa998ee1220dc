"""Odd items of a real one-rank ``dcp.save``, through every command (issue 11).

``io.BytesIO`` values (older torchtitan ``train_state`` held three): DCP 2.13's default planner
saves every non-tensor value with ``torch.save``, a ``BytesIO`` included, so the record's
``data.pkl`` names ``_io.BytesIO`` (NEWOBJ + BUILD with ``(value, pos, dict)``). They are bytes,
not code: validated, listed as objects, copied verbatim by reshard, loadable by ``dcp.load``.
Plain values (int, float, str, bytes, list, tuple, dict, None) round trip the same way. Tensor
items: empty (a dim of 0), 0-dim, bf16, int64, and model parameters and buffers at the root of
``dcp.save(model.state_dict())``. Hostile values are still refused and nothing runs.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.errors import CorruptCheckpointError
from ckptool.format.torch_records import RecordReader, SavedBytes
from ckptool.format.metadata import read_metadata
from ckptool.ops.consolidate import consolidate
from ckptool.ops.inspect import inspect
from ckptool.ops.reshard import reshard
from ckptool.ops.validate import validate
from ckptool.storage import Storage

LOSSES = [2.5, 2.25, 2.0]
PLAIN = {"count": 3, "lr": 1.5e-4, "name": "run-7", "raw": b"\x00\xffbytes", "none": None,
         "seq": [1, 2.5, "x"], "pair": (4, 5), "cfg": {"depth": 2, "act": "gelu"}}


def _tensors():
    import torch

    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=g), "half": torch.randn(4, 2, generator=g).bfloat16(),
            "ids": torch.arange(6), "none_rows": torch.zeros(0, 3), "none_cols": torch.zeros(3, 0),
            "scale": torch.tensor(0.5), "count": torch.tensor(9, dtype=torch.int64)}


def _train_state():
    import torch

    out = {"step": 3}
    for name in ("global_avg_losses", "global_max_losses", "log_steps"):
        buf = io.BytesIO()
        torch.save(LOSSES if name != "log_steps" else [1, 2, 3], buf)
        out[name] = buf
    return out


def _bytes_of(state: dict) -> dict[str, bytes]:
    return {k: v.getvalue() for k, v in state.items() if isinstance(v, io.BytesIO)}


def _save(state: dict, out: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(state, checkpoint_id=str(out))
    return out


@pytest.fixture(scope="session")
def odd(tmp_path_factory) -> Path:
    """``{"model": odd tensors, "train_state": 3 BytesIO + step, "extra": plain values}``."""
    root = tmp_path_factory.mktemp("odd")
    return _save({"model": _tensors(), "train_state": _train_state(), "extra": dict(PLAIN),
                  "blob": io.BytesIO(b"")}, root / "ckpt")


def _root_model():
    import torch
    from torch import nn

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.25))
            self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
            self.register_buffer("step_count", torch.tensor(11, dtype=torch.int64))
            self.head = nn.Linear(4, 3).to(torch.bfloat16)

    return Root()


@pytest.fixture(scope="session")
def rooted(tmp_path_factory) -> tuple[Path, dict]:
    """``dcp.save(model.state_dict())`` of a model with parameters and a buffer at its root."""
    import torch

    torch.manual_seed(5)
    sd = {k: v.detach().clone() for k, v in _root_model().state_dict().items()}
    return _save(dict(sd), tmp_path_factory.mktemp("rooted") / "ckpt"), sd


def _load(path: Path, like: dict) -> dict:
    """``dcp.load`` (torch's own reader) into a state dict shaped like ``like``."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(like, checkpoint_id=str(path), no_dist=True)
    return like


def _empty_like_state():
    import torch

    return {"model": {k: torch.full_like(v, 7) for k, v in _tensors().items()},
            "train_state": {"step": 0, **{k: io.BytesIO() for k in _bytes_of(_train_state())}},
            "extra": {k: {n: None for n in v} if isinstance(v, dict) else None
                      for k, v in PLAIN.items()}, "blob": io.BytesIO(b"junk")}


def _assert_exact(got: dict) -> None:
    import torch

    for k, v in _tensors().items():
        t = got["model"][k]
        assert t.dtype == v.dtype and torch.equal(t, v), k
    assert got["train_state"]["step"] == 3
    assert _bytes_of(got["train_state"]) == _bytes_of(_train_state())
    assert torch.load(io.BytesIO(got["train_state"]["global_avg_losses"].getvalue())) == LOSSES
    assert got["extra"] == PLAIN
    assert got["blob"].getvalue() == b""


# ---------------------------------------------------------------------------------------------
# BytesIO and plain values


def test_validate_deep_reads_and_accounts_for_every_value(odd):
    res = CliRunner().invoke(cli, ["validate", "--deep", str(odd)])
    assert res.exit_code == 0, res.output
    report = validate(odd, deep=True)
    assert report.ok and report.findings == ()
    st = Storage.open(odd)
    meta = read_metadata(st)
    values = {}
    for fqn, o in meta.objects.items():
        with st.reader(o.storage.relative_path) as r:
            values[fqn] = RecordReader(r, o.storage, fqn).load_object()
    saved = _bytes_of(_train_state())
    assert {k: values[f"train_state.{k}"] for k in saved} == {k: SavedBytes(v) for k, v in saved.items()}
    assert values["blob"] == SavedBytes(b"")
    flat = {f"extra.{k}": v for k, v in PLAIN.items() if k != "cfg"}
    flat.update({f"extra.cfg.{k}": v for k, v in PLAIN["cfg"].items()})  # DCP flattens dicts
    assert {k: values[k] for k in flat} == flat
    assert values["train_state.step"] == 3


def test_inspect_lists_bytes_values_as_objects(odd):
    s = inspect(odd)
    kinds = {k.fqn: k.kind for keys in s.groups.values() for k in keys}
    for name in ("train_state.global_avg_losses", "train_state.log_steps", "blob", "extra.raw",
                 "extra.none", "extra.seq"):
        assert kinds[name] == "object"
    assert kinds["model.none_rows"] == kinds["model.scale"] == "tensor"
    assert CliRunner().invoke(cli, ["inspect", str(odd)]).exit_code == 0


@pytest.mark.parametrize("ranks", [2, 3])
def test_reshard_copies_values_verbatim_and_dcp_loads_them(odd, tmp_path, ranks):
    out = tmp_path / f"ws{ranks}"
    r = reshard(odd, out, world_size=ranks)
    assert r.verified and r.objects == len(read_metadata(Storage.open(odd)).objects)
    _assert_exact(_load(out, _empty_like_state()))
    src, dst = Storage.open(odd), Storage.open(out)
    for fqn, o in read_metadata(src).objects.items():  # the records themselves, byte for byte
        ref = read_metadata(dst).objects[fqn].storage
        assert dst.read_bytes(ref.relative_path)[ref.offset:ref.offset + ref.length] == \
            src.read_bytes(o.storage.relative_path)[o.storage.offset:o.storage.offset + o.storage.length]


def test_source_itself_loads_back(odd):
    _assert_exact(_load(odd, _empty_like_state()))  # the reference the reshard test relies on


# ---------------------------------------------------------------------------------------------
# Tensor items


def test_consolidate_exports_empty_scalar_bf16_int64_exactly(odd, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    consolidate(odd, out, verify=True)
    got = load_file(out)
    ref = _tensors()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_root_level_parameters_and_buffers(rooted, tmp_path):
    """The model's own ``state_dict()`` names come out, nothing dropped; reshard keeps them."""
    import torch
    from safetensors.torch import load_file

    path, sd = rooted
    assert CliRunner().invoke(cli, ["validate", "--deep", str(path)]).exit_code == 0
    out = tmp_path / "model.safetensors"
    consolidate(path, out)
    got = load_file(out)
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sd.items())
    for ranks in (2, 3):
        back = _load(reshard(path, tmp_path / f"ws{ranks}", world_size=ranks).destination,
                     {k: torch.zeros_like(v) for k, v in sd.items()})
        assert all(torch.equal(back[k], v) for k, v in sd.items())


# ---------------------------------------------------------------------------------------------
# Still refused


class _Hostile:
    """Pickles as a call to ``os.system``: what a malicious checkpoint value looks like."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _FakeBytesIO:
    """Pickles as ``_io.BytesIO`` whose state is not (bytes, int, dict): not a real BytesIO."""

    def __reduce__(self):
        return (io.BytesIO, (), ("not bytes", 0, None))


def test_hostile_value_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    bad = _save({"w": __import__("torch").ones(2), "evil": _Hostile(str(marker))}, tmp_path / "c")
    report = validate(bad, deep=True)
    assert [(f.code, f.fqn) for f in report.findings] == [("unsafe-pickle", "evil")]
    assert "system" in report.findings[0].message
    with pytest.raises(CorruptCheckpointError, match="possibly malicious"):
        reshard(bad, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists() and not marker.exists()


def test_bytesio_with_a_forged_state_is_refused(tmp_path):
    bad = _save({"w": __import__("torch").ones(2), "fake": _FakeBytesIO()}, tmp_path / "c")
    report = validate(bad, deep=True)
    assert [(f.code, f.fqn) for f in report.findings] == [("bad-record", "fake")]
    assert "io.BytesIO value is a str, not bytes" in report.findings[0].message


def test_protocol2_builtins_are_data_and_sizes_are_not_allocations():
    import pickle

    from ckptool.format.safe_pickle import safe_loads

    values = [b"", b"\x00\xff", bytearray(b""), bytearray(b"ab"), {1, 2}, frozenset({3}), 1 + 2j]
    for v in values:  # torch.save pickles at protocol 2: builtins named "__builtin__.*"
        assert safe_loads(pickle.dumps(v, protocol=2), {}) == v
    for size in (pickle.dumps(bytearray, 2), pickle.dumps(bytes, 2)):  # a class, not a value
        with pytest.raises(pickle.UnpicklingError):
            safe_loads(size[:-1] + b"J\x00\x00\x00\x40\x85R.", {})  # bytearray(2**30)
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        safe_loads(b"\x80\x02c__builtin__\neval\nX\x01\x00\x00\x001\x85R.", {})

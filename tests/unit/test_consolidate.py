"""consolidate on real one-rank DCP checkpoints: exact bytes, names, shards, filters, failures, CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckptool.cli import cli
from ckptool.errors import ConfigError, CorruptCheckpointError, IncompleteCheckpointError
from ckptool.format.reader import CheckpointReader
from ckptool.ops.consolidate import consolidate
from ckptool.storage import Storage


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(7, 4, generator=g),
        "proj.weight": torch.randn(4, 6, generator=g).t(),  # saved as a strided record
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "pos": torch.arange(5),
        "empty": torch.zeros(0, 3),
    }


def _save(path: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cons")
    optim = {"state": {"emb.weight": {"exp_avg": torch.ones(7, 4)}}}
    return _save(root / "step_7", {"model": _model(), "optim": optim, "step": 7})


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_exports_model_weights_exactly_with_provenance(ckpt, tmp_path):
    out = tmp_path / "model.safetensors"
    r = consolidate(ckpt, out)
    sd = load_file(out)
    assert set(sd) == set(_model())  # model.* only, prefix dropped, no optim
    for name, t in _model().items():
        assert torch.equal(sd[name], t), name
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["source_step"] == "7"
    assert meta["source_world_size"] == "1" and meta["source_checkpoint"] == "step_7"
    assert all(isinstance(v, str) for v in meta.values())
    n = int.from_bytes(out.read_bytes()[:8], "little")
    assert (8 + n) % 8 == 0
    assert (r.tensors, r.step, r.world_size, r.files) == (6, 7, 1, (str(out),))
    assert r.bytes == sum(t.numel() * t.element_size() for t in _model().values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cast_touches_floating_tensors_only(ckpt, tmp_path, dtype):
    out = tmp_path / "m.safetensors"
    consolidate(ckpt, out, dtype=dtype, verify=True)
    sd = load_file(out)
    for name, t in _model().items():
        want = t.to(getattr(torch, dtype)) if t.is_floating_point() else t
        assert sd[name].dtype == want.dtype and torch.equal(sd[name], want), name


def test_in_kernel_copy_without_crc_check_is_exact(ckpt, tmp_path):
    out = tmp_path / "m.safetensors"
    consolidate(ckpt, out, check_crc=False)
    sd = load_file(out)
    assert all(torch.equal(sd[k], v) for k, v in _model().items())


def test_include_exclude_and_keep_prefix(ckpt, tmp_path):
    out = tmp_path / "m.safetensors"
    consolidate(ckpt, out, include=["*.weight", "scale"], exclude=["norm.*"])
    assert set(load_file(out)) == {"emb.weight", "proj.weight", "scale"}
    consolidate(ckpt, out, include=["model.emb.*"], keep_prefix=True, force=True)
    assert set(load_file(out)) == {"model.emb.weight"}
    with pytest.raises(ConfigError, match="no tensor matches"):
        consolidate(ckpt, out, include=["nothing*"])


def test_folder_output_is_hf_sharded_with_index(ckpt, tmp_path):
    dst = tmp_path / "hf"
    r = consolidate(ckpt, dst, max_shard_size=100)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(_leftovers(dst)) == sorted(files + ["model.safetensors.index.json"])
    assert index["metadata"]["total_size"] == r.bytes
    loaded = {}
    for name, file in index["weight_map"].items():  # what transformers' sharded loader does
        with safe_open(str(dst / file), "pt") as f:
            loaded[name] = f.get_tensor(name)
    assert all(torch.equal(loaded[k], v) for k, v in _model().items())
    with pytest.raises(ConfigError, match="--max-shard-size applies to a folder output"):
        consolidate(ckpt, tmp_path / "one.safetensors", max_shard_size=100)  # not ignored
    assert not (tmp_path / "one.safetensors").exists()


def test_existing_folder_is_refused_then_replaced_with_force(ckpt, tmp_path):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    (dst / "tokenizer.json").write_text("{}")
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"old 1")
    (dst / "model-00002-of-00002.safetensors").write_bytes(b"old 2")
    (dst / "model.safetensors.index.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(ConfigError, match="is not empty.*--force"):
        consolidate(ckpt, dst)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # nothing touched
    r = consolidate(ckpt, dst, force=True)  # fits one shard: model.safetensors, no index
    assert _leftovers(dst) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(r.removed) == ["model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def test_existing_file_is_refused_then_replaced_with_force(ckpt, tmp_path):
    dst = tmp_path / "precious.safetensors"
    dst.write_bytes(b"precious")
    with pytest.raises(ConfigError, match="already exists.*--force"):
        consolidate(ckpt, dst)
    assert dst.read_bytes() == b"precious"
    r = consolidate(ckpt, dst, force=True)
    assert r.removed == ("precious.safetensors",) and sorted(load_file(dst)) == sorted(_model())


@pytest.mark.parametrize("where", ["inside", "itself", "run", "step_name", "empty"])
def test_output_never_lands_in_the_source_or_its_run(ckpt, tmp_path, where):
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "step_1")
    src = run / "step_1"
    dst = {"inside": src / "model.safetensors", "itself": src, "run": run,
           "step_name": run / "step_99", "empty": ""}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError):
        consolidate(src if where != "run" else run, dst, force=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _flip_data_byte(src: Path, dst: Path, fqn: str) -> Path:
    shutil.copytree(src, dst)
    with CheckpointReader(Storage.open(dst)) as ck:
        t = ck.meta.tensors[fqn]
        cb = ck.locate(t, t.chunks[0])
        path, pos = dst / cb.reader.rel, cb.start + cb.nbytes // 2
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    return dst


def test_damaged_chunk_leaves_nothing_and_keeps_old_output(ckpt, tmp_path):
    bad = _flip_data_byte(ckpt, tmp_path / "bad", "model.emb.weight")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
        consolidate(bad, out_dir / "m.safetensors")
    with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
        consolidate(bad, out_dir / "hf", max_shard_size=50)
    assert _leftovers(out_dir) == []
    (out_dir / "m.safetensors").write_bytes(b"old")
    with pytest.raises(CorruptCheckpointError):
        consolidate(bad, out_dir / "m.safetensors", dtype="bfloat16", force=True)
    assert _leftovers(out_dir) == ["m.safetensors"]
    assert (out_dir / "m.safetensors").read_bytes() == b"old"


def test_keyboard_interrupt_from_progress_removes_output(ckpt, tmp_path):
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        consolidate(ckpt, tmp_path / "m.safetensors", progress=progress)
    with pytest.raises(KeyboardInterrupt):
        consolidate(ckpt, tmp_path / "hf", progress=progress, max_shard_size=50)
    assert calls and _leftovers(tmp_path) == []


def test_refuses_uncommitted_checkpoint(ckpt, tmp_path):
    torn = tmp_path / "step_8"
    shutil.copytree(ckpt, torn)
    (torn / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="cannot consolidate.*no .metadata"):
        consolidate(torn, tmp_path / "m.safetensors")
    assert _leftovers(tmp_path) == ["step_8"]


def test_accelerate_and_torchtitan_layouts(tmp_path):
    t = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    acc = tmp_path / "checkpoint_5"
    _save(acc / "pytorch_model_fsdp_0", {"model": t})
    _save(acc / "optimizer_0", {"optimizer": {"state": {"w": {"exp_avg": torch.ones(3, 2)}}}})
    consolidate(acc, tmp_path / "a.safetensors")
    titan = _save(tmp_path / "step-5", {"tok_embeddings.weight": t["w"], "norm.weight": t["b"]})
    consolidate(titan, tmp_path / "t.safetensors")
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "t.safetensors")
    assert set(a) == {"w", "b"} and torch.equal(a["w"], t["w"])
    assert set(b) == {"tok_embeddings.weight", "norm.weight"} and torch.equal(b["norm.weight"], t["b"])


def test_byte_path_never_imports_torch(ckpt, tmp_path):
    code = ("import sys; from ckptool.ops.consolidate import consolidate; "
            f"consolidate({str(ckpt)!r}, {str(tmp_path / 'm.safetensors')!r}, dtype='bfloat16', "
            "verify=True); assert 'torch' not in sys.modules, 'torch imported'")
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})


def test_cli_json_and_text(ckpt, tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.safetensors"
    res = runner.invoke(cli, ["consolidate", str(ckpt), str(out), "--json", "--verify"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["files"] == [str(out)] and summary["tensors"] == 6 and summary["verified"]
    assert summary["source"] == str(ckpt) and summary["step"] == 7 and summary["seconds"] > 0
    res = runner.invoke(cli, ["consolidate", str(ckpt), str(tmp_path / "hf"), "--max-shard-size", "100B"])
    assert res.exit_code == 0 and res.output.startswith(f"wrote {tmp_path / 'hf'} (")


def test_cli_errors_exit_1_usage_errors_exit_2(ckpt, tmp_path, capsys):
    from ckptool.cli import main

    torn = tmp_path / "step_8"
    shutil.copytree(ckpt, torn)
    (torn / ".metadata").unlink()
    for args, code, msg in (
            ([str(torn), str(tmp_path / "m.safetensors")], 1,
             ("error: cannot consolidate", "no .metadata", str(torn))),
            ([str(ckpt), str(tmp_path / "m.safetensors"), "--dtype", "int8"], 2, ("Invalid value",))):
        with pytest.raises(SystemExit) as e:
            main(["consolidate", *args])
        assert e.value.code == code
        err = capsys.readouterr().err
        assert all(m in err for m in msg) and (code == 2 or len(err.strip().splitlines()) == 1), err
    assert _leftovers(tmp_path) == ["step_8"]


def test_remote_source_through_fsspec(ckpt, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/consolidate-{tmp_path.name}/step_7"
    for f in ckpt.iterdir():
        fs.pipe_file(f"{root}/{f.name}", f.read_bytes())
    try:
        consolidate(f"memory://{root}", tmp_path / "m.safetensors", dtype="bfloat16")
        sd = load_file(tmp_path / "m.safetensors")
        assert all(torch.equal(sd[k], v.bfloat16() if v.is_floating_point() else v)
                   for k, v in _model().items())
        bad = _flip_data_byte(ckpt, tmp_path / "bad", "model.emb.weight")
        for f in bad.iterdir():
            fs.pipe_file(f"{root}/{f.name}", f.read_bytes())
        with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
            consolidate(f"memory://{root}", tmp_path / "m2.safetensors")
        assert not (tmp_path / "m2.safetensors").exists()
    finally:
        fs.rm(root.rsplit("/", 1)[0], recursive=True)

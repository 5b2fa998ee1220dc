"""DCP's safetensors storage (HuggingFaceStorageWriter) read like any checkpoint, one rank.

Every checkpoint here is written by the real producer, ``dcp.save(...,
storage_writer=HuggingFaceStorageWriter(...))`` in this process, in each of its modes: rank 0
alone (one file, or several via ``fqn_to_index_mapping``), ``save_distributed`` shards, and
shards plus their consolidation. The 2-rank gloo saves and torchtitan's ``CheckpointManager``
are in ``tests/dist/test_hf_storage_dist.py``.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

from ckptool.cli import main
from ckptool.format.checkpoint_dirs import list_checkpoints, resolve_checkpoint
from ckptool.format.metadata import read_metadata
from ckptool.format.safetensors_source import read_header
from ckptool.storage import Storage

_MAP = {"model.embed.weight": 1, "model.layers.0.w": 1, "model.norm.scale": 1,
        "lm_head.weight": 2, "ids": 2, "empty": 2}
MODES = ("rank0", "rank0-map", "distributed", "consolidated")


def _state(seed: int = 0, mode: str = "rank0") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "model.embed.weight": torch.randn(7, 4, generator=g),
        "model.layers.0.w": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        "model.norm.scale": torch.tensor(1.5, dtype=torch.float64),
        "lm_head.weight": torch.randn(5, 4, generator=g),  # no "model." prefix, as in HF models
        "ids": torch.arange(6),
        "empty": torch.zeros(0, 3),
    }
    if mode == "consolidated":  # torch's consolidation calls torch.finfo on every dtype
        del out["ids"]
    return out


def _hf_save(path: Path, state: dict[str, torch.Tensor], mode: str) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    fmap = {k: v for k, v in _MAP.items() if k in state}
    kwargs = {"rank0": {}, "rank0-map": {"fqn_to_index_mapping": fmap},
              "distributed": {"save_distributed": True, "fqn_to_index_mapping": fmap},
              "consolidated": {"save_distributed": True, "enable_consolidation": True,
                               "fqn_to_index_mapping": fmap}}[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.clone() for k, v in state.items()},
                 storage_writer=HuggingFaceStorageWriter(str(path), **kwargs), no_dist=True)
    return path


@pytest.fixture(scope="session")
def hf_ckpts(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per HuggingFaceStorageWriter mode, written once."""
    root = tmp_path_factory.mktemp("hfstorage")
    return {mode: _hf_save(root / mode, _state(mode=mode), mode) for mode in MODES}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# What the producer writes, as ckptool reads it


def test_files_are_what_the_producer_writes(hf_ckpts):
    names = {m: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
             for m, d in hf_ckpts.items()}
    assert names["rank0"] == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert names["distributed"] == ["shard-00001-model-00001-of-00002.safetensors",
                                    "shard-00001-model-00002-of-00002.safetensors"]
    assert "sharded/shard-00001-model-00002-of-00002.safetensors" in names["consolidated"]
    assert not any(".metadata" in n for ns in names.values() for n in ns)
    kinds = {m: resolve_checkpoint(d) for m, d in hf_ckpts.items()}
    assert all(c.kind == "safetensors" and c.committed for c in kinds.values())


@pytest.mark.parametrize("mode", MODES)
def test_index_model_chunks_and_planner_data(hf_ckpts, mode):
    meta = read_metadata(Storage.open(hf_ckpts[mode]))
    state = _state(mode=mode)
    assert list(sorted(meta.tensors)) == sorted(state)
    assert meta.planner_data == {k: (k,) for k in state}
    assert meta.storage_format == "safetensors" and meta.objects == {}
    for k, t in meta.tensors.items():
        assert t.shape == tuple(state[k].shape) and t.dtype.name == str(state[k].dtype)[6:]
        assert len(t.chunks) == 1 and all(c.storage.raw for c in t.chunks)
        # beside a consolidated copy, the shards DCP saved are read (the copy is checked)
        assert t.chunks[0].storage.relative_path.startswith("sharded/") == (mode == "consolidated")


@pytest.mark.parametrize("mode", MODES)
def test_validate_deep_inspect_consolidate(hf_ckpts, mode, tmp_path, capsys):
    from safetensors.torch import load_file

    ckpt = hf_ckpts[mode]
    code, out, err = _cli(capsys, "validate", "--deep", str(ckpt))
    assert code == 0, err
    want = _state(mode=mode)
    assert "carry no checksum" in out and f"ok: {ckpt} is complete ({len(want)} tensors" in out
    code, out, _ = _cli(capsys, "inspect", "--json", str(ckpt))
    assert code == 0
    groups = json.loads(out)["groups"]
    assert sorted(k["fqn"] for k in groups["model"]) == sorted(want)
    assert groups["optimizer"] == [] and groups["other"] == []
    dst = tmp_path / "out.safetensors"
    code, _, err = _cli(capsys, "consolidate", str(ckpt), str(dst))
    assert code == 0, err
    got = load_file(dst)
    assert sorted(got) == sorted(want)  # the names as saved: "model." kept, lm_head included
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("mode", MODES)
def test_reshard_to_two_ranks_loads_with_dcp(hf_ckpts, mode, tmp_path, capsys):
    from _dist import load_tensors

    dst = tmp_path / "ws2"
    code, _, err = _cli(capsys, "reshard", str(hf_ckpts[mode]), str(dst), "--to", "2")
    assert code == 0, err
    assert sorted(p.name for p in dst.iterdir() if p.suffix == ".distcp") == \
        ["__0_0.distcp", "__1_0.distcp"]
    got, want = load_tensors(dst), _state(mode=mode)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_consolidated_copy_is_checked_against_the_shards(hf_ckpts, capsys):
    """torch 2.13's consolidation writes a 0-dim tensor as zeros: said, never exported."""
    from safetensors.torch import load_file

    ckpt = hf_ckpts["consolidated"]
    copy = load_file(ckpt / "model-00001-of-00002.safetensors")["model.norm.scale"]
    assert copy.item() == 0.0  # the producer's own consolidated file (1.5 was saved)
    code, out, err = _cli(capsys, "validate", "--deep", str(ckpt))
    assert code == 0, err
    assert ("warning: copy-differs: model-00001-of-00002.safetensors holds model.norm.scale with "
            "other values than the shards DCP saved in sharded/") in out
    assert out.count("copy-differs") == 1


def test_consolidation_interrupted_reads_the_shards(hf_ckpts, tmp_path, capsys):
    """No index beside the consolidated files: the save's shards in sharded/ are merged."""
    from safetensors.torch import load_file

    ckpt = _copy(hf_ckpts["consolidated"], tmp_path / "step-3")
    (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    meta = read_metadata(Storage.open(ckpt))
    assert {c.storage.relative_path.split("/")[0] for t in meta.tensors.values()
            for c in t.chunks} == {"sharded"}
    code, _, err = _cli(capsys, "consolidate", str(ckpt), str(tmp_path / "o.safetensors"))
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(got[k], v) for k, v in _state(mode="consolidated").items())


# ---------------------------------------------------------------------------------------------
# Run folders: the newest committed checkpoint, whatever its kind


def _run_with_dcp_then_hf(root: Path, hf: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    root.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(seed=1), checkpoint_id=str(root / "step-10"))  # torchtitan's own step
    _copy(hf, root / "step-20")
    return root


def test_run_folder_resolves_to_newest_hf_step(hf_ckpts, tmp_path, capsys):
    from safetensors.torch import load_file

    run = _run_with_dcp_then_hf(tmp_path / "run", hf_ckpts["rank0-map"])
    assert resolve_checkpoint(run).name == "step-20"
    assert [(c.name, c.kind, c.committed) for c in list_checkpoints(run)] == \
        [("step-10", "dcp", True), ("step-20", "safetensors", True)]
    code, out, _ = _cli(capsys, "ls", str(run))
    assert code == 0
    assert "* step-20" in out and "step-10" in out and "incomplete" not in out
    code, _, err = _cli(capsys, "consolidate", str(run), str(tmp_path / "o.safetensors"))
    assert code == 0, err
    got = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(got[k], v) for k, v in _state().items())  # step 20's, not step 10's


def test_torn_index_is_skipped_for_the_older_step(hf_ckpts, tmp_path, capsys):
    run = _run_with_dcp_then_hf(tmp_path / "run", hf_ckpts["rank0"])
    index = run / "step-20" / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:40])  # the index is written last, not atomically
    assert resolve_checkpoint(run).name == "step-10"
    code, out, _ = _cli(capsys, "ls", str(run))
    assert "* step-10" in out and "incomplete" in out
    code, _, err = _cli(capsys, "validate", str(run / "step-20"))
    assert code == 1 and err.count("\n") == 1
    assert "bad-index" in err and "not valid JSON" in err


# ---------------------------------------------------------------------------------------------
# Broken checkpoints: one clear line, exit 1, never "interrupted" for a damaged file


def _shard(ckpt: Path, name: str = "model-00002-of-00002.safetensors") -> Path:
    return ckpt / name


def test_missing_shard_named_by_the_index(hf_ckpts, tmp_path, capsys):
    ckpt = _copy(hf_ckpts["rank0-map"], tmp_path / "c")
    _shard(ckpt).unlink()
    code, _, err = _cli(capsys, "validate", "--deep", str(ckpt))
    assert code == 1 and err.count("\n") == 1
    assert "missing-file" in err and "model-00002-of-00002.safetensors is missing" in err
    code, _, err = _cli(capsys, "consolidate", str(ckpt), str(tmp_path / "o.safetensors"))
    assert code == 1 and "is missing" in err and not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("mode,name", [("rank0-map", "model-00002-of-00002.safetensors"),
                                       ("distributed", "shard-00001-model-00002-of-00002.safetensors")])
def test_truncated_shard(hf_ckpts, tmp_path, capsys, mode, name):
    ckpt = _copy(hf_ckpts[mode], tmp_path / "c")
    f = _shard(ckpt, name)
    f.write_bytes(f.read_bytes()[:-10])
    code, _, err = _cli(capsys, "validate", "--deep", str(ckpt))
    assert code == 1 and err.count("\n") == 1
    assert "truncated-file" in err and name in err and "past the end" in err
    assert "interrupted" not in err
    code, _, err = _cli(capsys, "reshard", str(ckpt), str(tmp_path / "r"), "--to", "2")
    assert code == 1 and "past the end" in err and not (tmp_path / "r").exists()


def _rewrite_header(path: Path, edit) -> None:
    """Edit the JSON header, keeping the data bytes as they are."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(edit(json.loads(raw[8:8 + n])), separators=(",", ":")).encode()
    text = text.ljust(-(-len(text) // 8) * 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_header_offset_past_the_end(hf_ckpts, tmp_path, capsys):
    ckpt = _copy(hf_ckpts["rank0-map"], tmp_path / "c")

    def edit(h):
        h["lm_head.weight"]["data_offsets"] = [10**6, 10**6 + 80]
        return h

    _rewrite_header(_shard(ckpt), edit)
    code, _, err = _cli(capsys, "validate", str(ckpt))
    assert code == 1 and err.count("\n") == 1
    assert "'lm_head.weight' ends at data byte 1000080, past the end of the file" in err


def test_header_lies_about_size_or_overlaps(hf_ckpts, tmp_path):
    ckpt = _copy(hf_ckpts["rank0"], tmp_path / "c")
    f = ckpt / "model-00001-of-00001.safetensors"
    st = Storage.open(ckpt)
    assert list(read_header(st, f.name).tensors)[0] == "ids"  # data order

    def shrink(h):
        h["ids"]["shape"] = [5]
        return h

    _rewrite_header(f, shrink)
    with pytest.raises(Exception, match="spans 48 bytes but shape \\[5\\] of int64 needs 40"):
        read_header(st, f.name)
    f.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(Exception, match="does not fit the file"):
        read_header(st, f.name)


def test_index_path_outside_the_folder_is_refused(hf_ckpts, tmp_path, capsys):
    ckpt = _copy(hf_ckpts["rank0"], tmp_path / "c")
    (tmp_path / "evil.safetensors").write_bytes((ckpt / "model-00001-of-00001.safetensors").read_bytes())
    index = ckpt / "model.safetensors.index.json"
    obj = json.loads(index.read_text())
    obj["weight_map"] = {k: "../evil.safetensors" for k in obj["weight_map"]}
    index.write_text(json.dumps(obj))
    code, _, err = _cli(capsys, "validate", str(ckpt))
    assert code == 1 and "path-outside" in err and "refusing to read it" in err


def test_shards_with_a_rank_gap_are_incomplete(hf_ckpts, tmp_path, capsys):
    ckpt = _copy(hf_ckpts["distributed"], tmp_path / "c")
    for f in ckpt.iterdir():  # pretend ranks 0 and 2 wrote, rank 1 never did
        f.rename(ckpt / f.name.replace("shard-00001", "shard-00003"))
    shutil.copy(ckpt / "shard-00003-model-00001-of-00002.safetensors",
                ckpt / "shard-00001-model-00001-of-00002.safetensors")
    code, _, err = _cli(capsys, "validate", str(ckpt))
    assert code == 1 and "incomplete" in err and "no shard of rank 1" in err


def test_checkpointer_neither_resumes_from_nor_deletes_an_hf_step_folder(hf_ckpts, tmp_path):
    """A step_N folder of safetensors in a ckptool run is read by the read-side commands, but
    resume (dcp.load) and retention leave it alone."""
    import torch.distributed.checkpoint as dcp

    from ckptool.checkpoint import latest_valid, retention_victims, step_checkpoints

    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(seed=1), checkpoint_id=str(run / "step_10"))
    _copy(hf_ckpts["rank0-map"], run / "step_20")
    assert resolve_checkpoint(run).name == "step_20"  # read side: the newest checkpoint
    assert [c.name for c in step_checkpoints(run)] == ["step_10"]
    assert latest_valid(run).name == "step_10"
    assert retention_victims(step_checkpoints(run), keep=1) == []

"""``reshard`` on small in-process checkpoints: geometry, exact values, refusals, CLI, memory.

Multi-rank sources here are written in-process with ckptool's own record writer (the real
multi-process FSDP2 ones are in ``tests/dist/test_reshard_dist.py``); every output is read
back with torch's own ``dcp.load``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ckptool.cli import main
from ckptool.errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import manifest as mf
from ckptool.format.dcp_writer import DistcpFile, tensor_record, write_metadata
from ckptool.format.dtypes import DTYPES
from ckptool.format.metadata import (BytesEntry, CheckpointMetadata, Chunk, TensorEntry,
                                     read_metadata)
from ckptool.format.reader import CheckpointReader
from ckptool.format.fsdp_layout import fsdp_chunks, shard_rows
from ckptool.ops.reshard import default_destination, reshard
from ckptool.storage import Storage


def _tensors(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model.emb": torch.randn(13, 6, generator=g),
            "model.bias": torch.randn(10, generator=g).to(torch.bfloat16),
            "model.tiny": torch.randn(2, 3, generator=g).to(torch.float64),
            "optim.state.emb.exp_avg": torch.randn(13, 6, generator=g),
            "optim.state.emb.step": torch.tensor(4.0),
            "model.ids": torch.arange(7 * 4, dtype=torch.int64).reshape(7, 4)}


def _raw(t) -> bytes:
    import torch

    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _boxes(shape, n):
    """(rank, offsets, sizes) of a 2-D grid split (not row blocks) or FSDP row blocks."""
    return [(r, c.offsets, c.sizes) for r, c in fsdp_chunks(shape, n)]


def make_source(path: Path, n: int, tensors: dict | None = None, *, boxes=_boxes,
                strided: frozenset = frozenset(), step: int = 3) -> dict:
    """An n-rank DCP checkpoint written in-process (records as torch.save writes them)."""
    import torch

    tensors = tensors if tensors is not None else _tensors()
    path.mkdir(parents=True)
    files = [DistcpFile(path / f"__{r}_0.distcp") for r in range(n)]
    obj = io.BytesIO()
    torch.save(step, obj)
    entries, objects = {}, {"step": BytesEntry("step", files[0].append_record(obj.getvalue()))}
    for fqn, t in tensors.items():
        chunks = []
        for rank, offs, sizes in boxes(tuple(t.shape), n):
            piece = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
            if fqn in strided:  # a transposed view: a non-contiguous record, as DCP may write
                buf = io.BytesIO()
                torch.save(piece.t().contiguous().t(), buf)
                rec = buf.getvalue()
            else:
                rec = tensor_record(DTYPES[str(t.dtype).split(".")[1]], tuple(piece.shape),
                                    _raw(piece))
            chunks.append(Chunk(offs, sizes, files[rank].append_record(rec)))
        entries[fqn] = TensorEntry(fqn, DTYPES[str(t.dtype).split(".")[1]], tuple(t.shape),
                                   tuple(chunks))
    for f in files:
        f.close()
    planner = {k: tuple(k.split(".", 1)) for k in [*tensors, "step"]}
    write_metadata(path, CheckpointMetadata(entries, objects, planner, "1.0.0", "src"))
    return tensors


def load_full(path: Path) -> dict:
    """Every value of a checkpoint, read in full by torch's dcp.load (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    meta = read_metadata(Storage.open(path))
    state = {k: torch.empty(t.shape, dtype=getattr(torch, t.dtype.name))
             for k, t in meta.tensors.items()}
    state.update({k: None for k in meta.objects})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))
    return state


def assert_layout(path: Path, world_size: int) -> None:
    """File r holds exactly rank r's FSDP2 shard of every tensor (0-dim and values on rank 0)."""
    meta = read_metadata(Storage.open(path))
    assert sorted(meta.files()) == sorted(f"__{r}_0.distcp" for r in range(world_size))
    for t in meta.tensors.values():
        got = sorted((int(c.storage.relative_path.split("_")[2]), c.offsets, c.sizes)
                     for c in t.chunks)
        assert got == sorted(_boxes(t.shape, world_size)), t.fqn
    assert all(o.storage.relative_path == "__0_0.distcp" for o in meta.objects.values())


def _equal(a: dict, b: dict) -> None:
    import torch

    for k, v in b.items():
        assert torch.equal(a[k], v), k


# ---------------------------------------------------------------------------------------------
# Geometry


def test_shard_rows_is_torch_chunk():
    import torch

    for n in range(0, 21):
        for m in range(1, 10):
            parts = torch.arange(n).chunk(m) if n else ()
            for r in range(m):
                lo, hi = shard_rows(n, m, r)
                want = parts[r].tolist() if r < len(parts) else []
                assert list(range(lo, hi)) == want, (n, m, r)


def test_empty_shards_are_recorded_once_at_offset_n():
    # what DCP records for FSDP2 (see tests/dist): 10 rows on 8 ranks -> ranks 5-7 empty
    got = [(r, c.offsets, c.sizes) for r, c in fsdp_chunks((10, 6), 8)]
    assert got[-1] == (5, (10, 0), (0, 6)) and len(got) == 6
    assert [(r, c.offsets, c.sizes) for r, c in fsdp_chunks((), 4)] == [(0, (), ())]
    assert [(r, c.sizes) for r, c in fsdp_chunks((0, 3), 2)] == [(0, (0, 3))]


# ---------------------------------------------------------------------------------------------
# Exact values, any pair


@pytest.mark.parametrize("n,m", [(3, 1), (3, 2), (3, 4), (5, 3), (2, 7), (4, 4)])
def test_values_exact_and_layout(tmp_path, n, m):
    src = tmp_path / "src"
    tensors = make_source(src, n)
    r = reshard(src, tmp_path / "out", world_size=m, expect_from=n)
    assert (r.source_world_size, r.world_size, r.tensors, r.objects) == (n, m, len(tensors), 1)
    assert r.verified and r.bytes == sum(t.nbytes for t in tensors.values())
    got = load_full(tmp_path / "out")
    _equal(got, tensors)
    assert got["step"] == 3
    assert_layout(tmp_path / "out", m)


def test_non_row_block_and_strided_sources(tmp_path):
    def grid(shape, n):  # 2 x 2 boxes over ranks 0..3 (like 2-D sharding) for 2-D tensors
        if len(shape) != 2:
            return _boxes(shape, n)
        h, w = shape[0] // 2, shape[1] // 2
        return [(0, (0, 0), (h, w)), (1, (0, w), (h, shape[1] - w)),
                (2, (h, 0), (shape[0] - h, w)), (3, (h, w), (shape[0] - h, shape[1] - w))]

    src = tmp_path / "src"
    tensors = make_source(src, 4, boxes=grid, strided=frozenset({"model.tiny"}))
    reshard(src, tmp_path / "out", world_size=3)
    _equal(load_full(tmp_path / "out"), tensors)
    assert_layout(tmp_path / "out", 3)
    # a strided record in a row-block layout too
    src2 = tmp_path / "src2"
    make_source(src2, 2, tensors, strided=frozenset({"model.emb", "model.ids"}))
    reshard(src2, tmp_path / "out2", world_size=3)
    _equal(load_full(tmp_path / "out2"), tensors)


def test_replicated_tensor_stays_whole_on_rank_0(tmp_path):
    def buffers_whole(shape, n):
        return [(0, (0,) * len(shape), shape)] if shape == (2, 3) else _boxes(shape, n)

    src = tmp_path / "src"
    tensors = make_source(src, 3, boxes=buffers_whole)
    reshard(src, tmp_path / "out", world_size=2)
    meta = read_metadata(Storage.open(tmp_path / "out"))
    (chunk,) = meta.tensors["model.tiny"].chunks
    assert chunk.storage.relative_path == "__0_0.distcp" and chunk.sizes == (2, 3)
    _equal(load_full(tmp_path / "out"), tensors)


def test_real_single_rank_dcp_save_to_three_and_to_one(single_ckpt, tmp_path):
    import torch

    r = reshard(single_ckpt, tmp_path / "ws3", world_size=3)
    assert r.source_world_size == 1
    got = load_full(tmp_path / "ws3")
    g = torch.Generator().manual_seed(0)
    assert torch.equal(got["model.w"], torch.randn(5, 3, generator=g))
    assert got["step"] == 3 and got["model.scale"].item() == 2.5
    back = tmp_path / "ws1"
    reshard(tmp_path / "ws3", back, world_size=1, expect_from=3)
    assert sorted(p.name for p in back.iterdir()) == [".metadata", "__0_0.distcp", "ckptool.json"]
    _equal(load_full(back), {k: v for k, v in got.items() if k != "step"})


# ---------------------------------------------------------------------------------------------
# Manifest, progress, memory, torch-free


def test_manifest_rewritten_for_new_layout(tmp_path):
    src = tmp_path / "demo" / "step_7"
    make_source(src, 3)
    mf.write_manifest(Storage.open(src), mf.build_manifest(
        Storage.open(src), step=7, world_size=3, loss=1.25, config={"lr": 0.1}))
    r = reshard(src, world_size=2)
    out = Path(r.destination)
    # a new run beside the source run (resumable there), never inside the source run
    assert out == tmp_path / "demo-ws2" / "step_7" == default_destination(src, 2)
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["step_7"]
    m = mf.read_manifest(Storage.open(out))
    assert (m.step, m.world_size, m.loss, m.config) == (7, 2, 1.25, {"lr": 0.1})
    assert m.source == {"path": str(src), "world_size": 3, "operation": "reshard"}
    assert sorted(m.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, info in m.files.items():
        assert (info["size"], info["xxh3_64"]) == mf.file_checksum(Storage.open(out), name)
        assert r.files[name] == info["size"]


def test_progress_is_monotonic_and_complete(tmp_path):
    make_source(tmp_path / "src", 3)
    seen: list[tuple[int, int]] = []
    reshard(tmp_path / "src", tmp_path / "out", world_size=2,
            progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_memory_stays_bounded(tmp_path):
    import tracemalloc

    import torch

    big = {"model.big": torch.arange(24 << 20, dtype=torch.float32).reshape(3 << 20, 8)}
    make_source(tmp_path / "src", 3, big)  # 96 MiB of data
    tracemalloc.start()
    try:
        reshard(tmp_path / "src", tmp_path / "out", world_size=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak >> 20} MiB"


def test_byte_path_does_not_import_torch(single_ckpt, tmp_path):
    code = ("import sys; from ckptool.ops.reshard import reshard; "
            f"r = reshard({str(single_ckpt)!r}, {str(tmp_path / 'o')!r}, world_size=2); "
            "assert r.verified; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Refusals (CLI: exit codes and messages)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["reshard", *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_wrong_from_is_refused_and_nothing_written(tmp_path, capsys):
    make_source(tmp_path / "src", 3)
    code, _, err = _cli(capsys, str(tmp_path / "src"), str(tmp_path / "out"), "--from", "8",
                        "--to", "2")
    assert code == 1
    assert err == (f"error: {tmp_path / 'src'} was saved by 3 ranks, not 8. Pass --from 3 (or "
                   "leave --from out); nothing was written\n")
    assert _siblings(tmp_path / "src") == ["src"]


def test_existing_destination_needs_force(tmp_path, capsys):
    make_source(tmp_path / "src", 3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    code, _, err = _cli(capsys, str(tmp_path / "src"), str(tmp_path / "out"), "--to", "2")
    assert code == 1 and "already exists. Pass --force to replace it" in err
    assert os.listdir(tmp_path / "out") == ["keep"]
    code, _, err = _cli(capsys, str(tmp_path / "src"), str(tmp_path / "out"), "--to", "2",
                        "--force")  # --force replaces a checkpoint, not someone's files
    assert code == 1 and "not a checkpoint's (keep)" in err
    assert os.listdir(tmp_path / "out") == ["keep"]
    (tmp_path / "out" / "keep").unlink()
    code, out, _ = _cli(capsys, str(tmp_path / "src"), str(tmp_path / "out"), "--to", "2",
                        "--force", "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["world_size"] == 2 and summary["verified"] is True
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp",
                                                    "__1_0.distcp", "ckptool.json"]
    assert _siblings(tmp_path / "out") == ["out", "src"]  # no temporary folder left


def test_destination_may_not_be_the_source(tmp_path):
    make_source(tmp_path / "src", 2)
    with pytest.raises(ConfigError, match="is, or contains, the source"):
        reshard(tmp_path / "src", tmp_path / "src", world_size=1, force=True)
    with pytest.raises(ConfigError, match="is, or contains, the source"):
        reshard(tmp_path / "src", tmp_path, world_size=1, force=True)


def test_flipped_data_byte_is_refused(tmp_path):
    make_source(tmp_path / "src", 3)
    with CheckpointReader(Storage.open(tmp_path / "src")) as ck:
        t = ck.meta.tensors["model.emb"]
        start = ck.locate(t, t.chunks[1]).start  # first byte of the chunk's elements
        path = tmp_path / "src" / t.chunks[1].storage.relative_path
    data = bytearray(path.read_bytes())
    data[start + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC-32 mismatch"):
        reshard(tmp_path / "src", tmp_path / "out", world_size=2, verify=False)
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "src") == ["src"]


def test_accelerate_layout_points_at_its_parts(tmp_path):
    make_source(tmp_path / "run" / "pytorch_model_fsdp_0", 2)
    with pytest.raises(IncompatibleCheckpointError, match="Reshard each part on its own"):
        reshard(tmp_path / "run", tmp_path / "out", world_size=1)


def test_cli_text_summary(tmp_path, capsys):
    make_source(tmp_path / "src", 2)
    code, out, _ = _cli(capsys, str(tmp_path / "src"), "--to", "3", "--no-verify")
    assert code == 0
    assert out.startswith(f"wrote {tmp_path / 'src-ws3'}: 3 ranks (from 2), 6 tensors, 1 other")
    assert out.rstrip().endswith("(not verified)")


def test_remote_source_to_local_folder(tmp_path):
    import fsspec

    tensors = make_source(tmp_path / "src", 3)
    fs = fsspec.filesystem("memory")
    for p in (tmp_path / "src").iterdir():
        fs.pipe_file(f"/reshard-src/step_1/{p.name}", p.read_bytes())
    with pytest.raises(ConfigError, match="is remote; give a local DST"):
        reshard("memory://reshard-src/step_1", world_size=2)
    r = reshard("memory://reshard-src/step_1", tmp_path / "out", world_size=2, expect_from=3)
    assert r.verified
    _equal(load_full(tmp_path / "out"), tensors)


def test_interrupt_from_progress_leaves_nothing(tmp_path):
    make_source(tmp_path / "src", 3)

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reshard(tmp_path / "src", tmp_path / "out", world_size=2, progress=stop)
    assert _siblings(tmp_path / "src") == ["src"]


def test_force_replaces_a_checkpoint_never_a_folder_of_other_files(tmp_path):
    make_source(tmp_path / "src", 2)
    dst = tmp_path / "dst"
    reshard(tmp_path / "src", dst, world_size=1)
    reshard(tmp_path / "src", dst, world_size=3, force=True)  # a checkpoint: replaced
    assert len(list(dst.glob("*.distcp"))) == 3
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a checkpoint's \\(notes.txt\\)"):
        reshard(tmp_path / "src", dst, world_size=2, force=True)
    assert (dst / "notes.txt").read_text() == "mine" and len(list(dst.glob("*.distcp"))) == 3

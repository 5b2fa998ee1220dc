"""consolidate on real multi-rank checkpoints (FSDP2 on gloo): exact against the gathered state."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckptool.cli import cli
from ckptool.ops.consolidate import consolidate

pytestmark = pytest.mark.dist


def _full_model(ref: Path) -> dict[str, torch.Tensor]:
    return torch.load(ref, weights_only=True)["model"]


def _assert_exact(out: Path, want: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    got = load_file(out)
    assert set(got) == set(want)
    for name, t in want.items():
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory) -> tuple[Path, Path]:
    from factory import make_fsdp_checkpoint

    root = tmp_path_factory.mktemp("fsdp8")
    ref = root / "full.pt"
    return make_fsdp_checkpoint(root / "step_1", 8, ref=str(ref)), ref


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_three_ranks_uneven_exact(fsdp3, tmp_path, dtype):
    ckpt, ref = fsdp3
    out = tmp_path / "m.safetensors"
    r = consolidate(ckpt, out, dtype=dtype, verify=True)
    _assert_exact(out, _full_model(ref), getattr(torch, dtype) if dtype else None)
    assert r.world_size == 3 and r.step == 1


def test_eight_ranks_with_empty_shards_exact(fsdp8, tmp_path):
    ckpt, ref = fsdp8
    runner = CliRunner()
    for dtype in ("float32", "bfloat16", "float16"):
        out = tmp_path / f"{dtype}.safetensors"
        res = runner.invoke(cli, ["consolidate", str(ckpt), str(out), "--dtype", dtype, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["world_size"] == 8
        _assert_exact(out, _full_model(ref), getattr(torch, dtype))


def test_sharded_output_index_is_correct(fsdp3, tmp_path):
    ckpt, ref = fsdp3
    dst = tmp_path / "hf"
    consolidate(ckpt, dst, max_shard_size=300)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    want = _full_model(ref)
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    for file in files:
        with safe_open(str(dst / file), "pt") as f:
            got = {name: f.get_tensor(name) for name in f.keys()}
        data = sum(t.numel() * t.element_size() for t in got.values())
        assert data <= 300 or len(got) == 1, file  # a bigger tensor gets a shard of its own
        for name, t in got.items():
            assert index["weight_map"][name] == file and torch.equal(t, want[name])


def test_every_broken_variant_is_refused(fsdp3, tmp_path, monkeypatch, capsys):
    from factory import VARIANTS, break_checkpoint

    from ckptool.cli import main

    marker = tmp_path / "pwned"
    monkeypatch.setenv("CKPTOOL_PWNED", str(marker))
    for variant in VARIANTS:
        bad = break_checkpoint(fsdp3[0], tmp_path / variant, variant)
        out = tmp_path / f"{variant}.safetensors"
        with pytest.raises(SystemExit) as e:
            main(["consolidate", str(bad), str(out)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("error: ") and "\n" not in err, (variant, err)
        assert not out.exists() and not list(tmp_path.glob(".*.tmp-*")), variant
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Layouts other than FSDP2's Shard(0): column shards go one tensor at a time


def _layouts_worker(rank: int, world_size: int, out: str, ref: str, rdzv: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)  # the same full tensors on every rank
        full = {"cols": torch.randn(10, 7), "mid": torch.randn(3, 5, 4).to(torch.bfloat16),
                "rows": torch.randn(13, 3), "ids": torch.arange(8), "vec": torch.randn(1)}
        mesh = init_device_mesh("cpu", (world_size,))
        plan = {"cols": Shard(1), "mid": Shard(1), "rows": Shard(0), "ids": Replicate(),
                "vec": Shard(0)}
        model = {k: distribute_tensor(full[k], mesh, [pl]) for k, pl in plan.items()}
        dcp.save({"model": model}, checkpoint_id=out)
        if rank == 0:
            torch.save(full, ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_column_shards_exact(tmp_path):
    import torch.multiprocessing as mp

    from ckptool.format.metadata import read_metadata
    from ckptool.storage import Storage

    ckpt, ref = tmp_path / "ckpt", tmp_path / "full.pt"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_layouts_worker, args=(2, str(ckpt), str(ref), f"{tmp}/rdzv"), nprocs=2)
    meta = read_metadata(Storage.open(ckpt))
    assert any(c.offsets[1] > 0 for c in meta.tensors["model.cols"].chunks)  # really not rows
    full = torch.load(ref, weights_only=True)
    for dtype in (None, "bfloat16"):
        out = tmp_path / f"{dtype}.safetensors"
        consolidate(ckpt, out, dtype=dtype, verify=True)
        _assert_exact(out, full, getattr(torch, dtype) if dtype else None)


# ---------------------------------------------------------------------------------------------
# train -> consolidate -> examples/generate.py


def test_generate_example_matches_trained_model(tmp_path):
    import importlib.util
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    from ckptool.train.model import GPT

    run = tmp_path / "run"
    subprocess.run([sys.executable, "-c", "from ckptool.cli import main; main()", "train", "--out",
                    str(run), "--steps", "2", "--save-every", "2", "--nproc", "2"],
                   check=True, capture_output=True)
    consolidate(run / "step_2", tmp_path / "m.safetensors")
    path = Path(__file__).parents[2] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)  # type: ignore[union-attr]
    model = gen.load_model(tmp_path / "m.safetensors")
    trained = GPT(model.cfg)
    state = {"model": trained.state_dict()}
    with warnings.catch_warnings():  # "no process group: loading in a single process"
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(run / "step_2"))  # the trained full state, via DCP
    trained.load_state_dict(state["model"])
    idx = torch.randint(0, model.cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx), trained.eval()(idx))
    assert len(gen.generate(model, b"The ", 8)) == 8

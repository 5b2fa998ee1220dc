"""Checkpoints of other meshes, read exactly by every command (issue 11).

One 4-rank gloo world (CPU device mesh, real ``parallelize_module`` / ``fully_shard`` /
``dcp.save``) writes four checkpoints, each with the gathered full reference beside it:

* ``tp``: tensor parallel over 4 ranks: ``ColwiseParallel`` (``Shard(0)``, uneven rows),
  ``RowwiseParallel`` (``Shard(1)`` column chunks; its bias replicated, saved once);
* ``dp_tp``: a 2-D (dp=2, tp=2) mesh: TP inside, FSDP2 ``fully_shard`` over dp
  (``_StridedShard`` rows, and row x column boxes);
* ``hsdp``: ``fully_shard`` on a (replicate=2, shard=2) mesh: replicated shards, saved once by
  DCP's dedup;
* ``items``: FSDP2 over 4 ranks of a model with root-level ``scale``, ``cls_token``, 0-dim
  buffers ``step_count`` (int64) and ``temperature``, an empty (0 x D) buffer, bf16 weights
  (FSDP2 refuses 0-dim parameters; the one-rank tests in ``tests/unit/test_odd_items.py``
  have them).

For each: ``validate --deep`` passes; ``consolidate`` gives every model tensor ``torch.equal``
to the reference; ``reshard --to 2`` and ``--to 3`` load back (``dcp.load``) to exactly the
reference values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _dist import run_dist

pytestmark = pytest.mark.dist

D, H, ROWS = 6, 10, 7  # 10 rows over 4 ranks: 3,3,3,1; 7 over 4: 2,2,2,1
PRODUCERS = ("tp", "dp_tp", "hsdp", "items")


def _mlp():
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(D, H)
            self.down = nn.Linear(H, D)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    return MLP()


def _items_model():
    import torch
    from torch import nn

    class Items(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([1.5]))  # FSDP2 refuses 0-dim parameters
            self.register_buffer("temperature", torch.tensor(0.25))
            self.cls_token = nn.Parameter(torch.randn(1, 1, D))
            self.register_buffer("step_count", torch.tensor(7, dtype=torch.int64))
            self.register_buffer("empty", torch.zeros(0, D))
            self.register_buffer("ids", torch.arange(ROWS, dtype=torch.int64))
            self.proj = nn.Linear(D, ROWS).to(torch.bfloat16)

        def forward(self, x):
            return self.proj(x.to(torch.bfloat16)).float() * self.scale

    return Items()


def _save(rank: int, name: str, sd: dict, out: str) -> dict:
    """``dcp.save`` the sharded state; return the gathered full reference (on every rank)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    dcp.save({"model": sd} if name != "items" else sd, checkpoint_id=os.path.join(out, name))
    full = {}
    for k, v in sd.items():
        full[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return {k: v.detach().clone() for k, v in full.items() if isinstance(v, torch.Tensor)}


def _producer(rank: int, world_size: int, out: str) -> dict | None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    refs = {}
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

    torch.manual_seed(0)
    tp = parallelize_module(_mlp(), init_device_mesh("cpu", (4,)), plan)
    refs["tp"] = _save(rank, "tp", tp.state_dict(), out)

    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(_mlp(), mesh["tp"], plan)
    fully_shard(m, mesh=mesh["dp"])
    refs["dp_tp"] = _save(rank, "dp_tp", m.state_dict(), out)

    torch.manual_seed(2)
    m = _mlp()
    fully_shard(m, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    refs["hsdp"] = _save(rank, "hsdp", m.state_dict(), out)

    torch.manual_seed(3)
    m = _items_model()
    fully_shard(m, mesh=init_device_mesh("cpu", (4,)))
    refs["items"] = _save(rank, "items", m.state_dict(), out)
    return refs if rank == 0 else None


@pytest.fixture(scope="session")
def meshes(tmp_path_factory) -> tuple[Path, dict]:
    """The four checkpoints (``root / name``) and their full references (name -> fqn -> tensor)."""
    root = tmp_path_factory.mktemp("meshes")
    refs = run_dist(_producer, 4, str(root))[0]
    return root, refs


def _cli(*args: str) -> str:
    from click.testing import CliRunner

    from ckptool.cli import cli

    res = CliRunner().invoke(cli, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def _key(name: str, fqn: str) -> str:
    """The DCP key of a model tensor (``items`` saved ``model.state_dict()`` at the top)."""
    return fqn if name == "items" else f"model.{fqn}"


@pytest.mark.parametrize("name", PRODUCERS)
def test_validate_deep_and_inspect(meshes, name):
    from ckptool.format.metadata import read_metadata
    from ckptool.ops.inspect import inspect
    from ckptool.ops.validate import validate
    from ckptool.storage import Storage

    root, refs = meshes
    _cli("validate", "--deep", str(root / name))
    _cli("inspect", str(root / name))
    report = validate(root / name, deep=True)
    assert report.ok and report.findings == () and report.world_size == 4
    assert sorted(inspect(root / name).names.values()) == sorted(refs[name])
    if name == "hsdp":  # replicate x shard: each shard saved once (DCP's dedup), not twice
        meta = read_metadata(Storage.open(root / name))
        assert {k: len(t.chunks) for k, t in meta.tensors.items()} == {
            _key(name, k): 2 for k in refs[name]}


@pytest.mark.parametrize("name", PRODUCERS)
def test_consolidate_equals_the_gathered_model(meshes, name, tmp_path):
    import torch
    from safetensors.torch import load_file

    root, refs = meshes
    out = tmp_path / "model.safetensors"
    _cli("consolidate", str(root / name), str(out))
    got = load_file(out)
    assert set(got) == set(refs[name])  # the model's own state_dict() names, nothing dropped
    for k, v in refs[name].items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", PRODUCERS)
def test_reshard_loads_back_exactly(meshes, name, ranks, tmp_path):
    import torch

    from _dist import load_tensors

    root, refs = meshes
    out = tmp_path / f"ws{ranks}"
    _cli("reshard", str(root / name), "--to", str(ranks), str(out))
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(ranks)]
    got = load_tensors(out)
    assert set(got) == {_key(name, k) for k in refs[name]}
    for k, v in refs[name].items():
        assert torch.equal(got[_key(name, k)], v), k

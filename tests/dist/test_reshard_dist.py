"""Reshard real FSDP2 checkpoints (8, 4 and 3 gloo ranks), then load and train on M ranks.

Cost is dominated by starting rank processes, not by resharding (torch-free, milliseconds),
so the pairs are grouped by target: one M-rank world loads the outputs of all three sources.
That covers all 12 pairs {8, 4, 3} -> {4, 3, 2, 1} with 15 + 10 rank processes. Ranks are
forked (not spawned) from this already-initialised interpreter, which saves the ~2 s import of
torch per rank on 2 cores; nothing is mocked: ``fully_shard`` on a CPU mesh, gloo, ``dcp.save``,
``dcp.load``, ``set_state_dict`` and AdamW are the real ones.

Each M-rank world checks, for every source: every model and optimizer tensor gathered after
``dcp.load`` + ``set_state_dict`` is ``torch.equal`` to the source's gathered reference; each
rank's local shard (params and moments) equals the chunk stored in *its* file ``__r_0.distcp``;
the loss equals that of a plain model holding the reference weights; one more AdamW step gives
the same parameters as the same step on that plain model (``assert_close``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

SOURCES = (8, 4, 3)
TARGETS = (4, 3, 2, 1)


def _fork(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, rdzv, *args)`` on ``world_size`` forked processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ckptool-reshard-") as tmp:
        mp.start_processes(fn, args=(world_size, f"{tmp}/rdzv", *args), nprocs=world_size,
                           start_method="fork")


def _save_worker(rank: int, world_size: int, rdzv: str, out: str, ref: str) -> None:
    import factory

    factory._worker(rank, world_size, out, ref, rdzv, 0, False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """Real FSDP2 (model + AdamW) checkpoints from 8, 4 and 3 ranks, with full references."""
    root = tmp_path_factory.mktemp("reshard-sources")
    out = {}
    for n in SOURCES:
        ckpt, ref = root / f"ws{n}" / "step_1", root / f"ws{n}.pt"
        _fork(_save_worker, n, str(ckpt), str(ref))
        out[n] = ckpt, ref
    return out


# ---------------------------------------------------------------------------------------------
# The M-rank world


def _build(world_size: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import factory

    torch.manual_seed(1234)  # not the source's init: loading must overwrite every value
    model = factory._toy_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch():
    import torch

    import factory

    return torch.randint(0, factory.VOCAB, (4, 5), generator=torch.Generator().manual_seed(99))


def _check_own_file(rank: int, ckpt: str, model, opt) -> None:
    """Each local shard (param, exp_avg, exp_avg_sq, step) is the chunk in this rank's file."""
    import torch

    from ckptool.format.reader import CheckpointReader
    from ckptool.storage import Storage

    mine = f"__{rank}_0.distcp"
    with CheckpointReader(Storage.open(ckpt)) as ck:
        for name, p in model.named_parameters():
            state = opt.state[p]
            for fqn, value in ((f"model.{name}", p), *((f"optim.state.{name}.{k}", v)
                                                        for k, v in state.items())):
                local = value.to_local() if hasattr(value, "to_local") else value
                t = ck.meta.tensors[fqn]
                here = [c for c in t.chunks if c.storage.relative_path == mine and c.numel]
                if local.dim() == 0 and rank != 0:
                    assert not here, fqn  # 0-dim state lives in rank 0's file only
                    continue
                if local.numel() == 0:
                    assert not here, fqn
                    continue
                assert len(here) == 1 and here[0].sizes == tuple(local.shape), (fqn, here)
                raw = bytearray(ck.read_chunk(t, here[0]))
                stored = torch.frombuffer(raw, dtype=local.dtype).reshape(local.shape)
                assert torch.equal(stored, local.detach()), fqn


def _compare_full(model, opt, ref: dict) -> None:
    """Gathered state == the source's gathered reference (called on all ranks)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    fm, fo = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return
    assert fm.keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(fm[k], v), k
    assert fo["state"].keys() == ref["optim"]["state"].keys()
    for p, st in ref["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(fo["state"][p][k], v), (p, k)
    assert fo["param_groups"] == ref["optim"]["param_groups"]


def _train_step_matches_plain(model, opt, ref: dict) -> None:
    """The loss and one more AdamW step agree with a plain (unsharded) model at the reference."""
    import torch
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    import factory

    plain = factory._toy_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    set_state_dict(plain, plain_opt, model_state_dict=ref["model"], optim_state_dict=ref["optim"])
    idx = _batch()
    losses = []
    for m, o in ((model, opt), (plain, plain_opt)):
        loss = m(idx).float().logsumexp(-1).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.detach())
    assert torch.isfinite(losses[0])
    torch.testing.assert_close(losses[0], losses[1])
    after = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))[0]
    for k, v in plain.state_dict().items() if torch.distributed.get_rank() == 0 else ():
        torch.testing.assert_close(after[k], v)  # (cpu_offload gathers to rank 0 only)
    loss = model(idx).float().logsumexp(-1).mean()
    assert torch.isfinite(loss)


def _load_worker(rank: int, world_size: int, rdzv: str, cases: list[tuple[str, str]]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    try:
        for ckpt, ref_path in cases:
            model, opt = _build(world_size)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": 0}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            assert state["step"] == 1
            _check_own_file(rank, ckpt, model, opt)
            ref = torch.load(ref_path, weights_only=False)  # trusted: written by the factory
            _compare_full(model, opt, ref)
            _train_step_matches_plain(model, opt, ref)
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("m", TARGETS)
def test_reshard_all_sources_then_load_train_on_m_ranks(sources, tmp_path, m):
    from ckptool.ops.reshard import reshard

    cases = []
    for n, (ckpt, ref) in sources.items():
        out = tmp_path / f"{n}to{m}"
        result = reshard(ckpt, out, world_size=m, expect_from=n)
        assert result.verified and (result.source_world_size, result.world_size) == (n, m)
        assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp"
                                                               for r in range(m)]
        cases.append((str(out), str(ref)))
    _fork(_load_worker, m, cases)


# ---------------------------------------------------------------------------------------------
# Torch-free checks against what DCP itself wrote


def _index(path: Path):
    from ckptool.format.metadata import read_metadata
    from ckptool.storage import Storage

    return read_metadata(Storage.open(path))


@pytest.mark.parametrize("n,m", [(8, 4), (4, 3), (8, 3), (3, 4)])
def test_layout_is_what_dcp_writes_for_m_ranks(sources, tmp_path, n, m):
    """Chunk geometry and chunk -> file of every tensor with dims equal a real M-rank save."""
    from ckptool.ops.reshard import reshard

    reshard(sources[n][0], tmp_path / "out", world_size=m)
    ours, real = _index(tmp_path / "out"), _index(sources[m][0])
    assert ours.tensors.keys() == real.tensors.keys() and ours.objects.keys() == real.objects.keys()
    for fqn, t in real.tensors.items():
        if not t.shape:
            continue  # DCP spreads replicated 0-dim tensors over ranks; ours sit on rank 0
        layout = sorted((c.offsets, c.sizes, c.storage.relative_path) for c in t.chunks)
        assert sorted((c.offsets, c.sizes, c.storage.relative_path)
                      for c in ours.tensors[fqn].chunks) == layout, fqn
    assert ours.planner_data == real.planner_data


def test_same_rank_count_gives_records_identical_to_dcp(sources, tmp_path):
    from ckptool.format.reader import CheckpointReader
    from ckptool.ops.reshard import reshard
    from ckptool.storage import Storage

    src = sources[3][0]
    reshard(src, tmp_path / "out", world_size=3)
    out = Storage.open(tmp_path / "out")
    with CheckpointReader(Storage.open(src)) as a, CheckpointReader(out) as b:
        for fqn, t in a.meta.tensors.items():
            for c, d in zip(t.chunks, b.meta.tensors[fqn].chunks):
                assert (c.offsets, c.sizes) == (d.offsets, d.sizes)
                ra = a.reader(c.storage.relative_path).pread(c.storage.offset, c.storage.length)
                rb = b.reader(d.storage.relative_path).pread(d.storage.offset, d.storage.length)
                assert ra == rb, fqn
        for fqn in a.meta.objects:
            assert a.object_bytes(fqn) == b.object_bytes(fqn)


def test_every_broken_variant_is_refused(sources, tmp_path):
    from factory import VARIANTS, break_checkpoint

    from ckptool.errors import CkptError
    from ckptool.ops.reshard import reshard

    os.environ["CKPTOOL_PWNED"] = str(tmp_path / "pwned")
    for variant in VARIANTS:
        bad = break_checkpoint(sources[3][0], tmp_path / variant / "step_1", variant)
        with pytest.raises(CkptError):
            reshard(bad, tmp_path / variant / "out", world_size=2)
        assert sorted(p.name for p in (tmp_path / variant).iterdir()) == ["step_1"], variant
    assert not (tmp_path / "pwned").exists()

"""Real checkpoints for tests: one rank in-process, N-rank FSDP2 saves on gloo, broken variants.

Nothing here is mocked: ``make_fsdp_checkpoint`` spawns N real processes, shards a small model
with ``fully_shard`` on a CPU mesh, takes one AdamW step and saves with ``dcp.save``. The full
(gathered) model and optimizer state is written beside it with ``torch.save`` as the reference
that exactness tests compare against.

``break_checkpoint(src, dst, variant)`` copies a good checkpoint and damages it in one named way.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

# Sizes chosen so that no first dim divides evenly by 2, 3, 4 or 8 ranks, and 13 rows over 8
# ranks leaves the last rank an empty shard.
VOCAB, D, HIDDEN = 13, 6, 10


def _toy_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(D, HIDDEN)
            self.down = nn.Linear(HIDDEN, D)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, VOCAB, bias=False)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    return Toy()


def _worker(rank: int, world_size: int, out: str, ref: str | None, rdzv: str, seed: int,
            bf16_params: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(seed)
        model = _toy_model()
        if bf16_params:
            model = model.to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (world_size,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randint(0, VOCAB, (4, 5), generator=g)
        loss = model(idx).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=out)
        if ref is not None:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            fm, fo = get_state_dict(model, opt, options=opts)
            if rank == 0:
                torch.save({"model": fm, "optim": fo}, ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_fsdp_checkpoint(out: str | os.PathLike[str], world_size: int, *, ref: str | None = None,
                         seed: int = 0, bf16_params: bool = False) -> Path:
    """Save a real FSDP2 (model + AdamW) checkpoint from ``world_size`` gloo ranks into ``out``.

    If ``ref`` is given, the gathered full state dict ({"model", "optim"}) is ``torch.save``d
    there for comparisons.
    """
    import torch.multiprocessing as mp

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, str(out), ref, f"{tmp}/rdzv", seed, bf16_params),
                 nprocs=world_size, join=True)
    return out


def make_single_checkpoint(out: str | os.PathLike[str], tensors: dict | None = None) -> Path:
    """A one-rank ``dcp.save`` (no process group) of ``{"model": tensors, "step": 3}``."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    if tensors is None:
        g = torch.Generator().manual_seed(0)
        tensors = {"w": torch.randn(5, 3, generator=g), "b": torch.arange(4, dtype=torch.bfloat16),
                   "scale": torch.tensor(2.5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": tensors, "step": 3}, checkpoint_id=str(out))
    return Path(out)


# ---------------------------------------------------------------------------------------------
# Broken variants

class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('CKPTOOL_PWNED', '/tmp/ckptool-pwned')}",))


VARIANTS = ("no-metadata", "missing-shard", "truncated-shard", "chunk-gap", "chunk-overlap",
            "path-traversal", "flipped-byte", "empty-folder", "hostile-pickle", "empty-metadata",
            "truncated-metadata")


def _rewrite_metadata(path: Path, edit) -> None:
    """Load .metadata with torch (trusted: we just wrote it), edit, and pickle it back."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    edit(meta)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _largest_tensor(meta):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = [(k, v) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and len(v.chunks) > 1]
    return max(items, key=lambda kv: kv[1].size.numel())


def break_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str], variant: str) -> Path:
    """Copy checkpoint ``src`` to ``dst`` and damage it in the named way (see ``VARIANTS``)."""
    import torch

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if variant == "no-metadata":
        (dst / ".metadata").unlink()
    elif variant == "missing-shard":
        shards[-1].unlink()
    elif variant == "truncated-shard":
        with open(shards[-1], "r+b") as f:
            f.truncate(shards[-1].stat().st_size // 2)
    elif variant == "flipped-byte":
        # one bit of rot in the middle of the largest chunk's data bytes
        from ckptool.format.reader import CheckpointReader
        from ckptool.storage import Storage

        with CheckpointReader(Storage.open(dst)) as ck:
            t, c = max(((t, c) for t in ck.meta.tensors.values() for c in t.chunks),
                       key=lambda tc: tc[1].numel)
            cb = ck.locate(t, c)
            pos, rel = cb.start + cb.nbytes // 2, c.storage.relative_path
        data = bytearray((dst / rel).read_bytes())
        data[pos] ^= 0x01
        (dst / rel).write_bytes(bytes(data))
    elif variant == "empty-folder":
        shutil.rmtree(dst)
        dst.mkdir()
    elif variant == "hostile-pickle":
        (dst / ".metadata").write_bytes(pickle.dumps(_Evil()))
    elif variant == "empty-metadata":
        (dst / ".metadata").write_bytes(b"")
    elif variant == "truncated-metadata":
        data = (dst / ".metadata").read_bytes()
        (dst / ".metadata").write_bytes(data[: len(data) // 2])
    elif variant == "chunk-gap":
        def drop(meta):
            _, tsm = _largest_tensor(meta)  # drop a non-empty chunk (8 ranks leave empty ones)
            tsm.chunks.remove(max(tsm.chunks, key=lambda c: c.sizes.numel()))
        _rewrite_metadata(dst, drop)
    elif variant == "chunk-overlap":
        def shift(meta):
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

            _, tsm = _largest_tensor(meta)
            c = tsm.chunks[-1]
            offs = list(c.offsets)
            offs[0] -= 1  # now overlaps the previous chunk's last row
            tsm.chunks[-1] = ChunkStorageMetadata(torch.Size(offs), c.sizes)
            # keep the storage entry findable under the new offset
            for k in list(meta.storage_data):
                if k.fqn == _largest_tensor(meta)[0] and tuple(k.offset) == tuple(c.offsets):
                    from torch.distributed.checkpoint.metadata import MetadataIndex

                    meta.storage_data[MetadataIndex(k.fqn, offs)] = meta.storage_data.pop(k)
        _rewrite_metadata(dst, shift)
    elif variant == "path-traversal":
        def escape(meta):
            k = next(iter(meta.storage_data))
            meta.storage_data[k].relative_path = "../../etc/passwd"
        _rewrite_metadata(dst, escape)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return dst

"""Generate a large multi-rank FSDP2-style DCP checkpoint for benchmarks, in little memory.

Each of N gloo ranks builds ONLY its own ``Shard(0)`` pieces (``torch.chunk`` semantics: the
last ranks get a smaller or empty shard) and wraps them with ``DTensor.from_local``; then all
ranks call ``dcp.save``. Memory per rank is its shard, never the full model. The model is a
GPT-style stack with the built-in model's ``state_dict()`` names (``tok_emb.weight``,
``blocks.{i}.attn.qkv.weight``, ...), sized to ``--size-gb`` of fp32 weights (``--d-model``
sets the width; the vocabulary is 50257). Keys are
``model.*``; ``--optimizer`` adds AdamW-like ``optim.state.<name>.exp_avg/exp_avg_sq/step``.

Usage:
    python bench/gen_checkpoint.py OUT --ranks 8 --size-gb 2.2 [--optimizer]

``OUT`` becomes the checkpoint folder (``.metadata`` + ``__<rank>_0.distcp``). Prints one
JSON line describing what was written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

VOCAB = 50257  # odd: no rank count divides it, so shards are uneven
SEQ = 1024


def model_shapes(size_gb: float, d_model: int = 2048) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a GPT-style model with about ``size_gb`` GB of fp32 weights."""
    d, ff = d_model, 4 * d_model
    fixed = (2 * VOCAB * d + SEQ * d + d) * 4
    per_block = (3 * d * d + d * d + 2 * ff * d + 2 * d) * 4
    n_layers = max(1, round((size_gb * 1e9 - fixed) / per_block))
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (VOCAB, d), "pos_emb.weight": (SEQ, d)}
    for i in range(n_layers):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (d,), b + "attn.qkv.weight": (3 * d, d),
                       b + "attn.proj.weight": (d, d), b + "norm2.weight": (d,),
                       b + "mlp.fc.weight": (ff, d), b + "mlp.proj.weight": (d, ff)})
    shapes.update({"norm.weight": (d,), "head.weight": (VOCAB, d)})
    return shapes


def local_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s piece under ``torch.chunk(n, world)``."""
    step = math.ceil(n / world) if n else 0
    start = min(rank * step, n)
    return start, max(0, min(step, n - start))


def _worker(rank: int, world: int, out: str, size_gb: float, d_model: int, optimizer: bool,
            rdzv: str, seed: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(seed * 1000 + rank)

        def shard(shape: tuple[int, ...], fill: str) -> DTensor:
            _, rows = local_rows(shape[0], rank, world)
            local_shape = (rows, *shape[1:])
            local = (torch.randn(local_shape, generator=g) * 0.02 if fill == "randn"
                     else torch.full(local_shape, 1.0) if fill == "ones"
                     else torch.rand(local_shape, generator=g) * 1e-4)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                      shape=torch.Size(shape), stride=stride)

        shapes = model_shapes(size_gb, d_model)
        model = {k: shard(s, "ones" if "norm" in k else "randn") for k, s in shapes.items()}
        state: dict[str, object] = {"model": model}
        if optimizer:
            state["optim"] = {"state": {k: {"exp_avg": shard(s, "randn"), "exp_avg_sq": shard(s, "rand"),
                                            "step": torch.tensor(1000.0)} for k, s in shapes.items()}}
        dcp.save(state, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="checkpoint folder to create (must not exist)")
    ap.add_argument("--ranks", type=int, default=8, help="gloo ranks that save (default 8)")
    ap.add_argument("--size-gb", type=float, default=2.2, help="fp32 model weights, GB (1e9)")
    ap.add_argument("--optimizer", action="store_true", help="also save AdamW-like optim.state.*")
    ap.add_argument("--d-model", type=int, default=2048, help="width (default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if os.path.exists(args.out):
        ap.error(f"{args.out} exists; pass a new folder")
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.ranks, args.out, args.size_gb, args.d_model, args.optimizer,
                                f"{tmp}/rdzv", args.seed), nprocs=args.ranks, join=True)
    shapes = model_shapes(args.size_gb, args.d_model)
    model_bytes = sum(math.prod(s) * 4 for s in shapes.values())
    disk = sum(e.stat().st_size for e in os.scandir(args.out))
    print(json.dumps({"out": args.out, "ranks": args.ranks, "tensors": len(shapes),
                      "model_bytes": model_bytes, "largest_tensor_bytes":
                      max(math.prod(s) * 4 for s in shapes.values()), "disk_bytes": disk,
                      "optimizer": args.optimizer, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()

"""Benchmark ``ckptool reshard --to M`` against ``cp -r`` and DCP load-time resharding.

The only other route a user has is loading the checkpoint on M ranks with DCP (which
reshards at load time) and saving it again; ``--dcp-route`` is that route, done as cheaply as
it can be: M spawned gloo ranks build empty ``Shard(0)`` DTensors of every saved tensor (no
model, no optimizer objects), ``dcp.load`` then ``dcp.save``.

Same rules as ``bench/consolidate_bench.py``: every run is a fresh subprocess, wall time from
the parent's clock ("wall + sync" adds an ``os.sync()`` after it, charging tools that do not
flush), peak RSS from ``os.wait4`` (the largest single process; for the DCP route the sum over
its ranks is reported too). ``--cache both`` (the default) measures with the page cache
dropped before every run (``sync; echo 3 > /proc/sys/vm/drop_caches``; needs root, else the
table says "warm") and with the source already cached, runs interleaved across tools and
modes (``bench/_runs.py``); medians of ``--runs`` (default 5) against issue 15's targets.

Usage:
    python bench/gen_checkpoint.py /tmp/rsbench/step_1000 --ranks 8 --size-gb 2.2
    python bench/reshard_bench.py /tmp/rsbench/step_1000 --to 4 --markdown docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import mem_gib, record_rss, spawn_ranks, write_section  # noqa: E402
from _runs import (ORDER_NOTE, Results, add_run_options, loads_text, measure,  # noqa: E402
                   mode_sections, modes_of, peer_runs, select, skip_peers)

SECTION = "## reshard"


def tools(ckpt: Path, work: Path, m: int) -> dict[str, tuple[list[str], Path]]:
    """Name -> (command, output path to delete afterwards)."""
    py = sys.executable
    return {
        "cp -r": (["cp", "-r", str(ckpt), str(work / "cp")], work / "cp"),
        f"ckptool reshard --to {m}": (["ckptool", "reshard", str(ckpt), str(work / "r"),
                                       "--to", str(m)], work / "r"),
        f"ckptool reshard --to {m} --no-verify": (
            ["ckptool", "reshard", str(ckpt), str(work / "n"), "--to", str(m), "--no-verify"],
            work / "n"),
        f"DCP load + save on {m} gloo ranks": (
            [py, __file__, "--dcp-route", str(ckpt), str(work / "d"), "--to", str(m)], work / "d"),
    }


# ---------------------------------------------------------------------------------------------
# The DCP route (run as a subprocess of the benchmark)


def _dcp_rank(rank: int, m: int, src: str, dst: str, rdzv: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=m)
    try:
        mesh = init_device_mesh("cpu", (m,))
        meta = dcp.FileSystemReader(src).read_metadata()  # trusted: our own benchmark input
        state: dict[str, object] = {}
        for fqn, md in meta.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                state[fqn] = None  # replaced by the loaded value
                continue
            shape, dtype = tuple(md.size), md.properties.dtype
            if not shape:
                state[fqn] = torch.empty((), dtype=dtype)
                continue
            per = -(-shape[0] // m)
            lo = min(rank * per, shape[0])
            local = torch.empty((min(per, shape[0] - lo), *shape[1:]), dtype=dtype)
            stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
            state[fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size(shape), stride=stride)
        dcp.load(state, checkpoint_id=src)
        dcp.save(state, checkpoint_id=dst)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        record_rss(out, rank)


def dcp_route(src: str, dst: str, m: int) -> None:
    spawn_ranks(_dcp_rank, m, src, dst)


# ---------------------------------------------------------------------------------------------
# Measuring






def describe(ckpt: Path, m: int) -> dict[str, object]:
    from ckptool.format.fsdp_layout import fsdp_chunks
    from ckptool.format.metadata import read_metadata
    from ckptool.storage import Storage

    meta = read_metadata(Storage.open(ckpt))
    ts = meta.tensors.values()
    chunk_src = max(c.numel * t.dtype.itemsize for t in ts for c in t.chunks)
    chunk_out = max(c.numel * t.dtype.itemsize for t in ts for _, c in fsdp_chunks(t.shape, m))
    return {"world_size": meta.world_size, "to": m, "tensors": len(meta.tensors),
            "objects": len(meta.objects), "tensor_bytes": sum(t.nbytes for t in ts),
            "largest": max(t.nbytes for t in ts), "chunk_src": chunk_src, "chunk_out": chunk_out,
            "disk_bytes": sum(e.stat().st_size for e in os.scandir(ckpt))}


def render(results: Results, info: dict[str, object]) -> str:
    lines = [f"{SECTION}\n",
             f"Checkpoint: {info['world_size']}-rank FSDP2-style DCP (`bench/gen_checkpoint.py`), "
             f"{info['tensors']} tensors, {info['tensor_bytes'] / 1e9:.2f} GB of tensor data, "
             f"{info['disk_bytes'] / 1e9:.2f} GB on disk; resharded to {info['to']} ranks. "
             f"Largest tensor: {info['largest'] / 2**20:.0f} MiB; largest chunk: "
             f"{info['chunk_src'] / 2**20:.0f} MiB in the source, "
             f"{info['chunk_out'] / 2**20:.0f} MiB in the output. Machine: {info['machine']}. "
             f"{info['runs']} runs per tool and page-cache mode (DCP's way: "
             f"{info.get('peer_runs', info['runs'])}), interleaved across tools and modes "
             f"({ORDER_NOTE}); min / **median** / max. 1-minute load average before the runs "
             f"(other jobs on the machine): {loads_text(results)}.\n"]
    lines += mode_sections(results, dropped=info["dropped"], largest=info["largest"],
                           versus=("DCP", f"ckptool reshard --to {info['to']}",
                                   "DCP load + save vs `ckptool reshard`"))
    lines += [f"Commands: `{info['gen']}` then `{info['bench']}`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?")
    ap.add_argument("--to", type=int, default=4, help="target rank count (default 4)")
    add_run_options(ap, work="/tmp/ckptool-reshard-bench")
    ap.add_argument("--dcp-route", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dcp_route:
        return dcp_route(*args.dcp_route, args.to)
    if args.checkpoint is None:
        ap.error("CHECKPOINT is required")
    args.work.mkdir(parents=True, exist_ok=True)
    selected = select(tools(args.checkpoint, args.work, args.to), args.only)
    n_peer = peer_runs(args)
    results, dropped = measure(selected, args.checkpoint, runs=args.runs,
                               modes=modes_of(args.cache), skip=skip_peers(n_peer))
    info = {**describe(args.checkpoint, args.to), "runs": args.runs, "peer_runs": n_peer,
            "dropped": dropped,
            "machine": f"{os.cpu_count()} CPUs, {mem_gib():.0f} GiB RAM, Linux "
                       f"{platform.release()}, Python {platform.python_version()}"}
    info["gen"] = (f"python bench/gen_checkpoint.py {args.checkpoint} --ranks {info['world_size']} "
                   f"--size-gb {info['tensor_bytes'] / 1e9:.1f}")
    info["bench"] = (f"python bench/reshard_bench.py {args.checkpoint} --to {args.to} "
                     f"--runs {args.runs} --peer-runs {n_peer} --cache {args.cache}")
    text = render(results, info)
    print(text)
    (args.work / "results.json").write_text(json.dumps({"results": results, "info": info},
                                                       indent=1))
    if args.markdown:
        write_section(args.markdown, SECTION, text)


if __name__ == "__main__":
    main()

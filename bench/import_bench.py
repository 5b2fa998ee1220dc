"""Benchmark ``ckptool import --ranks M`` against ``cp -r`` and the peers' way.

The source is a Hugging Face folder of sharded safetensors with Llama shapes (TinyLlama-like:
hidden 2048, MLP 5632, 32 heads, 4 KV heads, vocab 32000, untied head), random values,
written by ``--gen``. The peers' way is what a training script does without ckptool:
transformers ``from_pretrained`` on rank 0 (fp32), a meta-device model on the others,
``fully_shard`` on M gloo ranks, ``set_model_state_dict(..., broadcast_from_rank0=True)``
(Accelerate's ``cpu_ram_efficient_loading``), then ``dcp.save``.

Same rules as ``bench/reshard_bench.py``: every run a fresh subprocess, wall time from the
parent's clock ("wall + sync" adds an ``os.sync()``), peak RSS from ``os.wait4`` (the largest
process; for the multi-rank route the sum over ranks too), ``--cache both`` (the default):
page cache dropped before every run (root) and source cached, runs interleaved across tools
and modes (``bench/_runs.py``), medians of ``--runs`` (default 5) against issue 15's targets,
1-minute load average recorded.

Usage:
    python bench/import_bench.py --gen /tmp/impbench/bf16 --dtype bfloat16 --layers 22
    python bench/import_bench.py /tmp/impbench/bf16 --to 8 --markdown docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import mem_gib, record_rss, spawn_ranks, write_section  # noqa: E402
from _runs import (ORDER_NOTE, Results, add_run_options, loads_text, measure,  # noqa: E402
                   mode_sections, modes_of, peer_runs, select, skip_peers)

SECTION = "## import"
SHAPES = {"hidden": 2048, "ff": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000}


# ---------------------------------------------------------------------------------------------
# The source folder


def generate(out: Path, dtype: str, layers: int, shard_gb: float = 1.0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    h, ff, v = SHAPES["hidden"], SHAPES["ff"], SHAPES["vocab"]
    kv = h // SHAPES["heads"] * SHAPES["kv_heads"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    out.mkdir(parents=True)
    td = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    groups, cur, size = [], {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel() * td.itemsize
        if cur and size + n > shard_gb * 1e9:
            groups.append(cur)
            cur, size = {}, 0
        cur[name], size = shape, size + n
    groups.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=g) * 0.02).to(td) for k, s in group.items()}
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=ff, num_hidden_layers=layers,
                num_attention_heads=SHAPES["heads"], num_key_value_heads=SHAPES["kv_heads"],
                tie_word_embeddings=False, dtype=dtype).save_pretrained(out)
    Path(f"{out}.gen").write_text(f"python bench/import_bench.py --gen {out} --dtype {dtype} "
                                  f"--layers {layers}")
    print(f"wrote {out}: {len(shapes)} tensors, {total / 1e9:.2f} GB, {len(groups)} shards")


# ---------------------------------------------------------------------------------------------
# The peers' way (run as a subprocess of the benchmark)


def _peer_rank(rank: int, m: int, src: str, dst: str, rdzv: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=m)
    try:
        mesh = init_device_mesh("cpu", (m,))
        full = {}
        if rank == 0:
            full = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
        with torch.device("meta"):
            model = LlamaForCausalLM(AutoConfig.from_pretrained(src))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
        del full
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dst)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        record_rss(out, rank)


def peer_route(src: str, dst: str, m: int) -> None:
    spawn_ranks(_peer_rank, m, src, dst)


# ---------------------------------------------------------------------------------------------
# Measuring


#: ``cp -r`` of a float32 import's output: the bytes the cast import writes, copied.
CP32 = "cp -r (float32 output)"


def tools(src: Path, work: Path, m: int, peer_ranks: int) -> dict[str, tuple[list[str], Path]]:
    py = sys.executable
    return {
        "cp -r": (["cp", "-r", str(src), str(work / "cp")], work / "cp"),
        CP32: (["cp", "-r", str(work / "fp32-ref"), str(work / "cp32")], work / "cp32"),
        f"ckptool import --ranks {m}": (["ckptool", "import", str(src), str(work / "i"),
                                         "--ranks", str(m)], work / "i"),
        f"ckptool import --ranks {m} --dtype keep": (
            ["ckptool", "import", str(src), str(work / "k"), "--ranks", str(m), "--dtype", "keep"],
            work / "k"),
        f"ckptool import --ranks {m} --no-verify": (
            ["ckptool", "import", str(src), str(work / "n"), "--ranks", str(m), "--no-verify"],
            work / "n"),
        f"from_pretrained + fully_shard + dcp.save on {peer_ranks} gloo ranks": (
            [py, __file__, "--peer-route", str(src), str(work / "p"), "--to", str(peer_ranks)],
            work / "p"),
    }


def float32_reference(src: Path, out: Path, m: int) -> None:
    """The float32 import of ``src`` for ``m`` ranks, made once per source and rank count
    (``cp -r``'d by ``CP32``); ``out.made-from`` says which."""
    import subprocess

    stamp, made_from = out.with_name(out.name + ".made-from"), f"{src.resolve()} {m}"
    if (out / ".metadata").exists() and stamp.exists() and stamp.read_text() == made_from:
        return
    if out.exists():
        shutil.rmtree(out)
    subprocess.run(["ckptool", "import", str(src), str(out), "--ranks", str(m)], check=True,
                   stdout=subprocess.DEVNULL)
    stamp.write_text(made_from)


def describe(src: Path) -> dict[str, object]:
    from ckptool.format.hf_source import open_source

    s = open_source(src)
    largest = max(t.nbytes for t in s.tensors.values())
    dtypes = sorted({t.dtype.name for t in s.tensors.values()})
    return {"tensors": len(s.tensors), "bytes": s.nbytes, "files": len(s.files), "dtypes": dtypes,
            "largest": largest, "largest_fp32": largest * 4 // s.tensors[
                max(s.tensors, key=lambda k: s.tensors[k].nbytes)].dtype.itemsize,
            "disk_bytes": sum(e.stat().st_size for e in os.scandir(src))}


def render(results: Results, info: dict) -> str:
    lines = [f"Source: Hugging Face folder (`bench/import_bench.py --gen`), {info['tensors']} "
             f"{'/'.join(info['dtypes'])} tensors in {info['files']} safetensors shards, "
             f"{info['bytes'] / 1e9:.2f} GB; imported for {info['to']} ranks (default: cast to "
             f"float32). Largest tensor: {info['largest'] / 2**20:.0f} MiB in the source, "
             f"{info['largest_fp32'] / 2**20:.0f} MiB as float32. Machine: {info['machine']}. "
             f"{info['runs']} runs per tool and page-cache mode (the peers' way: "
             f"{info['peer_runs']}), interleaved across tools and modes ({ORDER_NOTE}); "
             "min / **median** / max. "
             "1-minute load average before the runs (other jobs on the machine): "
             f"{loads_text(results)}. A cast to float32 writes more bytes than it reads: its "
             f"target is against `{CP32}`, a copy of the float32 output of one import made "
             "before the runs (the same bytes written), and its ratio to `cp -r` of the source "
             "is given for information.\n"]
    lines += mode_sections(results, dropped=info["dropped"], largest=info["largest"],
                           versus=("from_pretrained", f"ckptool import --ranks {info['to']}",
                                   "the peers' way vs `ckptool import`"),
                           baselines=info["baselines"])
    lines += [f"Commands: `{info['gen']}` then `{info['bench']}`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, nargs="?")
    ap.add_argument("--to", type=int, default=8, help="rank count of the output (default 8)")
    ap.add_argument("--peer-ranks", type=int, default=None, help="ranks of the peers' way "
                    "(default: --to)")
    add_run_options(ap, work="/tmp/ckptool-import-bench")
    ap.add_argument("--section", default=None, help="markdown heading (default: '## import')")
    ap.add_argument("--gen", type=Path, help="write a source folder here and exit")
    ap.add_argument("--dtype", default="bfloat16", help="--gen: dtype of the tensors")
    ap.add_argument("--layers", type=int, default=22, help="--gen: decoder layers")
    ap.add_argument("--peer-route", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gen:
        return generate(args.gen, args.dtype, args.layers)
    if args.peer_route:
        return peer_route(*args.peer_route, args.to)
    if args.source is None:
        ap.error("SOURCE is required")
    args.work.mkdir(parents=True, exist_ok=True)
    peer_ranks = args.peer_ranks or args.to
    selected = select(tools(args.source, args.work, args.to, peer_ranks), args.only)
    cast = f"ckptool import --ranks {args.to}"
    if CP32 in selected:
        float32_reference(args.source, args.work / "fp32-ref", args.to)
    n_peer = peer_runs(args)
    results, dropped = measure(selected, args.source, runs=args.runs, modes=modes_of(args.cache),
                               skip=skip_peers(n_peer), sources={CP32: args.work / "fp32-ref"})
    section = args.section or SECTION
    info = {**describe(args.source), "to": args.to, "runs": args.runs, "peer_runs": n_peer,
            "baselines": {cast: CP32, f"{cast} --no-verify": CP32},  # the casts
            "dropped": dropped,
            "machine": f"{os.cpu_count()} CPUs, {mem_gib():.0f} GiB RAM, Linux "
                       f"{platform.release()}, Python {platform.python_version()}"}
    gen = Path(f"{args.source}.gen")
    info["gen"] = gen.read_text() if gen.exists() else "(source not made by --gen)"
    info["bench"] = (f"python bench/import_bench.py {args.source} --to {args.to} --peer-ranks "
                     f"{peer_ranks} --runs {args.runs} --peer-runs {n_peer} "
                     f"--cache {args.cache}")
    text = f"{section}\n\n" + render(results, info)
    print(text)
    (args.work / "results.json").write_text(json.dumps({"results": results, "info": info},
                                                       indent=1))
    if args.markdown:
        write_section(args.markdown, section, text)


if __name__ == "__main__":
    main()

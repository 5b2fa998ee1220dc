"""Benchmark loading a pretrained Hugging Face model into FSDP2: ``ckptool train --hf-model``'s
way against the peers' way, peak RSS per rank.

ckptool (``ckptool/train/hf_model.py``): the model is built on the meta device, every decoder
layer and the root ``fully_shard``-ed, ``to_empty`` allocates this rank's shards only, and each
rank reads its own ``torch.chunk`` rows from the safetensors byte ranges (8 MiB at a time).
The peers' way: ``AutoModelForCausalLM.from_pretrained`` (fp32) on every rank, then
``fully_shard`` on every layer and the root.

The source is a Llama-shaped folder of random fp32 weights written by ``--gen`` (default
~166 M parameters, ~665 MB: hidden 1024, MLP 2816, 8 layers, vocab 32000, untied head). Every
run is a fresh set of gloo ranks; a rank reports its RSS after imports (baseline), its peak RSS
(``ru_maxrss``) once the model is sharded and loaded, the bytes of its shards and of one
full decoder layer. Target: peak - baseline <= shard + one layer + 256 MiB.

Usage:
    python bench/hf_load_bench.py --gen /tmp/hfbench/llama
    python bench/hf_load_bench.py /tmp/hfbench/llama --ranks 2 4 --runs 2 --markdown docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import mem_gib, write_section  # noqa: E402

SECTION = "## train --hf-model: loading pretrained weights into FSDP2"
MIB = 1 << 20


def generate(out: Path, hidden: int, ff: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, max_shard_size="10GB")
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n:,} parameters, {n * 4 / 1e6:.0f} MB fp32")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, ws: int, route: str, folder: str, rdzv: str, results: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ckptool.train import hf_model, parallel
    from ckptool.train.config import TrainConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=ws)
    mesh = parallel.build_mesh("full", ws, "cpu")
    base = _rss()
    if route == "ckptool":
        source = hf_model.resolve(folder)
        config = hf_model.load_config(source)
        cfg = TrainConfig(out="unused", hf_model=folder, seq_len=16)
        model = hf_model.build(config, cfg, mesh, torch.device("cpu"), "fp32")
        hf_model.load_weights(model, source.weights, tied_head=hf_model.tied_head(config, model))
        layers = [m for _, m in hf_model.decoder_layers(model)]
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        layers = [m for _, m in hf_model.decoder_layers(model)]
        for i, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh, reshard_after_forward=i < len(layers) - 1)
        fully_shard(model, mesh=mesh)
    import gc

    gc.collect()
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in layers[0].parameters())
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "base": base, "peak": peak, "end": _rss(), "shard": shard, "layer": layer}, f)
    dist.destroy_process_group()


def run_route(route: str, folder: str, ranks: int) -> list[dict]:
    """One fresh set of ranks (this script again, so nothing is inherited); their reports."""
    with tempfile.TemporaryDirectory(prefix="hfbench-") as tmp:
        subprocess.run([sys.executable, __file__, "--rank-run", route, folder, "--ranks", str(ranks), "--tmp", tmp],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(ranks)]


def _spawn(route: str, folder: str, ranks: int, tmp: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(ranks, route, folder, os.path.join(tmp, "rdzv"), tmp), nprocs=ranks,
                       start_method="spawn")


def _mib(x: float) -> str:
    return f"{x / MIB:,.0f}"


def report(folder: str, rows: list[tuple[int, str, list[list[dict]]]]) -> str:
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    lines = [SECTION, "",
             f"Source: a Llama-shaped folder of random fp32 weights, {size / 1e6:,.0f} MB of safetensors "
             f"(`bench/hf_load_bench.py --gen`). Machine: {os.cpu_count()} cores, {mem_gib():.0f} GiB, "
             f"{platform.machine()}, 1 thread per rank, gloo. Per rank: RSS after imports (baseline), peak "
             "RSS once sharded and loaded (`ru_maxrss`), its shard and one full decoder layer (fp32). "
             "Median over runs of the largest rank's figures. Target: peak - baseline <= shard + one "
             "layer + 256 MiB.", "",
             "| ranks | route | baseline MiB | peak MiB | peak - baseline MiB | shard MiB | one layer MiB | "
             "target MiB | met |", "|---|---|---|---|---|---|---|---|---|"]
    for ranks, route, runs in rows:
        worst = [max(run, key=lambda r: r["peak"] - r["base"]) for run in runs]
        med = {k: statistics.median(w[k] for w in worst) for k in ("base", "peak", "shard", "layer")}
        grow = med["peak"] - med["base"]
        target = med["shard"] + med["layer"] + 256 * MIB
        lines.append(f"| {ranks} | {route} | {_mib(med['base'])} | {_mib(med['peak'])} | {_mib(grow)} | "
                     f"{_mib(med['shard'])} | {_mib(med['layer'])} | {_mib(target)} | "
                     f"{'yes' if grow <= target else '**no**'} |")
    lines += ["", "Command: `python bench/hf_load_bench.py " + folder + " --ranks "
              + " ".join(sorted({str(r) for r, _, _ in rows})) + f" --runs {len(rows[0][2])}`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--gen", action="store_true", help="write the source folder and exit")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--rank-run", choices=["ckptool", "peers"])
    ap.add_argument("--tmp")
    a = ap.parse_args()
    if a.gen:
        generate(Path(a.folder), a.hidden, a.ff, a.layers, a.vocab)
        return
    if a.rank_run:
        _spawn(a.rank_run, a.folder, a.ranks[0], a.tmp)
        return
    rows = []
    for ranks in a.ranks:
        runs: dict[str, list[list[dict]]] = {"ckptool": [], "peers": []}
        for _ in range(a.runs):  # routes interleaved
            for route in runs:
                runs[route].append(run_route(route, a.folder, ranks))
                print(ranks, route, json.dumps(runs[route][-1]), flush=True)
        rows += [(ranks, route, rs) for route, rs in runs.items()]
    text = report(a.folder, rows)
    print(text)
    if a.markdown:
        write_section(a.markdown, SECTION, text)


if __name__ == "__main__":
    main()

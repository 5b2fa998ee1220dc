"""Benchmark ``ckptool consolidate`` against ``cp -r``, ``accelerate merge-weights`` and torch's
``dcp_to_torch_save`` on one multi-rank checkpoint, cold and/or warm page cache, N runs each.

Every run is a fresh subprocess; its peak RSS comes from ``os.wait4`` (the child and anything
it waited for), its wall time from the parent's clock. "wall+sync" adds an ``os.sync()`` after
the command so tools that do not flush their output (cp, accelerate, torch.save) are charged
for it too (ckptool fsyncs its output before renaming it). Runs are interleaved across tools
so background load drifts evenly. ``--cache cold``: the page cache is dropped before every run
(``sync; echo 3 > /proc/sys/vm/drop_caches``; needs root, else the table says so);
``--cache warm``: the source is read into the page cache before every run; ``both`` (default)
alternates the two modes run by run and gives one table each.

Usage:
    python bench/gen_checkpoint.py /tmp/bench/step_1000 --ranks 8 --size-gb 2.2
    python bench/consolidate_bench.py /tmp/bench/step_1000 --runs 5 --markdown docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import check, drop_caches, fmt, mem_gib, run_once, write_section  # noqa: E402

SECTION = "## consolidate"


def tools(ckpt: Path, work: Path) -> dict[str, tuple[list[str], Path]]:
    """Name -> (command, output path to delete afterwards)."""
    py = sys.executable
    return {
        "cp -r": (["cp", "-r", str(ckpt), str(work / "cp")], work / "cp"),
        "ckptool consolidate": (["ckptool", "consolidate", str(ckpt), str(work / "c.safetensors")],
                                work / "c.safetensors"),
        "ckptool consolidate --no-crc-check": (
            ["ckptool", "consolidate", str(ckpt), str(work / "n.safetensors"), "--no-crc-check"],
            work / "n.safetensors"),
        "ckptool consolidate --dtype bfloat16": (
            ["ckptool", "consolidate", str(ckpt), str(work / "b.safetensors"), "--dtype", "bfloat16"],
            work / "b.safetensors"),
        "accelerate merge-weights": (["accelerate", "merge-weights", str(ckpt), str(work / "acc")],
                                     work / "acc"),
        "dcp_to_torch_save": ([py, "-m", "torch.distributed.checkpoint.format_utils",
                               "dcp_to_torch", str(ckpt), str(work / "t.pt")], work / "t.pt"),
        "python -c 'import torch'": ([py, "-c", "import torch"], work / "none"),
    }


def largest_tensor(ckpt: Path) -> tuple[int, int, int, int]:
    """(largest model tensor bytes, model bytes, tensors, world size) from the index."""
    from ckptool.format.metadata import read_metadata
    from ckptool.format.state_layout import read_layout
    from ckptool.storage import Storage

    meta = read_metadata(Storage.open(ckpt))
    sizes = [meta.tensors[k].nbytes for k in read_layout(meta).names]
    return max(sizes), sum(sizes), len(sizes), meta.world_size or 0


def render(results: dict[str, dict[str, list[dict[str, float]]]], info: dict[str, object]) -> str:
    """One table and target list per page-cache mode."""
    lines = [f"{SECTION}\n",
             f"Checkpoint: {info['world_size']}-rank FSDP2-style DCP (`bench/gen_checkpoint.py`), "
             f"{info['tensors']} model tensors, {info['model_bytes'] / 1e9:.2f} GB of fp32 weights ("
             f"{info['disk_bytes'] / 1e9:.2f} GB on disk), largest tensor {info['largest'] / 2**20:.0f} MiB. "
             f"Machine: {info['machine']}. {info['runs']} runs per tool and page-cache mode, "
             "interleaved; min / **median** / max.\n"]
    for mode, res in results.items():
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall", "wall_sync", "rss_mib")}
               for k, v in res.items()}
        lines += [f"Page cache: {info['cache'][mode]}.\n",  # type: ignore[index]
                  "| tool | wall (s) | wall + sync (s) | peak RSS (MiB) |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {fmt([r['wall'] for r in runs])} | "
                  f"{fmt([r['wall_sync'] for r in runs])} | {fmt([r['rss_mib'] for r in runs], 0)} |"
                  for name, runs in res.items()]
        lines += ["", f"Targets ({mode} cache, medians):", ""] + targets(med, info) + [""]
    lines += ["`ckptool consolidate` fsyncs its output before renaming it into place, so a crash "
              "never leaves a complete-looking file with missing data; `cp`, `accelerate` and "
              "`torch.save` leave their writes in the page cache. \"wall + sync\" charges every "
              "tool for the flush. By default ckptool also checks every record's CRC-32 (a second "
              "read of each source file, in a thread beside the in-kernel copy); "
              "`--no-crc-check` skips it. `--dtype` needs the bytes in Python (numpy cast).", ""]
    lines += [f"Commands: `{info['gen']}` then `{info['bench']}`.", ""]
    return "\n".join(lines)


def targets(med: dict[str, dict[str, float]], info: dict[str, object]) -> list[str]:
    c, cp, acc = med.get("ckptool consolidate"), med.get("cp -r"), med.get("accelerate merge-weights")
    if c is None:
        return []
    out = []
    rss_limit = info["largest"] / 2**20 + 64  # type: ignore[operator]
    out.append(check("peak RSS <= largest tensor + 64 MiB", c["rss_mib"], "<=", rss_limit,
                      f"{c['rss_mib']:.0f} MiB vs {rss_limit:.0f} MiB"))
    if cp:
        r = c["wall_sync"] / cp["wall_sync"]
        out.append(check("wall + sync <= 1.15x `cp -r` + sync", r, "<=", 1.15, f"{r:.2f}x"))
    if acc:
        for m, label in (("wall", "wall"), ("wall_sync", "wall + sync")):
            r = acc[m] / c[m]
            out.append(check(f"{label} >= 5x faster than `accelerate merge-weights`", r, ">=", 5,
                              f"{r:.1f}x"))
        r = acc["rss_mib"] / c["rss_mib"]
        out.append(check(">= 20x less RAM than `accelerate merge-weights`", r, ">=", 20, f"{r:.0f}x"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cache", choices=["cold", "warm", "both"], default="both",
                    help="drop the page cache before every run, read the source into it, or both")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckptool-consolidate-bench"))
    ap.add_argument("--only", action="append", help="run only these tools (repeatable)")
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section")
    ap.add_argument("--render-only", action="store_true",
                    help="do not run anything: render WORK/results.json of an earlier run")
    args = ap.parse_args()
    if args.render_only:
        saved = json.loads((args.work / "results.json").read_text())
        results, info = saved["results"], saved["info"]
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        selected = {k: v for k, v in tools(args.checkpoint, args.work).items()
                    if not args.only or k in args.only}
        modes = ["cold", "warm"] if args.cache == "both" else [args.cache]
        load0 = os.getloadavg()[1]
        results, cold = run_all(selected, args.runs, modes, args.checkpoint)
        info = describe(args.checkpoint, args.runs, cold, load0, args.cache)
        (args.work / "results.json").write_text(json.dumps({"results": results, "info": info}, indent=1))
    text = render(results, info)
    print(text)
    if args.markdown:
        write_section(args.markdown, SECTION, text)


def run_all(selected: dict[str, tuple[list[str], Path]], runs: int, modes: list[str],
            ckpt: Path) -> tuple[dict, bool]:
    """Every tool ``runs`` times per cache mode, interleaved (run i: each mode, each tool)."""
    results: dict[str, dict[str, list[dict[str, float]]]] = {m: {k: [] for k in selected}
                                                            for m in modes}
    cold = True
    for i in range(runs):
        for mode in modes:
            for name, (cmd, out) in selected.items():
                if mode == "cold":
                    cold &= drop_caches()
                else:
                    warm_up(ckpt)
                r = run_once(cmd)
                results[mode][name].append(r)
                print(f"run {i + 1} {mode} {name}: "
                      f"{json.dumps({k: round(v, 3) for k, v in r.items()})}", flush=True)
                if out.is_dir():
                    shutil.rmtree(out)
                else:
                    out.unlink(missing_ok=True)
    return results, cold


def warm_up(ckpt: Path) -> None:
    """Read every file of the checkpoint, so it is in the page cache."""
    for e in os.scandir(ckpt):
        with open(e.path, "rb") as f:
            while f.read(16 << 20):
                pass


def describe(ckpt: Path, runs: int, cold: bool, load0: float, cache: str) -> dict[str, object]:
    largest, model_bytes, n, ws = largest_tensor(ckpt)
    return {
        "largest": largest, "model_bytes": model_bytes, "tensors": n, "world_size": ws,
        "disk_bytes": sum(e.stat().st_size for e in os.scandir(ckpt)), "runs": runs,
        "cache": {"cold": "dropped before every run" if cold else "NOT dropped (not root)",
                  "warm": "the source read into it before every run"},
        "machine": f"{os.cpu_count()} CPUs, {mem_gib():.0f} GiB RAM, Linux {platform.release()}, "
                   f"Python {platform.python_version()}; 5-min load average {load0:.1f} at start, "
                   f"{os.getloadavg()[1]:.1f} at end (other jobs share the machine)",
        "gen": f"python bench/gen_checkpoint.py {ckpt} --ranks {ws} --size-gb {model_bytes / 1e9:.1f}",
        "bench": f"python bench/consolidate_bench.py {ckpt} --runs {runs} --cache {cache}",
    }


if __name__ == "__main__":
    main()

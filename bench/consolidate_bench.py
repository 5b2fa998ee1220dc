"""Benchmark ``ckptool consolidate`` against ``cp -r``, ``accelerate merge-weights`` and torch's
``dcp_to_torch_save`` on one multi-rank checkpoint, cold and/or warm page cache, N runs each.

Every run is a fresh subprocess; its peak RSS comes from ``os.wait4`` (the child and anything
it waited for), its wall time from the parent's clock. "wall+sync" adds an ``os.sync()`` after
the command so tools that do not flush their output (cp, accelerate, torch.save) are charged
for it too (ckptool fsyncs its output before renaming it). Runs are interleaved across tools
so background load drifts evenly. ``--cache cold``: the page cache is dropped before every run
(``sync; echo 3 > /proc/sys/vm/drop_caches``; needs root, else the table says so);
``--cache warm``: the source is read into the page cache before every run; ``both`` (default)
alternates the two modes run by run and gives one table each (``bench/_runs.py``).

Usage:
    python bench/gen_checkpoint.py /tmp/bench/step_1000 --ranks 8 --size-gb 2.2
    python bench/consolidate_bench.py /tmp/bench/step_1000 --runs 5 --markdown docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import check, fmt, mem_gib, write_section  # noqa: E402
from _runs import (ORDER_NOTE, add_run_options, measure, medians, mode_label,  # noqa: E402
                   modes_of, peer_runs, select, skip_peers, targets)

SECTION = "## consolidate"


def tools(ckpt: Path, work: Path) -> dict[str, tuple[list[str], Path]]:
    """Name -> (command, output folder to delete before and after each run: a tool that writes
    one file writes it in its own folder, made by the command, since ``_runs.measure`` removes
    folders)."""
    py, src = sys.executable, str(ckpt)

    def in_folder(name: str, cmd: list[str]) -> tuple[list[str], Path]:
        return ["sh", "-c", 'mkdir -p "$0" && exec "$@"', str(work / name), *cmd], work / name

    return {
        "cp -r": (["cp", "-r", src, str(work / "cp")], work / "cp"),
        "ckptool consolidate": in_folder("c", ["ckptool", "consolidate", src, f"{work}/c/m.safetensors"]),
        "ckptool consolidate --no-crc-check": in_folder(
            "n", ["ckptool", "consolidate", src, f"{work}/n/m.safetensors", "--no-crc-check"]),
        "ckptool consolidate --dtype bfloat16": in_folder(
            "b", ["ckptool", "consolidate", src, f"{work}/b/m.safetensors", "--dtype", "bfloat16"]),
        "accelerate merge-weights": (["accelerate", "merge-weights", src, str(work / "acc")],
                                     work / "acc"),
        "dcp_to_torch_save": in_folder("t", [py, "-m", "torch.distributed.checkpoint.format_utils",
                                             "dcp_to_torch", src, f"{work}/t/t.pt"]),
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
             f"Machine: {info['machine']}. {info['runs']} runs per tool and page-cache mode "
             f"(the other tools' ways: {info.get('peer_runs', info['runs'])}), interleaved "
             f"({ORDER_NOTE}); min / **median** / max.\n"]
    for mode, res in results.items():
        lines += [f"Page cache: {mode_label(mode, bool(info['dropped']))}.\n",
                  "| tool | wall (s) | wall + sync (s) | peak RSS (MiB) |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {fmt([r['wall'] for r in runs])} | "
                  f"{fmt([r['wall_sync'] for r in runs])} | {fmt([r['rss_mib'] for r in runs], 0)} |"
                  for name, runs in res.items() if runs]
        lines += ["", f"Targets ({mode} cache, medians):", "",
                  *targets(res, largest=int(info["largest"])), *accelerate_targets(res), ""]
    lines += ["`ckptool consolidate` fsyncs its output before renaming it into place, so a crash "
              "never leaves a complete-looking file with missing data; `cp`, `accelerate` and "
              "`torch.save` leave their writes in the page cache. \"wall + sync\" charges every "
              "tool for the flush. By default ckptool also checks every record's CRC-32 (a second "
              "read of each source file, in a thread beside the in-kernel copy); "
              "`--no-crc-check` skips it. `--dtype` needs the bytes in Python (numpy cast).", "",
              f"Commands: `{info['gen']}` then `{info['bench']}`.", ""]
    return "\n".join(lines)


def accelerate_targets(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """``ckptool consolidate`` against ``accelerate merge-weights``: 5x faster, 20x less RAM."""
    med = medians(results)
    c, acc = med.get("ckptool consolidate"), med.get("accelerate merge-weights")
    if not (c and acc):
        return []
    out = []
    for m, label in (("wall", "wall"), ("wall_sync", "wall + sync")):
        r = acc[m] / c[m]
        out.append(check(f"{label} >= 5x faster than `accelerate merge-weights`", r, ">=", 5,
                         f"{r:.1f}x"))
    r = acc["rss_mib"] / c["rss_mib"]
    return out + [check(">= 20x less RAM than `accelerate merge-weights`", r, ">=", 20, f"{r:.0f}x")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    add_run_options(ap, work="/tmp/ckptool-consolidate-bench")
    ap.add_argument("--render-only", action="store_true",
                    help="do not run anything: render WORK/results.json of an earlier run")
    args = ap.parse_args()
    if args.render_only:
        saved = json.loads((args.work / "results.json").read_text())
        results, info = saved["results"], saved["info"]
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        selected = select(tools(args.checkpoint, args.work), args.only)
        load0 = os.getloadavg()[1]
        n_peer = peer_runs(args)
        results, dropped = measure(selected, args.checkpoint, runs=args.runs,
                                   modes=modes_of(args.cache), skip=skip_peers(n_peer))
        info = describe(args.checkpoint, args.runs, dropped, load0, args.cache, n_peer)
        (args.work / "results.json").write_text(json.dumps({"results": results, "info": info}, indent=1))
    text = render(results, info)
    print(text)
    if args.markdown:
        write_section(args.markdown, SECTION, text)


def describe(ckpt: Path, runs: int, dropped: bool, load0: float, cache: str,
             n_peer: int) -> dict[str, object]:
    largest, model_bytes, n, ws = largest_tensor(ckpt)
    return {
        "largest": largest, "model_bytes": model_bytes, "tensors": n, "world_size": ws,
        "disk_bytes": sum(e.stat().st_size for e in os.scandir(ckpt)), "runs": runs,
        "peer_runs": n_peer,
        "dropped": dropped,
        "machine": f"{os.cpu_count()} CPUs, {mem_gib():.0f} GiB RAM, Linux {platform.release()}, "
                   f"Python {platform.python_version()}; 5-min load average {load0:.1f} at start, "
                   f"{os.getloadavg()[1]:.1f} at end (other jobs share the machine)",
        "gen": f"python bench/gen_checkpoint.py {ckpt} --ranks {ws} --size-gb {model_bytes / 1e9:.1f}",
        "bench": f"python bench/consolidate_bench.py {ckpt} --runs {runs} --peer-runs {n_peer} "
                 f"--cache {cache}",
    }


if __name__ == "__main__":
    main()

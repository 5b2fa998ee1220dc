"""Interleaved timed runs of several tools in both page-cache modes, and the issue's targets.

Shared by ``bench/reshard_bench.py`` and ``bench/import_bench.py``: every run is a fresh
subprocess (``_common.run_once``); runs alternate across tools and cache modes (run 1 of every
tool cold, then warm, then run 2 ...), so a slow spell of a loaded machine hits every tool. The
tools' order is shuffled anew for every run and mode (seeded: the same each time the bench is
run), so that no tool always runs after the same one: the run before leaves the disk and the
host busy (its output deleted, its memory freed), and turning one fixed order by one each run
kept every tool's predecessor the same in all but one position.
Before a cold run the page cache is dropped (root only); before a warm run the source is read
once so that it sits in the cache. Every run starts with no dirty pages (``sync``), then waits
``SETTLE_S``: this VM hands freed memory back to its host (virtio-balloon free page
reporting, about 2 s after it is freed), and a page the host has taken back costs a fault to
write into again. Measured with ``cp -r`` of 2.46 GB, warm: 1.1-1.4 s of sys time when it
started at once after the last output was deleted, 2.3-3.4 s when it started 4-6 s later.
Without the pause, a tool's cost depended on how soon it ran after the deletion and on how
long it ran; with it, every tool writes into memory the host has taken back.

A target is judged on the ratio of the medians; the median of the per-round ratios (each run
over the baseline's run of the same round) is shown beside it, since this machine's speed
drifts during a benchmark.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from _common import check, drop_caches, fmt, precompile, run_once, tool_table

CACHE_CHOICES = ("cold", "warm", "both")
#: issue 15: wall + sync of a ckptool op <= this times ``cp -r`` + sync of the same bytes.
CP_RATIO = 1.15
#: issue 15: peak RSS <= the largest tensor + this many MiB.
RSS_SLACK_MIB = 64
CP = "cp -r"
#: Seconds each run waits after the last output was deleted and the cache dropped or warmed.
SETTLE_S = 5

Tools = dict[str, tuple[list[str], Path]]
Results = dict[str, dict[str, list[dict[str, float]]]]  # mode -> tool -> runs


def modes_of(cache: str) -> list[str]:
    return ["cold", "warm"] if cache == "both" else [cache]


def warm_up(src: Path) -> None:
    """Read every file under ``src`` once (into the page cache)."""
    buf = bytearray(8 << 20)
    for p in sorted(q for q in src.rglob("*") if q.is_file()):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def measure(tools: Tools, src: Path, *, runs: int, modes: list[str],
            skip: Callable[[str, int], bool] | None = None,
            sources: dict[str, Path] | None = None) -> tuple[Results, bool]:
    """Run every tool ``runs`` times in every mode, interleaved; (results, caches were dropped).

    The tools' order is shuffled for each run and mode (seeded), so that no tool always follows
    the same one (a tool run right after one that wrote 4 GB finds the disk still busy).

    ``skip(name, i)`` leaves run ``i`` of a tool out (e.g. fewer runs of a slow peer route);
    ``sources[name]``: what a tool reads, when not ``src`` (read once before its warm runs).
    """
    precompile()
    results: Results = {m: {k: [] for k in tools} for m in modes}
    dropped = True
    for i in range(runs):
        for mode in modes:
            order = list(tools.items())
            random.Random(f"{i} {mode}").shuffle(order)
            for name, (cmd, out) in order:
                if skip is not None and skip(name, i):
                    continue
                remove(out)
                if mode == "cold":
                    dropped &= drop_caches()
                else:
                    os.sync()
                    warm_up((sources or {}).get(name, src))
                time.sleep(SETTLE_S)
                r = {**run_once(cmd), "load": os.getloadavg()[0],  # load: other users skew it
                     "round": i}
                results[mode][name].append(r)
                shown = {k: round(v, 3) for k, v in r.items()}
                print(f"run {i + 1} {mode} {name}: {shown}", flush=True)
                remove(out)
    return results, dropped


def remove(out: Path) -> None:
    """Delete a run's output, a folder or a single file."""
    if out.is_dir():
        shutil.rmtree(out)
    else:
        out.unlink(missing_ok=True)


def medians(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {k: {m: statistics.median(r[m] for r in v) for m in ("wall", "wall_sync", "rss_mib")}
            for k, v in results.items() if v}


def targets(results: dict[str, list[dict[str, float]]], *, largest: int,
            baselines: dict[str, str] | None = None) -> list[str]:
    """Issue 15's target lines for every ``ckptool`` tool: wall + sync <= 1.15x ``cp -r`` +
    sync of the same bytes, and peak RSS <= the largest tensor (``largest`` bytes) + 64 MiB.

    ``baselines[name]``: the copy that moves the same bytes as that tool, when not ``cp -r`` of
    the source (a cast writes more than it reads); its ratio to ``cp -r`` follows, for
    information."""
    med = medians(results)
    out = []
    limit = largest / 2**20 + RSS_SLACK_MIB
    for name, r in med.items():
        if not name.startswith("ckptool"):
            continue
        out.append(check(f"`{name}`: peak RSS <= largest tensor + {RSS_SLACK_MIB} MiB",
                         r["rss_mib"], "<=", limit, f"{r['rss_mib']:.0f} MiB vs {limit:.0f} MiB"))
        base = (baselines or {}).get(name, CP)
        if base in med:
            x = r["wall_sync"] / med[base]["wall_sync"]
            paired = paired_ratios(results[name], results[base])
            shown = f"{x:.2f}x" + (f" (median of the {len(paired)} per-round ratios: "
                                   f"{statistics.median(paired):.2f}x)" if paired else "")
            out.append(check(f"`{name}`: wall + sync <= {CP_RATIO}x `{base}` + sync", x, "<=",
                             CP_RATIO, shown))
        if base != CP and CP in med:
            out.append(f"- `{name}` vs `{CP}` of the source: "
                       f"{r['wall_sync'] / med[CP]['wall_sync']:.2f}x (for information; it "
                       "writes more bytes than the source holds)")
    return out


def paired_ratios(runs: list[dict[str, float]], base: list[dict[str, float]]) -> list[float]:
    """wall + sync of each run over that of ``base``'s run in the same round (same cache mode):
    a drift of the machine during the benchmark moves both sides of each ratio alike. Empty
    for results saved before rounds were recorded."""
    by_round = {b["round"]: b["wall_sync"] for b in base if "round" in b}
    return [r["wall_sync"] / by_round[r["round"]] for r in runs if r.get("round") in by_round]


def mode_label(mode: str, dropped: bool) -> str:
    if mode == "warm":
        return "warm (source read once before every run)"
    return "cold (dropped before every run)" if dropped else "warm (could not drop caches)"


def versus_line(results: dict[str, list[dict[str, float]]], other: str, main: str,
                label: str) -> list[str]:
    """An information line: how many times ``main``'s wall + sync the first tool whose name
    starts with ``other`` took (none when either did not run)."""
    med = medians(results)
    peer = next((v for k, v in med.items() if k.startswith(other)), None)
    if peer is None or main not in med:
        return []
    return [f"- {label}: {peer['wall_sync'] / med[main]['wall_sync']:.1f}x the wall + sync time "
            "(for information; no target)"]


#: How the bench texts say the runs were ordered.
ORDER_NOTE = (f"the tools' order shuffled for each run, seeded; each run started {SETTLE_S} s "
              "after the last output was deleted and the cache dropped or warmed, once the "
              "host had taken back the freed memory")


def add_run_options(ap, *, work: str) -> None:
    """``--runs``, ``--peer-runs``, ``--cache``, ``--work``, ``--only`` and ``--markdown``, the
    same in every bench that uses ``measure``."""
    ap.add_argument("--runs", type=int, default=5, help="runs per tool and cache mode (default 5)")
    ap.add_argument("--peer-runs", type=int, default=None,
                    help="runs of the other tools' (slow) ways: all but ckptool and the copies "
                    "(default: --runs)")
    ap.add_argument("--cache", choices=CACHE_CHOICES, default="both",
                    help="page cache before each run: cold (dropped), warm, or both (default)")
    ap.add_argument("--work", type=Path, default=Path(work))
    ap.add_argument("--only", action="append",
                    help="run only the tools whose names start with this (repeatable)")
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section")


def peer_runs(args) -> int:
    """``--peer-runs``, at most ``--runs``."""
    return min(args.peer_runs or args.runs, args.runs)


def skip_peers(n: int) -> Callable[[str, int], bool]:
    """``measure``'s ``skip``: the peers' ways (neither ckptool nor a copy) run ``n`` times."""
    return lambda name, i: not name.startswith(("ckptool", "cp ")) and i >= n


def select(tools: Tools, only: list[str] | None) -> Tools:
    """The tools ``--only`` names (by the start of their names); all without it."""
    return {k: v for k, v in tools.items() if not only or any(k.startswith(o) for o in only)}


def loads_text(results: Results) -> str:
    """min / median / max of the 1-minute load average before the runs."""
    return fmt([r["load"] for m in results.values() for v in m.values() for r in v], 1)


def mode_sections(results: Results, *, dropped: bool, largest: int,
                  versus: tuple[str, str, str] | None = None,
                  baselines: dict[str, str] | None = None) -> list[str]:
    """Per cache mode: the table of every tool, the target lines (``targets``), and the
    ``versus_line`` (``(other, main, label)``) if given."""
    lines = []
    for mode, res in results.items():
        lines += [f"Page cache: {mode_label(mode, dropped)}.\n", *tool_table(res), "",
                  "Targets (medians):", "", *targets(res, largest=largest, baselines=baselines),
                  *(versus_line(res, *versus) if versus else []), ""]
    return lines

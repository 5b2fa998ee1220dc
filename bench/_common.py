"""Helpers shared by the benchmark scripts: cache dropping, timed subprocess runs with peak
RSS, min/median/max formatting, target lines and updating one section of docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def drop_caches() -> bool:
    """Flush and drop the page cache (root only); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def precompile() -> None:
    """Compile ckptool's bytecode once, as ``pip install`` does, so every timed run does not
    pay for it (some environments set ``PYTHONDONTWRITEBYTECODE``, which would otherwise make
    each start of ``ckptool`` compile the modules it imports: about 0.03 s here)."""
    import compileall

    import ckptool

    compileall.compile_dir(str(Path(ckptool.__file__).parent), quiet=1)


def run_once(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``: wall seconds, wall including a final ``sync``, and the child's peak RSS.

    A stdout line ``{"rss_sum_mib": X}`` (printed by multi-process routes) is picked up too.
    """
    with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fout, stderr=ferr)  # files: a chatty tool never blocks
        _, status, ru = os.wait4(p.pid, 0)
        t1 = time.perf_counter()
        p.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0)
        ferr.seek(0)
        out = fout.read().decode(errors="replace")
        err = ferr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    os.sync()
    t2 = time.perf_counter()
    r = {"wall": t1 - t0, "wall_sync": t2 - t0, "rss_mib": ru.ru_maxrss / 1024}
    for line in out.splitlines():
        if line.startswith('{"rss_sum_mib"'):
            r["rss_sum_mib"] = json.loads(line)["rss_sum_mib"]
    return r


def fmt(xs: list[float], digits: int = 2) -> str:
    """min / **median** / max."""
    return (f"{min(xs):.{digits}f} / **{statistics.median(xs):.{digits}f}** / "
            f"{max(xs):.{digits}f}")


def check(what: str, value: float, op: str, limit: float, shown: str) -> str:
    """A markdown line saying whether a target is met."""
    ok = value <= limit if op == "<=" else value >= limit
    return f"- {what}: {shown} — {'met' if ok else '**not met**'}"


def write_section(md: Path, section: str, text: str) -> None:
    """Insert or replace the ``section`` heading's block of ``md`` (re-read now), leaving the rest."""
    old = md.read_text() if md.exists() else "# Benchmarks\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == section), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        new = "".join(lines[:start]) + text + ("\n" + "".join(lines[end:]) if end < len(lines)
                                               else "")
    md.write_text(new.rstrip("\n") + "\n")


def mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def record_rss(out: str, rank: int) -> None:
    """Called last in a rank process: leave its peak RSS (KiB) where ``spawn_ranks`` reads it."""
    import resource

    with open(f"{out}.{rank}", "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def spawn_ranks(fn, m: int, src: str, dst: str) -> None:
    """``fn(rank, m, src, dst, rdzv, rss_out)`` on ``m`` spawned ranks; print their summed peak
    RSS as JSON (the peers' multi-process routes, measured the same way in every bench)."""
    import json
    import os
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(m, src, dst, f"{tmp}/rdzv", f"{tmp}/rss"), nprocs=m, join=True)
        rss = [int(Path(f"{tmp}/rss.{r}").read_text()) for r in range(m)]
    print(json.dumps({"rss_sum_mib": sum(rss) / 1024}))


def tool_table(results: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: per tool, min / median / max of wall, wall + sync and peak RSS (plus the
    summed RSS of all ranks for multi-process routes)."""
    lines = ["| tool | wall (s) | wall + sync (s) | peak RSS, largest process (MiB) |",
             "|---|---|---|---|"]
    for name, runs in results.items():
        rss = fmt([r["rss_mib"] for r in runs], 0)
        if all("rss_sum_mib" in r for r in runs):
            rss += f" (all ranks: {fmt([r['rss_sum_mib'] for r in runs], 0)})"
        lines.append(f"| `{name}` | {fmt([r['wall'] for r in runs])} | "
                     f"{fmt([r['wall_sync'] for r in runs])} | {rss} |")
    return lines


"""Benchmark ``ckptool validate``: many small tensors, or an existing (large) checkpoint.

Default mode: a synthetic checkpoint of 10,000 tensors in 64 files. Targets (issue 2):
structural validate < 0.3 s of work; ``--deep`` at >= 0.8x the speed of ``cat`` over the same
files. Both are measured in the same run, warm and cold page cache
(``echo 3 > /proc/sys/vm/drop_caches``, root only), 3 runs each; min/median/max reported.

Folder mode (issue 15): given an existing checkpoint folder (e.g. 2.2 GB, 8 ranks, made by
``bench/gen_checkpoint.py``), the whole commands ``cat FILES > /dev/null``,
``ckptool validate --deep FOLDER`` and ``ckptool validate FOLDER`` (the same start-up and
index checks, no data read) run as subprocesses, alternating, warm then cold cache; median
wall time of ``--runs`` each. Target: ``--deep`` >= 0.8x the speed of ``cat`` warm. Two
ratios are given: of the whole commands, and of the reading alone (``--deep``'s wall minus
the structural command's, paired by round), since a Python command's start-up is a fixed
cost that ``cat`` does not pay.

Usage:
    python bench/validate_bench.py [--dir /tmp/ckptool-bench-validate] [--mb 1024] [--runs 3]
    python bench/validate_bench.py /tmp/bench15/step_1000 --runs 5 [--markdown docs/BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import drop_caches, precompile, run_once, write_section  # noqa: E402

SECTION = "## validate --deep on a large checkpoint"


def make_checkpoint(path: Path, n_tensors: int, files: int, total_mb: int) -> None:
    if (path / ".metadata").exists():
        return
    import torch
    import torch.distributed.checkpoint as dcp
    import warnings

    per = max(1, total_mb * (1 << 20) // (n_tensors * 4))
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.w": torch.randn(per, generator=g) for i in range(n_tensors)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=files))




def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_timed(fn) -> float:
    """CPU seconds of this process (the work itself, whatever else the machine runs)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def cat(path: Path) -> None:
    files = sorted(str(p) for p in path.iterdir())
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


def stats(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", type=Path,
                    help="an existing checkpoint folder: compare 'ckptool validate --deep' with cat")
    ap.add_argument("--markdown", type=Path,
                    help="with a checkpoint folder: write the table into this file's section")
    ap.add_argument("--dir", default="/tmp/ckptool-bench-validate")
    ap.add_argument("--mb", type=int, default=1024, help="total tensor data in MiB")
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.checkpoint is not None:
        text = folder_bench(args.checkpoint, args.runs)
        print(text)
        if args.markdown:
            write_section(args.markdown, SECTION, text)
        return
    ckpt = Path(args.dir) / f"t{args.tensors}-f{args.files}-{args.mb}mb"
    make_checkpoint(ckpt, args.tensors, args.files, args.mb)
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    nfiles = sum(1 for p in ckpt.glob("*.distcp"))

    from ckptool.ops.validate import validate

    rows = []
    struct = [timed(lambda: _ok(validate(ckpt))) for _ in range(args.runs)]
    rows.append(("validate (structure), in-process, wall", struct, None))
    work = [cpu_timed(lambda: _ok(validate(ckpt))) for _ in range(args.runs)]
    rows.append(("validate (structure), in-process, CPU time", work, None))
    cli = [timed(lambda: subprocess.run([sys.executable, "-m", "ckptool", "validate", str(ckpt)],
                                        check=True, stdout=subprocess.DEVNULL))
           for _ in range(args.runs)]
    rows.append(("ckptool validate (CLI, incl. start-up)", cli, None))
    can_drop = drop_caches()
    for cache in (["warm", "cold"] if can_drop else ["warm"]):
        deep, cats = [], []
        for _ in range(args.runs):
            if cache == "cold":
                drop_caches()
            else:
                cat(ckpt)
            cats.append(timed(lambda: cat(ckpt)))
            if cache == "cold":
                drop_caches()
            deep.append(timed(lambda: _ok(validate(ckpt, deep=True))))
        rows.append((f"cat all files ({cache} cache)", cats, size))
        rows.append((f"validate --deep ({cache} cache)", deep, size))
    print(f"checkpoint: {args.tensors} tensors, {nfiles} .distcp files, {size / 2**20:.0f} MiB; "
          f"{os.cpu_count()} cores; page cache drop {'used' if can_drop else 'NOT available'}\n")
    print("| what | seconds min / median / max | throughput (median) |")
    print("|---|---|---|")
    for name, xs, nbytes in rows:
        tp = f"{nbytes / statistics.median(xs) / 2**20:.0f} MiB/s" if nbytes else ""
        print(f"| {name} | {stats(xs)} | {tp} |")
    for cache in ("warm", "cold"):
        c = [r for r in rows if r[0] == f"cat all files ({cache} cache)"]
        d = [r for r in rows if r[0] == f"validate --deep ({cache} cache)"]
        if c and d:
            ratio = statistics.median(c[0][1]) / statistics.median(d[0][1])
            print(f"\n--deep speed / cat speed ({cache}): {ratio:.2f}x (target >= 0.8x)")


def folder_bench(folder: Path, runs: int) -> str:
    """``cat`` vs ``ckptool validate --deep`` on ``folder``, alternating; a markdown section."""
    files = sorted(str(p) for p in folder.rglob("*") if p.is_file())
    size = sum(Path(f).stat().st_size for f in files)
    script = Path(sys.executable).with_name("ckptool")
    tool = [str(script)] if script.exists() else [sys.executable, "-m", "ckptool"]
    # cat's output goes to /dev/null (run_once keeps a command's stdout: 2 GB of it here)
    cmds = {"cat": ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            "ckptool validate --deep": [*tool, "validate", "--deep", str(folder)],
            "ckptool validate": [*tool, "validate", str(folder)]}
    walls: dict[tuple[str, str], list[float]] = {}
    precompile()
    run_once(cmds["cat"])  # fill the page cache
    for cache in ("warm", "cold"):
        if cache == "cold" and not drop_caches():
            break  # not root: warm only
        for i in range(runs):
            for name, cmd in cmds.items():
                if cache == "cold":
                    drop_caches()
                wall = run_once(cmd)["wall"]
                walls.setdefault((name, cache), []).append(wall)
                print(f"run {i + 1} {cache} {name}: {wall:.3f} s", file=sys.stderr, flush=True)
    lines = [SECTION, "", f"Checkpoint `{folder}`: {len(files)} files, {size / 2**30:.2f} GiB; "
             f"{os.cpu_count()} cores; load average {os.getloadavg()[1]:.1f}; {runs} runs each, "
             "alternating, wall time of the whole command.", "",
             "| what | cache | seconds min / median / max | throughput (median) |",
             "|---|---|---|---|"]
    for (name, cache), xs in walls.items():
        speed = ("" if name == "ckptool validate"  # reads no data
                 else f"{size / statistics.median(xs) / 2**20:.0f} MiB/s")
        lines.append(f"| `{name}` | {cache} | {stats(xs)} | {speed} |")
    lines.append("")
    for cache in ("warm", "cold"):
        if ("cat", cache) in walls:
            cat, deep = walls[("cat", cache)], walls[("ckptool validate --deep", cache)]
            reading = [d - s for d, s in zip(deep, walls[("ckptool validate", cache)])]
            target = " (target >= 0.8x cat warm)" if cache == "warm" else ""
            lines.append(f"- `--deep` speed / `cat` speed, {cache} cache, whole commands: "
                         f"{statistics.median(cat) / statistics.median(deep):.2f}x{target}")
            lines.append(f"- the same, reading alone (`--deep` minus `validate`, by round: "
                         f"median {statistics.median(reading):.3f} s): "
                         f"{statistics.median(cat) / statistics.median(reading):.2f}x")
    lines += ["", f"Command: `python bench/validate_bench.py {folder} --runs {runs}`."]
    return "\n".join(lines) + "\n"


def _ok(report) -> None:
    if not report.ok:
        raise SystemExit(f"benchmark checkpoint invalid: {report.findings[:3]}")


if __name__ == "__main__":
    main()

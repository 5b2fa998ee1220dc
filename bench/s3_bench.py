"""Benchmark ``ckptool consolidate s3://...`` against a parallel download of the same folder
(``s3fs``'s ``fs.get(folder, local, recursive=True)``), both from a real S3 API on loopback.

A moto server (``moto.server.ThreadedMotoServer``) runs in a child process on 127.0.0.1; the
checkpoint folder is uploaded once, then both commands run N times each, alternating, every run
a fresh subprocess that finds the endpoint through ``AWS_ENDPOINT_URL`` (as tests do). Wall time
comes from the parent's clock, peak RSS from ``os.wait4``; "wall + sync" adds an ``os.sync()``
after the command. Both read the same bytes from the same server, so the ratio says how close
``consolidate`` comes to a plain parallel download; the server itself (Python) is the limit of
both on loopback, so absolute numbers are not S3's.

Usage:
    python bench/s3_bench.py [CHECKPOINT] --runs 5 [--markdown docs/BENCHMARKS.md]

Without CHECKPOINT a 0.3 GB 4-rank one is made with ``bench/gen_checkpoint.py`` under WORK
(moto answers every ranged GET by reading the whole object: what a tool reads by ranges
costs more here than on S3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import check, mem_gib, run_once, tool_table, write_section  # noqa: E402

SECTION = "## consolidate from S3"
BUCKET = "ckptool-bench"
#: ``consolidate`` from S3 within this factor of ``s3fs`` downloading the same folder.
TARGET = 1.3

_SERVER = ("import logging, sys; logging.disable(logging.CRITICAL); "
           "from moto.server import ThreadedMotoServer; "
           "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start(); "
           "print(*s.get_host_and_port(), flush=True); sys.stdin.read(); s.stop()")
_PUT = ("import os, sys, s3fs; fs = s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL']); "
        f"fs.mkdir('{BUCKET}'); fs.put(sys.argv[1], sys.argv[2], recursive=True)")
_GET = ("import os, sys, s3fs; fs = s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL']); "
        "fs.get(sys.argv[1], sys.argv[2], recursive=True)")


def start_server() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on loopback in a child process (so this one stays small: a child's
    peak RSS counts the parent's pages it was forked from); the environment is set so
    children reach it. It stops when its stdin closes."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    host, port = server.stdout.readline().split()  # type: ignore[union-attr]
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    return server, endpoint


def stop_server(server: subprocess.Popen) -> None:
    server.stdin.close()  # type: ignore[union-attr]
    server.wait(timeout=30)


def upload(ckpt: Path) -> tuple[str, float]:
    """Put the checkpoint folder at ``s3://BUCKET/run/<name>``: (its URL, seconds taken)."""
    url = f"s3://{BUCKET}/run/{ckpt.name}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _PUT, str(ckpt), url], check=True)
    return url, time.perf_counter() - t0


def tools(url: str, work: Path) -> dict[str, tuple[list[str], Path]]:
    """Name -> (command, output path to delete afterwards)."""
    return {
        "s3fs get (recursive)": ([sys.executable, "-c", _GET, url, str(work / "get")],
                                 work / "get"),
        "ckptool consolidate": (["ckptool", "consolidate", url, str(work / "c.safetensors")],
                                work / "c.safetensors"),
    }


def run_all(selected: dict[str, tuple[list[str], Path]], runs: int) -> dict[str, list[dict]]:
    """Every tool ``runs`` times, alternating, output removed after each run."""
    results: dict[str, list[dict[str, float]]] = {k: [] for k in selected}
    for i in range(runs):
        for name, (cmd, out) in selected.items():
            r = run_once(cmd)
            results[name].append(r)
            print(f"run {i + 1} {name}: {json.dumps({k: round(v, 3) for k, v in r.items()})}",
                  flush=True)
            if out.is_dir():
                shutil.rmtree(out)
            else:
                out.unlink(missing_ok=True)
    return results


def render(results: dict[str, list[dict[str, float]]], info: dict[str, object]) -> str:
    lines = [f"{SECTION}\n",
             f"Checkpoint: {info['world_size']}-rank DCP, {info['disk_bytes'] / 1e9:.2f} GB in "
             f"{info['files']} files, on a moto S3 server on loopback (uploaded in "
             f"{info['upload_s']:.1f} s). Machine: {info['machine']}. {info['runs']} runs per "
             "tool, alternating; min / **median** / max.\n", *tool_table(results), "",
             "`s3fs get` downloads the folder's files as they are (one streamed GET per file, "
             "files in parallel); `ckptool consolidate` reads each source file front to back "
             "over one streamed GET too (8 files at once, at most 16 MiB held per file), checks "
             "every record's CRC-32 as it passes, writes one `.safetensors` file with positioned "
             "writes and fsyncs it. (moto answers every ranged GET by reading the whole object, "
             "which made the ranged requests consolidate used before cost a file's read each.)",
             "", "Target (medians):", "", *targets(results), "",
             f"Command: `{info['bench']}`.", ""]
    return "\n".join(lines)


def targets(results: dict[str, list[dict[str, float]]]) -> list[str]:
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall", "wall_sync")}
           for k, v in results.items()}
    c, get = med.get("ckptool consolidate"), med.get("s3fs get (recursive)")
    if not (c and get):
        return []
    r = c["wall_sync"] / get["wall_sync"]
    return [check(f"wall + sync <= {TARGET}x `s3fs get`", r, "<=", TARGET, f"{r:.2f}x")]


def describe(ckpt: Path, runs: int, upload_s: float, load0: float) -> dict[str, object]:
    files = [e for e in os.scandir(ckpt) if e.is_file()]
    return {
        "world_size": sum(e.name.endswith(".distcp") for e in files), "files": len(files),
        "disk_bytes": sum(e.stat().st_size for e in files), "runs": runs, "upload_s": upload_s,
        "machine": f"{os.cpu_count()} CPUs, {mem_gib():.0f} GiB RAM, Linux {platform.release()}, "
                   f"Python {platform.python_version()}; 5-min load average {load0:.1f} at start, "
                   f"{os.getloadavg()[1]:.1f} at end",
        "bench": f"python bench/s3_bench.py {ckpt} --runs {runs}",
    }


def make_checkpoint(work: Path, size_gb: float) -> Path:
    ckpt = work / "src" / "step_1000"
    if not (ckpt / ".metadata").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "gen_checkpoint.py"), str(ckpt),
                        "--ranks", "4", "--size-gb", str(size_gb), "--d-model", "512"], check=True)
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?",
                    help="a local checkpoint folder to upload (default: make one under WORK)")
    ap.add_argument("--size-gb", type=float, default=0.3, help="size of the made checkpoint")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckptool-s3-bench"))
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint or make_checkpoint(args.work, args.size_gb)
    server, _ = start_server()
    try:
        url, upload_s = upload(ckpt)
        print(f"uploaded {ckpt} to {url} in {upload_s:.1f} s", flush=True)
        load0 = os.getloadavg()[1]
        results = run_all(tools(url, args.work), args.runs)
    finally:
        stop_server(server)
    text = render(results, describe(ckpt, args.runs, upload_s, load0))
    print(text)
    if args.markdown:
        write_section(args.markdown, SECTION, text)


if __name__ == "__main__":
    main()

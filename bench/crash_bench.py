"""Crash harness (issue 7): SIGKILL one rank of ``ckptool train`` during saves, many times.

Each trial starts ``ckptool train`` (2 ranks, a tiny model, a save every step) in a fresh run
folder, waits for a randomly chosen ``step_N`` folder to appear, sleeps a random 0-300 ms and
SIGKILLs a random rank. It records where the kill landed (the state of the newest step folder
just before the kill), then checks:

* the launcher exited non-zero with a message naming the killed rank;
* no process of the launcher's process group (ranks, DCP's async-save processes) outlives it;
* no folder with ``.metadata`` fails ``validate --deep`` (a torn checkpoint taken for good);
* no folder holds ``ckptool.json`` without ``.metadata`` (neither at the kill nor after);
* ``ls`` marks every folder without ``.metadata`` "incomplete";
* the newest committed checkpoint seen before the kill still exists (retention);
* a second ``ckptool train`` on the same ``--out`` resumes from the newest complete
  checkpoint and reaches the target step.

Usage:
    python bench/crash_bench.py --trials 20 [--async-save] [--seed 0] [--dir /tmp/ckptool-crash]
    python bench/crash_bench.py --hash-bench    # xxh3-64 vs blake2b vs sha256 throughput

Importable: ``run_trials(n, async_save=..., root=...)`` returns a ``Summary``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

STEPS = 12
TRAIN_ARGS = ["--nproc", "2", "--d-model", "32", "--layers", "2", "--heads", "2",
              "--seq-len", "16", "--batch-size", "4", "--steps", str(STEPS), "--save-every", "1",
              "--keep", "3", "--log-every", "100"]
POLL_S = 0.002
_STEP = re.compile(r"step_(\d+)")


@dataclass
class Trial:
    index: int
    async_save: bool
    target_step: int
    delay_ms: float
    killed_rank: int | None = None
    landed: str = "missed"  # where the kill landed, see _landing()
    exit_code: int | None = None
    names_rank: bool = False
    orphans: list[int] = field(default_factory=list)
    torn_taken_for_good: list[str] = field(default_factory=list)
    manifest_without_metadata: list[str] = field(default_factory=list)
    ls_wrong: list[str] = field(default_factory=list)
    torn_left: list[str] = field(default_factory=list)  # step folders without .metadata after the kill
    newest_good_before: str | None = None
    newest_good_lost: bool = False
    resumed_from: str | None = None
    expected_resume: str | None = None
    resume_ok: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        missed_ok = self.landed == "missed" and self.exit_code == 0
        killed_ok = missed_ok or (self.exit_code not in (0, None) and self.names_rank)
        return (killed_ok and not self.orphans and not self.torn_taken_for_good
                and not self.manifest_without_metadata and not self.ls_wrong
                and not self.newest_good_lost and self.resume_ok)


@dataclass
class Summary:
    trials: list[Trial]

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.trials)

    def counts(self) -> dict[str, object]:
        kills = [t for t in self.trials if t.landed != "missed"]
        return {
            "trials": len(self.trials),
            "kills": len(kills),
            "landed": dict(Counter(t.landed for t in self.trials)),
            "killed_rank": dict(Counter(str(t.killed_rank) for t in kills)),
            "launcher_nonzero_naming_rank": sum(t.exit_code not in (0, None) and t.names_rank for t in kills),
            "orphans": sum(len(t.orphans) for t in self.trials),
            "torn_taken_for_good": sum(len(t.torn_taken_for_good) for t in self.trials),
            "manifest_without_metadata": sum(len(t.manifest_without_metadata) for t in self.trials),
            "torn_folders_left": sum(len(t.torn_left) for t in self.trials),
            "ls_wrong": sum(len(t.ls_wrong) for t in self.trials),
            "newest_good_lost": sum(t.newest_good_lost for t in self.trials),
            "resumes_ok": sum(t.resume_ok for t in self.trials),
            "failed_trials": [t.index for t in self.trials if not t.ok],
            "seconds_per_trial": round(sum(t.seconds for t in self.trials) / max(1, len(self.trials)), 2),
        }


def _cmd(out: Path, async_save: bool) -> list[str]:
    cmd = [sys.executable, "-m", "ckptool", "train", "--out", str(out), *TRAIN_ARGS]
    return cmd + (["--async-save"] if async_save else [])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTOOL_TEST_KILL="")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, pgid, state) from /proc (no psutil needed)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        table[int(name)] = (int(rest[1]), int(rest[2]), rest[0])
    return table


def _rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes, rank 0 first (spawned in rank order)."""
    kids = [p for p, (pp, _, st) in _proc_table().items() if pp == launcher and st != "Z"]
    ranks = []
    for pid in kids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(pid)
    return sorted(ranks)


def _group_alive(pgid: int, exclude: set[int]) -> list[int]:
    return [p for p, (_, g, st) in _proc_table().items() if g == pgid and st != "Z" and p not in exclude]


def _steps(out: Path) -> list[tuple[int, Path]]:
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _STEP.fullmatch(p.name))]
    return sorted(found)


def _landing(out: Path, target: int) -> str:
    """Where a kill lands, from the newest step folder's files just before it."""
    found = _steps(out)
    if not found:
        return "before-first-save"
    step, p = found[-1]
    try:
        names = set(os.listdir(p))
    except OSError:
        return "during-retention"
    if ".metadata" not in names:
        return "save:before-metadata"
    if "ckptool.json" not in names:
        return "save:metadata-no-manifest"
    return "between-saves" if step >= target else "save:after-manifest"


def _newest_committed(out: Path) -> str | None:
    for _, p in reversed(_steps(out)):
        if (p / ".metadata").exists() and (p / "ckptool.json").exists():
            return p.name
    return None


def _manifest_without_metadata(out: Path) -> list[str]:
    return [p.name for _, p in _steps(out)
            if (p / "ckptool.json").exists() and not (p / ".metadata").exists()]


def run_trial(index: int, root: Path, rng: random.Random, *, async_save: bool,
              timeout: float = 120.0) -> Trial:
    t0 = time.monotonic()
    out = root / f"trial_{index:03d}"
    shutil.rmtree(out, ignore_errors=True)
    trial = Trial(index, async_save, target_step=rng.randint(2, STEPS - 3),
                  delay_ms=round(rng.uniform(0, 300), 1))
    proc = subprocess.Popen(_cmd(out, async_save), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(), start_new_session=True)
    pgid = proc.pid
    seen_bad: set[str] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        seen_bad.update(_manifest_without_metadata(out))
        if any(s >= trial.target_step for s, _ in _steps(out)):
            end = time.monotonic() + trial.delay_ms / 1000
            while time.monotonic() < end:  # keep watching the ordering while we wait
                seen_bad.update(_manifest_without_metadata(out))
                time.sleep(POLL_S)
            ranks = _rank_pids(proc.pid)
            if proc.poll() is None and ranks:
                trial.killed_rank = rng.randrange(len(ranks))
                trial.newest_good_before = _newest_committed(out)
                trial.landed = _landing(out, trial.target_step)
                os.kill(ranks[trial.killed_rank], signal.SIGKILL)
            break
        time.sleep(POLL_S)
    try:
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        _, err = proc.communicate()
        err = (err or b"") + b"\n[crash_bench: launcher timed out]"
    trial.exit_code = proc.returncode
    text = err.decode(errors="replace")
    if trial.killed_rank is not None:
        trial.names_rank = f"rank {trial.killed_rank} was killed by SIGKILL" in text
        if not trial.names_rank:
            print(f"[trial {index}] launcher stderr tail:\n{text[-1500:]}", file=sys.stderr)
    time.sleep(0.3)  # a process that outlives the launcher by more than this is an orphan
    trial.orphans = _group_alive(pgid, exclude={os.getpid()})
    for pid in trial.orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _check_folder(trial, out, seen_bad)
    _check_resume(trial, out, timeout)
    trial.seconds = round(time.monotonic() - t0, 2)
    return trial


def _check_folder(trial: Trial, out: Path, seen_bad: set[str]) -> None:
    from ckptool.ops.inspect import list_run
    from ckptool.ops.validate import validate

    trial.manifest_without_metadata = sorted(seen_bad | set(_manifest_without_metadata(out)))
    for _, p in _steps(out):
        if not (p / ".metadata").exists():
            trial.torn_left.append(p.name)
        elif not validate(p, deep=True).ok:
            trial.torn_taken_for_good.append(p.name)
    if out.is_dir():
        for e in list_run(out):
            committed = (out / e.name / ".metadata").exists()
            if not committed and e.status != "incomplete":
                trial.ls_wrong.append(f"{e.name}:{e.status}")
    if trial.newest_good_before and not (out / trial.newest_good_before / ".metadata").exists():
        trial.newest_good_lost = True


def _check_resume(trial: Trial, out: Path, timeout: float) -> None:
    from ckptool.checkpoint import latest_valid

    latest = latest_valid(out) if out.is_dir() else None
    trial.expected_resume = latest.name if latest else None
    proc = subprocess.run(_cmd(out, trial.async_save) + ["--json"], capture_output=True, text=True,
                          env=_env(), timeout=timeout)
    if proc.returncode != 0:
        print(f"[trial {trial.index}] resume failed:\n{proc.stderr[-1500:]}", file=sys.stderr)
        return
    r = json.loads(proc.stdout)
    trial.resumed_from = Path(r["resumed_from"]).name if r["resumed_from"] else None
    trial.resume_ok = r["steps"] == STEPS and trial.resumed_from == trial.expected_resume
    trial.manifest_without_metadata += _manifest_without_metadata(out)


def run_trials(n: int, *, async_save: bool = False, root: str | os.PathLike[str] = "/tmp/ckptool-crash",
               seed: int = 0, verbose: bool = False) -> Summary:
    """``n`` kill trials (see the module docstring); each trial's run folder is kept under ``root``."""
    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    trials = []
    for i in range(n):
        t = run_trial(i, root, rng, async_save=async_save)
        trials.append(t)
        if verbose:
            print(f"trial {i:3d} {'ok ' if t.ok else 'BAD'} target step_{t.target_step} +{t.delay_ms:5.1f} ms "
                  f"rank {t.killed_rank} landed {t.landed:<26} rc {t.exit_code} resumed {t.resumed_from} "
                  f"({t.seconds:.1f} s)" + ("" if t.ok else f"  {t}"), flush=True)
    return Summary(trials)


def hash_bench(mb: int = 256, runs: int = 3) -> dict[str, float]:
    """MB/s of xxh3-64, blake2b and sha256 over ``mb`` MiB in memory (best of ``runs``)."""
    import hashlib

    import xxhash

    data = os.urandom(1 << 20) * mb
    block = 4 << 20
    out = {}
    for name, make in (("xxh3_64", xxhash.xxh3_64), ("blake2b", hashlib.blake2b),
                       ("sha256", hashlib.sha256), ("crc32 (zlib)", None)):
        best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            if make is None:
                import zlib

                c = 0
                for i in range(0, len(data), block):
                    c = zlib.crc32(data[i:i + block], c)
            else:
                h = make()
                mv = memoryview(data)
                for i in range(0, len(data), block):
                    h.update(mv[i:i + block])
                h.hexdigest()
            best = min(best, time.perf_counter() - t)
        out[name] = round(mb / best, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/ckptool-crash")
    ap.add_argument("--hash-bench", action="store_true")
    args = ap.parse_args()
    if args.hash_bench:
        print(json.dumps(hash_bench(), indent=1))
        return 0
    t = time.monotonic()
    s = run_trials(args.trials, async_save=args.async_save, root=args.dir, seed=args.seed, verbose=True)
    print(json.dumps({**s.counts(), "async_save": args.async_save, "seed": args.seed,
                      "wall_s": round(time.monotonic() - t, 1)}, indent=1))
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The copy engine's moving parts, shared by every op that streams bytes into new files.

``Ticker`` counts bytes done across worker threads and carries the abort flag; ``run_jobs``
runs jobs on a thread pool, reports progress and raises the first failure on the calling
thread (after telling running jobs to stop at their next block and cancelling queued ones);
``fsync_file`` flushes a finished file; ``unverified`` is the one error for an output that
failed its check before commit. Used by ``reshard``, ``import`` and ``consolidate``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ckptool.errors import ConfigError, CorruptCheckpointError
from ckptool.storage import is_url

Progress = Callable[[int, int], None]


class Ticker:
    """Progress shared by worker threads; reported from the calling thread only."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self.abort = threading.Event()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.abort.is_set():
            raise Aborted
        with self._lock:
            self.done += n

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)


class Aborted(Exception):
    pass


def run_jobs(ticker: Ticker, fn: Callable, jobs: list, workers: int) -> list:
    """``[fn(job) for job in jobs]`` on worker threads; progress and errors on this thread."""
    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
                ticker.report()
                for f in done:
                    f.result()  # re-raise the first failure here
        except BaseException:
            ticker.abort.set()  # running jobs stop at their next block; queued ones never start
            for f in futures:
                f.cancel()
            raise
    return [f.result() for f in futures]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unverified(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"verification failed, nothing was committed: {what}",
                                  path=where, hint="Please report this as a ckptool bug")


def new_output_folder(dst: str | os.PathLike[str], *, force: bool, verb: str,
                      source: Path | None = None) -> Path:
    """The absolute local folder a writing op (``reshard``, ``import``) may create at ``dst``.

    Raises:
        ConfigError: ``dst`` is a URL, is or holds ``source``, already exists (without
            ``force``), is a file, or (with ``force``) holds files that are not a checkpoint's.
    """
    if is_url(dst):
        raise ConfigError(f"{os.fspath(dst)}: {verb} writes to a local folder; write locally "
                          "and upload the result")
    out = Path(os.path.abspath(os.fspath(dst))).resolve()
    if source is not None and (out == source or out in source.parents):
        raise ConfigError(f"DST {out} is, or contains, the source {source}; choose another DST")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError(f"{out} already exists", path=str(out),
                          hint="Pass --force to replace it, or choose another DST")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder; remove it or choose another DST")
    if out.is_dir():  # --force replaces a checkpoint, never a folder of someone's other files
        foreign = sorted(p.name for p in out.iterdir() if not _checkpoint_file(p.name))
        if foreign:
            shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4
                                              else "")
            raise ConfigError(f"{out} holds files that are not a checkpoint's ({shown}); "
                              "--force replaces only a checkpoint folder",
                              hint="Remove them, or choose another DST")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _checkpoint_file(name: str) -> bool:
    return (name in (".metadata", "ckptool.json", "hf_assets") or name.endswith(".distcp")
            or name.startswith(".ckptool"))


"""Starting the ranks of ``ckptool train``: spawn them, or join a launcher that already did.

Owns processes: under ``torchrun`` / ``accelerate launch`` (``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set) it runs the loop in this process; otherwise it spawns ``nproc`` ranks
(gloo on CPU, nccl on GPU, rendezvous through a file in a temporary folder), relays rank 0's
events to the caller, and if a rank dies stops the others and raises ``RankFailedError``
naming it. The loop itself is ``loop.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue as queue_mod
import re
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ckptool import errors
from ckptool.errors import CkptError, ConfigError
from ckptool.train.config import TrainConfig
from ckptool.train.preflight import plan_resume

#: Seconds a surviving rank gets to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class RankFailedError(CkptError):
    """A rank exited abnormally; the others were stopped."""

    def __init__(self, message: str, *, rank: int, exit_code: int | None, hint: str | None = None) -> None:
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(message, hint=hint)


@dataclasses.dataclass(frozen=True)
class _RankError:
    """A ``CkptError`` raised in a rank, carried to the parent to be raised again there."""

    rank: int
    kind: str
    message: str


def under_launcher() -> bool:
    """True when an external launcher (torchrun, accelerate launch) started this process."""
    return all(k in os.environ for k in LAUNCHER_ENV)


def default_nproc(cfg: TrainConfig) -> int:
    """``--nproc`` if given, else one rank per GPU, else 2 (the CPU demo)."""
    if cfg.nproc is not None:
        return cfg.nproc
    if cfg.device == "cpu":
        return 2
    import torch

    if cfg.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def launch(cfg: TrainConfig, *, on_event: Callable[[Any], None] | None = None) -> Any:
    """Run training on all ranks and return rank 0's ``TrainResult``.

    Args:
        cfg: the options; ``cfg.nproc`` ranks are spawned unless a launcher started us.
        on_event: receives rank 0's progress events (in this process).

    Returns:
        The ``TrainResult`` (None on ranks other than 0 under an external launcher).

    Raises:
        RankFailedError: a rank died or raised an unexpected error.
        CkptError: a rank raised one (re-raised here with its message).

    Example:
        >>> result = launch(TrainConfig(out="/tmp/run", steps=20), on_event=print)
        >>> result.final_loss < result.first_loss
        True
    """
    if under_launcher():
        if cfg.scaling_check:
            raise ConfigError("--scaling-check needs ckptool to start the ranks itself",
                              hint="Run 'ckptool train --nproc N --scaling-check' without torchrun")
        return _run_here(cfg, on_event)
    # Everything the options and the run folder can tell, before any rank (and torch) starts.
    resume = plan_resume(cfg)
    if cfg.resume_from is not None and resume is not None:
        cfg = dataclasses.replace(cfg, resume_from=resume.path)  # a run folder -> its checkpoint
    nproc = default_nproc(cfg)
    cfg.check_world_size(nproc)
    result = spawn(cfg, nproc, on_event)
    if cfg.scaling_check and result is not None:
        result.scaling = _scaling(cfg, result)
    return result


def _run_here(cfg: TrainConfig, on_event: Callable[[Any], None] | None) -> Any:
    import torch.distributed as dist

    from ckptool.train.loop import train

    owns_group = not dist.is_initialized()
    if owns_group:
        _init_group(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    try:
        return train(cfg, on_event=on_event)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _init_group(cfg: TrainConfig, rank: int, world_size: int, init_method: str,
                threads: int | None = None) -> None:
    import torch
    import torch.distributed as dist

    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        # N ranks on the same cores: one intra-op thread pool each would oversubscribe them.
        torch.set_num_threads(threads or threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group("nccl" if gpu else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size)


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads each of ``local_ranks`` ranks on this machine gets (cores split evenly)."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _worker(rank: int, cfg: TrainConfig, world_size: int, rdzv: str, events: Any, threads: int | None) -> None:
    """One spawned rank (module level so that ``spawn`` can pickle it)."""
    import torch.distributed as dist

    from ckptool.train.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # DCP's async-save process rendezvous at MASTER_ADDR; the host name may not resolve here.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    _init_group(cfg, rank, world_size, f"file://{rdzv}", threads)
    try:
        result = train(cfg, on_event=events.put if rank == 0 else None)
        if rank == 0:
            events.put(result)
    except CkptError as e:
        events.put(_RankError(rank, type(e).__name__, str(e)))
        raise
    except BaseException as e:
        # Say what happened before any teardown: a process group torn down mid-collective
        # can abort the process and the traceback would be lost. (Ctrl-C needs no traceback.)
        if not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
        raise
    dist.destroy_process_group()
    _exit_done(events)


def _exit_done(events: Any) -> None:
    """End a rank whose run succeeded, without interpreter finalization.

    ``destroy_process_group`` does not free a group that a device mesh or DDP still holds; the
    group is then destroyed among C++ statics at interpreter exit, where gloo's joinable worker
    threads may call ``std::terminate`` ("terminate called without an active exception",
    SIGABRT) and turn a finished run into a failed one. Python's exit handlers still run
    (multiprocessing's: the event queue is flushed, daemonic children stopped).
    """
    import atexit
    import sys

    events.close()
    events.join_thread()  # rank 0's result reaches the parent before this process ends
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(cfg: TrainConfig, nproc: int, on_event: Callable[[Any], None] | None = None, *,
          threads: int | None = None) -> Any:
    """Start ``nproc`` ranks in new processes and wait for them (see ``launch``); on CPU each
    rank gets ``threads`` intra-op threads (default: the cores split evenly)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ckptool-rdzv-") as tmp, _without_dcp_daemon_logs():
        procs = mp.start_processes(_worker, args=(cfg, nproc, os.path.join(tmp, "rdzv"), events, threads),
                                   nprocs=nproc, join=False, start_method="spawn")
        try:
            return _supervise(procs.processes, events, on_event)
        finally:
            _stop(procs.processes)
            events.close()
            _remove_error_files(procs.error_files)


def _remove_error_files(paths: list[str | None]) -> None:
    """torch's ``start_processes`` names a ``pytorch-errorfile-*.pickle`` in the temp folder for
    each rank, which a rank that raises writes its traceback to, and never deletes it. The
    launcher relays errors through its queue instead, so the files are removed."""
    for path in paths:
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _supervise(processes: list[Any], events: Any, on_event: Callable[[Any], None] | None) -> Any:
    from multiprocessing.connection import wait

    result, rank_errors = None, []
    alive = {p.sentinel: i for i, p in enumerate(processes)}
    while alive:
        for sentinel in wait(list(alive), timeout=0.1):
            i = alive.pop(sentinel)
            processes[i].join()
            if processes[i].exitcode != 0:
                alive.clear()  # stop waiting: the others are stopped by the caller
                break
        result = _drain(events, on_event, rank_errors, result)
    failed = [i for i, p in enumerate(processes) if p.exitcode not in (0, None)]
    if failed:
        time.sleep(0.2)  # let the queue's feeder thread deliver a rank's last error
        result = _drain(events, on_event, rank_errors, result)
        _raise_failure(processes, failed, rank_errors)
    return result


def _drain(events: Any, on_event: Callable[[Any], None] | None, rank_errors: list[_RankError],
           result: Any) -> Any:
    from ckptool.train.loop import TrainResult

    while True:
        try:
            item = events.get_nowait()
        except (queue_mod.Empty, OSError, EOFError):
            return result
        if isinstance(item, TrainResult):
            result = item
        elif isinstance(item, _RankError):
            rank_errors.append(item)
        elif on_event is not None:
            on_event(item)


def _raise_failure(processes: list[Any], failed: list[int], rank_errors: list[_RankError]) -> None:
    # A rank killed from outside (SIGKILL, SIGTERM, ...) comes first even when a peer then
    # raised a CkptError: with async saves the survivor's background save fails ("Connection
    # closed by peer") and that message hid which rank died (found by bench/crash_bench.py).
    # SIGABRT is left out: it is how a rank that lost its peer mid-collective may end.
    killed = [i for i in failed if processes[i].exitcode < 0 and -processes[i].exitcode != signal.SIGABRT]
    if rank_errors and not killed:  # a CkptError in a rank: the user's problem, say it as the rank said it
        first = rank_errors[0]
        cls = getattr(errors, first.kind, None)
        cls = cls if isinstance(cls, type) and issubclass(cls, CkptError) else CkptError
        raise cls(first.message)
    # A rank killed by a signal is the cause; ranks that then lost their peer exit with 1.
    cause = min(failed, key=lambda i: (processes[i].exitcode >= 0, i))
    code = processes[cause].exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    others = [i for i in failed if i != cause]
    also = f" (then {_plural(len(others), 'rank')} {', '.join(map(str, others))} failed too)" if others else ""
    if rank_errors:
        said = " ".join(rank_errors[0].message.split())[:200]
        also += f"; rank {rank_errors[0].rank} then reported: {said}"
    raise RankFailedError(
        f"rank {cause} {how}{also}; the other ranks were stopped",
        rank=cause, exit_code=code,
        hint="See the rank's output above; run the same command again to resume from the latest good checkpoint",
    )


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def _stop(processes: list[Any]) -> None:
    """SIGTERM the ranks still running, then SIGKILL after ``GRACE_S``: no orphans."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# DCP's async-save process configures the root logger at INFO on its stderr and logs every
# request ("[0] 2026-.. - root - INFO - Received async checkpoint request ..."): 6 lines per
# save per rank. Children inherit fd 2, so the launcher routes it through a filter for them.
_DCP_DAEMON_LINE = re.compile(rb"\[\d+\] \d{4}-\d\d-\d\d [\d:,]+ - root - INFO - ")


@contextlib.contextmanager
def _without_dcp_daemon_logs() -> Iterator[None]:
    """While active, fd 2 (inherited by the ranks) is a pipe forwarded to the real stderr,
    minus DCP's async-save process INFO lines. Everything else passes unchanged, partial
    lines (progress bars) at once, so a dying rank's traceback is never lost."""
    try:
        saved = os.dup(2)
        r, w = os.pipe()
    except OSError:
        yield
        return
    os.dup2(w, 2)
    os.close(w)
    thread = threading.Thread(target=_forward, args=(r, saved), daemon=True)
    thread.start()
    try:
        yield
    finally:
        os.dup2(saved, 2)  # closes our write end: EOF once the children's copies are gone
        thread.join(timeout=2.0)


def _forward(r: int, out: int) -> None:
    pending = b""
    while chunk := os.read(r, 65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not _DCP_DAEMON_LINE.match(line):
                os.write(out, line + b"\n")
        if pending and not pending.startswith(b"["):
            os.write(out, pending)
            pending = b""
    if pending:
        os.write(out, pending)
    os.close(r)
    os.close(out)


def _scaling(cfg: TrainConfig, result: Any) -> dict[str, float] | None:
    """Samples/s of the same global batch on one rank over as many steps as ``result`` trained,
    for comparison with ``result``. Both rates leave out the first step (warm-up: allocations,
    thread pools) and saves; None when the run trained fewer than 2 steps (nothing timed).

    The one rank gets the CPU threads of one of the N ranks, as a GPU run compares one GPU
    with N: with all the cores, a CPU baseline measures thread scaling (and OpenMP threads
    spinning for cores other processes hold), not rank scaling."""
    steps = len(result.losses)
    if steps < 2:
        return None
    with tempfile.TemporaryDirectory(prefix="ckptool-scaling-") as tmp:
        one = dataclasses.replace(cfg, out=tmp, nproc=1, steps=steps, lr_decay_steps=cfg.effective_decay(),
                                  warmup_steps=cfg.effective_warmup(), save_every=0, resume=True,
                                  resume_from=None, async_save=False, scaling_check=False,
                                  final_model_only=False)
        base = spawn(one, 1, threads=threads_per_rank(result.world_size))
    ratio = result.samples_per_s / base.samples_per_s if base.samples_per_s else 0.0
    return {"ranks": float(result.world_size), "timed_steps": float(steps - 1),
            "samples_per_s": result.samples_per_s, "samples_per_s_1_rank": base.samples_per_s,
            "speedup": ratio, "efficiency": ratio / result.world_size}

"""A small gloo harness for multi-process tests (CPU only, no mocks).

``run_dist(fn, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing`` (spawn), initializes the default group in each with
``init_process_group("gloo", init_method=f"file://{tmp}/rdzv")``, calls
``fn(rank, world_size, *args)`` and returns the list of the ranks' return values.

Rules for ``fn``:

* define it at module level (spawn pickles it by reference: a lambda or a nested function
  cannot be sent);
* return something picklable (tensors are fine), or None;
* pass an explicit CPU mesh to ``fully_shard`` (``init_device_mesh("cpu", (world_size,))``):
  on a GPU host FSDP2 with a gloo group may otherwise move parameters to CUDA (pytorch#132471).

If any rank raises or dies, the others are stopped and ``run_dist`` raises ``RuntimeError``
with the failing rank's traceback. ``load_tensors(path)`` reads every tensor of a DCP
checkpoint back in full, in this process, for comparisons with ``torch.equal``.

Example::

    def _worker(rank, world_size, out):
        ...                       # build, fully_shard, dcp.save(..., checkpoint_id=out)
        return rank

    def test_save(tmp_path):
        assert run_dist(_worker, 2, str(tmp_path / "ckpt")) == [0, 1]
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # many small ranks share few cores
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # for DCP's async-save process
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmp, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
    # The rank's work is done and its result is on disk. Leave without interpreter finalization:
    # a group still held by a device mesh or DDP is destroyed there among C++ statics, where
    # gloo's joinable threads may call std::terminate ("terminate called without an active
    # exception", SIGABRT) and fail a rank whose work had succeeded (CI, now and then).
    # Python's exit handlers still run (multiprocessing's among them).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_dist(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values.

    Raises:
        RuntimeError: a rank raised or died (its traceback is in the message), or the ranks
            did not finish within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ckptool-dist-") as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world_size, tmp, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run_dist({fn.__name__}) timed out after {timeout:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            done = os.path.exists(os.path.join(tmp, f"result_{e.error_index}.pkl"))
            when = "after its function returned" if done else "before its function returned"
            raise RuntimeError(f"rank {e.error_index} of {fn.__name__} failed ({when}): {e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
            for path in ctx.error_files:  # torch names one per rank and never removes it
                if path and os.path.exists(path):
                    os.unlink(path)
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def load_tensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of the DCP checkpoint at ``path``, in full (key -> tensor), loaded with
    ``dcp.load`` in this process (no process group). Non-tensor entries are left out."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # Our own test output: torch's plain-pickle metadata reader is fine here.
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state

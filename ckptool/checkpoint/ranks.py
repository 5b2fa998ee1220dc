"""What ``Checkpointer`` asks of ``torch.distributed``: rank, world size, barrier, broadcast.

Each works without a process group too (one process: rank 0 of 1), so the same code serves a
single-process script and every rank of an FSDP2 job. Also ``first_line``: torch's exceptions
folded into the one line a ``CkptError`` message quotes.
"""

from __future__ import annotations

from typing import Any


def dist() -> Any:
    """``torch.distributed`` when a default process group is up, else None."""
    import torch.distributed as torch_dist

    return torch_dist if torch_dist.is_available() and torch_dist.is_initialized() else None


def rank() -> int:
    d = dist()
    return d.get_rank() if d else 0


def world_size() -> int:
    d = dist()
    return d.get_world_size() if d else 1


def barrier() -> None:
    d = dist()
    if d:
        d.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (called on all ranks)."""
    d = dist()
    if not d:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def first_line(e: BaseException) -> str:
    """``e``'s message on one line, at most 300 characters (its type name if it has none)."""
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__

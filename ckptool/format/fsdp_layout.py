"""FSDP2's row layout: which rows of a tensor each of N ranks owns (``Shard(0)`` with
``torch.chunk`` semantics), as ``reshard`` and ``import`` write it and ``fully_shard`` holds it.
"""

from __future__ import annotations

from ckptool.format.metadata import Chunk

# ---------------------------------------------------------------------------------------------
# The layout DCP records for FSDP2 on M ranks


def shard_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of an n-row tensor that FSDP2 gives ``rank`` (``torch.chunk`` on dim 0).

    Args:
        n: rows of the tensor (its dim 0).
        world_size: ranks sharing it.
        rank: the rank asked about.

    Returns:
        ``(lo, hi)``; ``ceil(n / world_size)`` rows per rank, the last ranks get fewer or none
        (then ``lo == hi == n``, the offset DCP records for an empty shard).

    Example:
        >>> [shard_rows(10, 4, r) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    per = -(-n // world_size)
    lo = min(rank * per, n)
    return lo, min(lo + per, n)


def fsdp_chunks(shape: tuple[int, ...], world_size: int) -> list[tuple[int, Chunk]]:
    """(rank, chunk) pairs DCP records for an FSDP2 ``Shard(0)`` tensor on ``world_size`` ranks.

    Args:
        shape: the global shape (``()``: a 0-dim tensor, held whole by rank 0).
        world_size: ranks sharing it.

    Returns:
        One chunk per rank that owns rows, in rank order, with ``storage=None``. Empty shards
        all sit at offset ``n`` (as DCP records them); that chunk is recorded once, on the
        lowest empty rank (DCP's ``dedup_save_to_lowest_rank``).

    Example:
        >>> [(r, c.offsets, c.sizes) for r, c in fsdp_chunks((10, 6), 8)][-1]
        (5, (10, 0), (0, 6))
    """
    if not shape:
        return [(0, Chunk((), (), None))]
    out, empty_seen = [], False
    for rank in range(world_size):
        lo, hi = shard_rows(shape[0], world_size, rank)
        if hi == lo:
            if empty_seen:
                continue
            empty_seen = True
        out.append((rank, Chunk((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:], None)))
    return out

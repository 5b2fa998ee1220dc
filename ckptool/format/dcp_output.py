"""The ``.distcp`` files of a new checkpoint: one file per output rank, written on worker threads.

``write_rank_files`` is the one output writer of ``reshard`` and ``import``: rank ``r``'s items
go to ``__r_0.distcp`` in order, each item written by the op's own ``write_item`` (which knows
where its bytes come from); every finished file is fsynced by one flusher thread while the
next ones are written. ``write_tensor`` writes one tensor record whose data arrives in
pieces, computing the record's CRC-32 on the way (and each piece's, for callers that prove
their source's checksums with them). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from ckptool.errors import ConfigError
from ckptool.format.copy_engine import Ticker, fsync_file, run_jobs
from ckptool.format.crc import crc32, crc32_combine
from ckptool.format.dcp_writer import DistcpFile, TensorRecord
from ckptool.format.dtypes import DType
from ckptool.format.metadata import METADATA, StorageRef
from ckptool.storage import BLOCK

Item = TypeVar("Item")
#: ``write_item(file, item, buf)`` appends one item's record; ``buf`` is the worker's block buffer.
ItemWriter = Callable[[DistcpFile, Item, bytearray], None]


@dataclass(frozen=True)
class WrittenFile(Generic[Item]):
    """One output file: its name, size, xxh3-64, and where each of its items went (in order)."""

    name: str
    size: int
    digest: str
    items: list[tuple[Item, StorageRef]]


def check_world_size(world_size: int) -> None:
    """Refuse a rank count that is not a positive int (``ConfigError``)."""
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")


def file_sizes(files: dict[str, tuple[int, str]]) -> dict[str, int]:
    """Name -> size of a written checkpoint's ``.distcp`` files (in name order), then
    ``.metadata``; files in subfolders (assets) and ``ckptool.json`` are left out."""
    sizes = {n: s for n, (s, _) in sorted(files.items()) if n != METADATA and "/" not in n}
    return {**sizes, METADATA: files[METADATA][0]}


def rank_file_name(rank: int) -> str:
    """The file DCP's ``FileSystemWriter`` gives rank ``rank`` (one file per rank)."""
    return f"__{rank}_0.distcp"


def write_rank_files(folder: Path, ranks: list[list[Item]], write_item: ItemWriter, *,
                     ticker: Ticker, workers: int) -> list[WrittenFile[Item]]:
    """Write ``folder/__r_0.distcp`` holding ``ranks[r]``'s items, for every rank.

    Args:
        folder: the (temporary) output folder.
        ranks: per output rank, its items in file order.
        write_item: appends one item's record to the open file.
        ticker: progress and the abort flag shared with ``write_item``.
        workers: files written at once (each with one ``BLOCK`` buffer).

    Returns:
        One ``WrittenFile`` per rank, in rank order; every file is fsynced.
    """
    with ThreadPoolExecutor(1) as flusher:  # fsync finished files while the next ones copy
        flushed: list[Future] = []

        def one(rank: int) -> WrittenFile[Item]:
            done = _write_file(folder / rank_file_name(rank), ranks[rank], write_item)
            flushed.append(flusher.submit(fsync_file, folder / done.name))
            return done

        results = run_jobs(ticker, one, list(range(len(ranks))), workers)
        for f in flushed:
            f.result()
    return results


def _write_file(path: Path, items: list[Item], write_item: ItemWriter) -> WrittenFile[Item]:
    placed = []
    buf = bytearray(BLOCK)
    with DistcpFile(path) as f:
        for item in items:
            start = f.size
            write_item(f, item, buf)
            placed.append((item, StorageRef(f.name, start, f.size - start)))
        f.close(sync=False)
    return WrittenFile(f.name, f.size, f.digest, placed)


def write_tensor(f: DistcpFile, dtype: DType, sizes: tuple[int, ...],
                 pieces: Iterable[Iterable[Any]], tick: Callable[[int], None]
                 ) -> list[tuple[int, int]]:
    """Append the ``torch.save`` record of a tensor whose row-major data comes in ``pieces``.

    Args:
        f: the open output file.
        dtype, sizes: the record's element type and shape.
        pieces: the data, each piece an iterable of buffers (e.g. blocks of one source range).
        tick: called with each buffer's length after it is written (progress, abort).

    Returns:
        ``(crc32, length)`` of every piece, in order; the record's CRC-32 is their combination.
    """
    rec = TensorRecord(dtype, sizes)
    f.write(rec.head)
    crc, parts = 0, []
    for piece in pieces:
        part = length = 0
        for data in piece:
            part = crc32(data, part)
            f.write(data)
            length += len(data)
            tick(len(data))
            del data  # before the next block is made (a cast allocates)
        parts.append((part, length))
        crc = crc32_combine(crc, part, length)
    f.write(rec.tail(crc))
    return parts


def local_workers(is_local: bool = True) -> int:
    """Files written at once: up to 4 (pread, write and CRC-32 drop the GIL); 1 for remote input."""
    return min(os.cpu_count() or 1, 4) if is_local else 1

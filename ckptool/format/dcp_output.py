"""The ``.distcp`` files of a new checkpoint: one file per output rank, written on worker threads.

``write_rank_files`` is the one output writer of ``reshard`` and ``import``: rank ``r``'s items
go to ``__r_0.distcp`` in order, each item written by the op's own ``write_item`` (which knows
where its bytes come from); every finished file is fsynced by one flusher thread while the
next ones are written. With ``check``, each record is read back right after it is written,
while the page cache still holds it: it must parse, hold the dtype and shape planned (or a
value), and every entry's CRC-32 must match the bytes in the file (what ``validate --deep``
checks of a record), so verification overlaps the copy instead of re-reading the output;
what each record was found to hold is kept (``WrittenFile.checked``) so that the final check
of the index (``read_back_crc``) reads nothing again.
``write_tensor`` writes one tensor record whose data arrives in pieces, computing the record's
CRC-32 on the way (and each piece's, for callers that prove their source's checksums with
them). Torch-free.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ckptool.errors import CkptError, ConfigError
from ckptool.format.copy_engine import Ticker, fsync_file, run_jobs, unverified
from ckptool.format.crc import crc32, crc32_combine
from ckptool.format.dcp_writer import DistcpFile, TensorRecord
from ckptool.format.dtypes import DType
from ckptool.format.metadata import METADATA, StorageRef, TensorEntry
from ckptool.format.torch_records import RecordReader, RecordTemplate, TensorLocation, record_outside
from ckptool.storage import BLOCK, RangeReader, Storage

Item = TypeVar("Item")
#: ``write_item(file, item, buf)`` appends one item's record; ``buf`` is the worker's block buffer.
#: It returns True when the record's data in the file is proven to hold the bytes its CRC-32
#: was computed from (the copy compared with the source's bytes, or its CRC-32 with the
#: source's stored one): the read-back then skips the data.
ItemWriter = Callable[[DistcpFile, Item, bytearray], bool | None]
#: ``prefetch(item)`` asks the OS to read an item's source ahead; it returns the bytes asked.
Prefetch = Callable[[Item], int]
#: Source bytes each file's writer keeps asked for ahead of the item it copies (``prefetch``):
#: enough for the copies to go on through a disk cache flush, which stalls reads too (import
#: of 2.2 GB to 8 ranks, cold, 4 interleaved runs: median 6.71 s with 128 MiB, 7.06 s with
#: 32 MiB; 512 MiB gained nothing).
PREFETCH_AHEAD = 128 << 20
#: What a record must hold: (dtype, shape) of a tensor, None for a non-tensor value.
Expected = tuple[DType, tuple[int, ...]] | None
#: Records up to this size are read back in one call.
_PRELOAD = 1 << 20


@dataclass(frozen=True)
class FileRange:
    """A piece of tensor data that is ``length`` bytes at ``offset`` of the open local file
    ``fd`` (copied in the kernel by ``write_tensor``); ``where`` names the file for errors.
    ``read_back``: its CRC-32 is computed from the copy in the output, not from ``fd`` (for a
    caller that compares it with the source's stored CRC-32). ``compare``: the copy is read
    too and must equal the source's bytes (for a source with no stored checksum)."""

    fd: int
    offset: int
    length: int
    where: str
    read_back: bool = False
    compare: bool = False


#: What reading a tensor record back found: (CRC-32, length, shape) of its data, for a
#: record whose data entry is exactly the tensor's row-major bytes.
Checked = tuple[int, int, tuple[int, ...]]


@dataclass(frozen=True)
class WrittenFile(Generic[Item]):
    """One output file: its name, size, xxh3-64, where each of its items went (in order), and
    (when read back) what each tensor record was found to hold, by (offset, length)."""

    name: str
    size: int
    digest: str
    items: list[tuple[Item, StorageRef]]
    checked: dict[tuple[int, int], Checked] = field(default_factory=dict)


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
                     ticker: Ticker, workers: int,
                     check: Callable[[Item], Expected] | None = None,
                     meanwhile: Callable[[list[WrittenFile[Item]]], None] | None = None,
                     prefetch: Prefetch | None = None) -> list[WrittenFile[Item]]:
    """Write ``folder/__r_0.distcp`` holding ``ranks[r]``'s items, for every rank.

    Args:
        folder: the (temporary) output folder.
        ranks: per output rank, its items in file order.
        write_item: appends one item's record to the open file.
        ticker: progress and the abort flag shared with ``write_item``.
        workers: files written at once (each with one ``BLOCK`` buffer).
        check: if given, read every record back after writing it; ``check(item)`` says what
            it must hold.
        meanwhile: called with the written files once all are written, while the last ones
            are still being fsynced (the disk's cache flush leaves the CPU idle): the index,
            the verification. Nothing it does may need the files durable.
        prefetch: if given, each file's writer keeps the sources of its next items asked
            for, ``PREFETCH_AHEAD`` bytes ahead, so that a cold source is read from disk
            while earlier items are copied (a rank's rows of one tensor after another are
            small ranges far apart, which the kernel's read-ahead does not foresee).

    Returns:
        One ``WrittenFile`` per rank, in rank order; every file is fsynced (also when
        ``meanwhile`` raises: the error is raised after the fsyncs).

    Raises:
        CorruptCheckpointError: a record read back differs from what was written (``check``).
    """
    with ThreadPoolExecutor(1) as flusher:  # fsync finished files while the next ones copy
        flushed: list[Future] = []

        def one(rank: int) -> WrittenFile[Item]:
            done = _write_file(folder / rank_file_name(rank), ranks[rank], write_item, check,
                               _Ahead(ranks[rank], prefetch))
            flushed.append(flusher.submit(fsync_file, folder / done.name))
            return done

        results = run_jobs(ticker, one, list(range(len(ranks))), workers)
        if meanwhile is not None:
            meanwhile(results)
        for f in flushed:
            f.result()
    return results


class _Ahead(Generic[Item]):
    """Keeps the sources of a file's next items asked for: ``PREFETCH_AHEAD`` bytes asked and
    not yet written (the item being written included)."""

    def __init__(self, items: list[Item], prefetch: Prefetch | None) -> None:
        self.items = items
        self.prefetch = prefetch
        self.next = 0  # the first item not asked for yet
        self.asked: deque[tuple[int, int]] = deque()  # (item index, bytes) asked, not written
        self.bytes = 0

    def before(self, k: int) -> None:
        """Item ``k`` is about to be written: it and the next ones are asked for."""
        if self.prefetch is None:
            return
        while self.asked and self.asked[0][0] < k:
            self.bytes -= self.asked.popleft()[1]
        while self.next < len(self.items) and (self.next <= k or self.bytes < PREFETCH_AHEAD):
            n = self.prefetch(self.items[self.next])
            self.asked.append((self.next, n))
            self.bytes += n
            self.next += 1


def _write_file(path: Path, items: list[Item], write_item: ItemWriter,
                check: Callable[[Item], Expected] | None, ahead: _Ahead[Item]
                ) -> WrittenFile[Item]:
    placed, checked = [], {}
    templates: dict[tuple[Expected, int], RecordTemplate] = {}
    buf = bytearray(BLOCK)
    with DistcpFile(path) as f, ExitStack() as stack:
        back = stack.enter_context(Storage.open(path.parent).reader(f.name)) if check else None
        for k, item in enumerate(items):
            ahead.before(k)
            start = f.size
            proven = write_item(f, item, buf)
            ref = StorageRef(f.name, start, f.size - start)
            if back is not None:
                found = check_record(back, ref, check(item), buf,  # type: ignore[misc]
                                     data=not proven, templates=templates)
                if found is not None:
                    checked[(ref.offset, ref.length)] = found
            placed.append((item, ref))
        f.close(sync=False)
    return WrittenFile(f.name, f.size, f.digest, placed, checked)


def check_record(reader: RangeReader, ref: StorageRef, expected: Expected,
                 buf: bytearray, *, data: bool = True,
                 templates: dict[tuple[Expected, int], RecordTemplate] | None = None
                 ) -> Checked | None:
    """Read one record back: it parses, holds ``expected`` and every entry's CRC-32 matches.

    Args:
        reader: the output file, open for reading.
        ref: where the record lies in it.
        expected: (dtype, shape) of the tensor it must hold; None for a non-tensor value.
        buf: a reused block buffer (the data is read into it, nothing else is allocated).
        data: check the CRC-32 of a tensor's data entry too (False: the writer computed it
            from these bytes and proved it already).
        templates: records already checked in full, by (``expected``, length). With
            ``data`` False, a record of the same key is read outside its data only and must
            equal that one's bytes but for the data's and the serialization id's CRC-32
            fields, which must agree (``RecordTemplate``, the shortcut ``validate --deep``
            takes); anything else is parsed in full, and then becomes the template of its key.

    Returns:
        For a tensor record whose data entry is exactly the tensor's bytes, what it holds
        (``Checked``: its data's stored CRC-32, now proven); else None.

    Raises:
        CorruptCheckpointError: "verification failed, nothing was committed: ..." naming the
            file and the problem.
    """
    key = (expected, ref.length)
    shortcut = templates if not data else None
    tpl = shortcut.get(key) if shortcut is not None else None
    if tpl is not None:
        outside = record_outside(reader, ref, tpl.data_start, tpl.loc.nbytes)
        if outside is not None and tpl.matches(outside) and tpl.crc_ok(outside):
            return tpl.data_crc(outside), tpl.loc.nbytes, tpl.loc.shape
    found, parsed = _check_in_full(reader, ref, expected, buf, data)
    if parsed is not None and shortcut is not None and key not in shortcut:
        rec, loc = parsed
        outside = record_outside(reader, ref, loc.data_offset - ref.offset, loc.nbytes)
        if outside is not None:
            shortcut[key] = RecordTemplate(rec, loc, outside, data_left_out=True)
    return found


def _check_in_full(reader: RangeReader, ref: StorageRef, expected: Expected, buf: bytearray,
                   data: bool) -> tuple[Checked | None, tuple[RecordReader, TensorLocation] | None]:
    """``check_record`` by parsing the record: what it found, and (when that is a tensor's
    plain data) the record and tensor to make a template of."""
    where = f"{reader.storage.url_of(ref.relative_path)} (record at byte {ref.offset})"
    problem, found, parsed = None, None, None
    try:
        rec = RecordReader(reader, ref, where, preload=_PRELOAD)
        skip = None
        if expected is None:
            rec.load_object()
        else:
            loc = rec.tensor()
            skip = None if data else loc.entry.name
            if loc.contiguous and loc.storage_offset == 0 and loc.entry.size == loc.nbytes:
                found, parsed = (loc.entry.crc, loc.entry.size, loc.shape), (rec, loc)
            if (loc.dtype, loc.shape) != expected:
                problem = (f"{where} holds {loc.dtype} {list(loc.shape)}, written as {expected[0]} "
                           f"{list(expected[1])}")
        rec.verify_structure()
        for e in rec.entries.values():
            if e.name == skip:
                continue
            crc = _crc_at(reader, rec.data_offset(e), e.size, buf)
            if crc != e.crc:
                got = "past the end of the file" if crc is None else f"{crc:08x}"
                problem = f"{where}: CRC-32 mismatch in {e.name} (stored {e.crc:08x}, read {got})"
    except CkptError as e:
        problem = str(e)
    if problem is not None:
        raise unverified(where, problem)
    return found, parsed


def read_back_crc(t: TensorEntry, written: dict[str, WrittenFile[Any]]
                  ) -> tuple[int, int] | None:
    """(CRC-32, length) of tensor ``t`` of a written index, in row-major order, from what its
    records held when read back as written (``WrittenFile.checked``; no file is read again);
    None when some chunk's record was not read back so, or holds another shape (the caller
    reads the tensor then)."""
    blocks = t.row_blocks()
    if blocks is None:
        return None
    crc = size = 0
    for c in blocks:
        ref = c.storage
        w = written.get(ref.relative_path) if ref is not None else None
        got = w.checked.get((ref.offset, ref.length)) if w is not None else None  # type: ignore[union-attr]
        if got is None or got[2] != c.sizes:
            return None
        crc, size = crc32_combine(crc, got[0], got[1]), size + got[1]
    return crc, size


def _crc_at(reader: RangeReader, pos: int, size: int, buf: bytearray) -> int | None:
    """CRC-32 of ``size`` bytes at ``pos``, read into ``buf`` block by block; None if the
    file ends before."""
    crc, view, fd = 0, memoryview(buf), reader.fileno
    while size:
        want = min(size, len(buf))
        data = (view[:os.preadv(fd, [view[:want]], pos)] if fd is not None
                else reader.pread(pos, want))
        if not data:
            return None
        crc = crc32(data, crc)
        pos, size = pos + len(data), size - len(data)
    return crc


def write_tensor(f: DistcpFile, dtype: DType, sizes: tuple[int, ...],
                 pieces: Iterable[FileRange | Iterable[Any]], tick: Callable[[int], None],
                 buf: bytearray, *, compare: bool = False) -> list[tuple[int, int]]:
    """Append the ``torch.save`` record of a tensor whose row-major data comes in ``pieces``.

    Args:
        f: the open output file.
        dtype, sizes: the record's element type and shape.
        pieces: the data, each piece a ``FileRange`` (copied in the kernel, then re-read for
            its CRC-32: from its file, or from ``f`` with ``read_back``) or an iterable of
            buffers (e.g. casts of source blocks).
        tick: called with each block's length after it is written (progress, abort).
        buf: the worker's block buffer (for ``FileRange`` pieces).
        compare: read each buffer of an iterable piece back as it is written and require it
            equal (``FileRange`` pieces say for themselves).

    Returns:
        ``(crc32, length)`` of every piece, in order; the record's CRC-32 is their combination.
    """
    rec = TensorRecord(dtype, sizes)
    f.write(rec.head)
    crc, parts = 0, []
    for piece in pieces:
        part = length = 0
        copied = isinstance(piece, FileRange)
        blocks = (f.copy_range(piece.fd, piece.offset, piece.length, buf, piece.where,
                               read_back=piece.read_back, compare=piece.compare)
                  if isinstance(piece, FileRange) else piece)
        for data in blocks:
            part = crc32(data, part)
            if not copied:
                f.write(data, compare=compare)
            length += len(data)
            tick(len(data))
            del data  # before the next block is made (a cast allocates)
        parts.append((part, length))
        crc = crc32_combine(crc, part, length)
    f.write(rec.tail(crc))
    return parts


def local_workers(is_local: bool = True) -> int:
    """Files written at once: 4 for local input, even on fewer cores (pread, write and CRC-32
    drop the GIL, and a cold source keeps a worker waiting on the disk: an 8-to-4 reshard of
    2.2 GB cold took a median 6.1 s with 4, 8.1 s with 2 on 2 cores); 1 for remote input."""
    return 4 if is_local else 1

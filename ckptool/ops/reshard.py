"""Rewrite a DCP checkpoint for another rank count, offline, streaming, byte-exact.

Output rank ``r`` of ``M`` gets one file, ``__r_0.distcp``, holding exactly what it owns under
FSDP2's layout for ``M`` ranks: every tensor ``Shard(0)`` with ``torch.chunk`` semantics
(``ceil(n/M)`` rows per rank, a ragged last shard, empty shards when rows < M, recorded once at
offset ``n`` as DCP records them), model and optimizer alike. 0-dim tensors (``step``), tensors
a multi-rank source kept whole (replicated buffers) and non-tensor values (``param_groups``)
go to rank 0's file, as DCP's planner with ``dedup_save_to_lowest_rank`` does. A one-rank
source cannot tell parameters from buffers, so all its tensors with dims are sharded.

Bytes move without torch, through ``format/dcp_output.py`` (the writer ``import`` shares): an
output row block is contiguous byte ranges of the source's row-block records, copied in the
kernel 512 KiB at a time (``os.copy_file_range``) and re-read from the output (page cache)
for the new record's CRC-32; these pieces, combined with ``crc32_combine``, must equal every
source record's stored CRC-32, which proves the source and the copy in one read: damaged
input is refused, never laundered, and the record's data needs no read-back. A range with no
stored CRC-32 to meet (DCP's safetensors storage) has its copy compared with the source's
bytes as it is made, when verifying. Other chunk layouts (e.g. 2-D sharding, strided
records) are assembled one output chunk at a time with numpy.
Verification reads each record back right after it is written (page cache: parse, dtype and
shape, CRC-32 of every entry against the bytes in the file, but for data proven as above),
then, while the files are fsynced, validates the output's index and compares each tensor's
CRC-32 over its row-major bytes, source vs the records the index names, derived from the
verified per-record CRCs (no extra read).

A local source that fits in half the available memory is read into the page cache front to
back on a thread of its own as the copy starts (``storage.readahead``).

Peak memory: one 8 MiB buffer per worker, plus one output chunk for non-row-block layouts.
Output goes to a temporary folder renamed at the end (``atomic_path``): ``.distcp`` files
(fsynced; ``.metadata`` is written while the last of them are), then ``ckptool.json``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any
from pathlib import Path

from ckptool._version import __version__
from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.format import manifest as mf
from ckptool.format.dcp_output import (Expected, FileRange, WrittenFile, check_world_size,
                                       file_sizes, local_workers, read_back_crc,
                                       write_rank_files, write_tensor)
from ckptool.format.dcp_writer import DistcpFile, write_metadata
from ckptool.format.fsdp_layout import fsdp_chunks
from ckptool.format.checkpoint_dirs import CheckpointDir, resolve_checkpoint, step_of
from ckptool.format.metadata import (METADATA, BytesEntry, CheckpointMetadata, Chunk,
                                     TensorEntry)
from ckptool.format.reader import CheckpointReader
from ckptool.format.copy_engine import Progress, Ticker, fsync_file, new_output_folder, unverified
from ckptool.format.row_source import (ByteRange, RowSource, read_blocks, tensor_crc,
                                       tensor_digest)
from ckptool.storage import Storage, atomic_path
from ckptool.storage.readahead import read_ahead



@dataclass(frozen=True)
class ReshardResult:
    """What ``reshard`` wrote.

    Attributes:
        source, destination: the folders read and written.
        source_world_size: ranks that saved the source (None if its file names do not say).
        world_size: ranks of the output (its number of ``.distcp`` files).
        tensors, objects: items written (tensors and non-tensor values).
        bytes: tensor data bytes copied.
        files: output file name -> size in bytes (``.distcp`` files and ``.metadata``).
        seconds: wall time, verification included.
        verified: every record was read back as written and passed ``validate --deep``'s
            record checks, the output validates, and per-tensor checksums match.
    """

    source: str
    destination: str
    source_world_size: int | None
    world_size: int
    tensors: int
    objects: int
    bytes: int
    files: dict[str, int]
    seconds: float
    verified: bool


def reshard(src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *,
            world_size: int, expect_from: int | None = None, force: bool = False,
            verify: bool = True, progress: Progress | None = None) -> ReshardResult:
    """Rewrite checkpoint ``src`` so that rank r of ``world_size`` ranks reads one file.

    Args:
        src: a committed DCP checkpoint folder (``step_N``, ``step-N`` or plain; also DCP's
            safetensors storage, whose ranges are copied as they are), local or URL.
        dst: a local folder to create; default: ``default_destination(src, world_size)``.
        world_size: ranks of the new layout (1 gives a single-file checkpoint).
        expect_from: if given, the rank count ``src`` must have been saved with.
        force: replace an existing ``dst``.
        verify: read every record back as it is written (``validate --deep``'s record
            checks), validate the output and compare per-tensor checksums with the source
            before committing it.
        progress: called as ``progress(bytes_done, bytes_total)`` from the calling thread; an
            exception it raises aborts and removes the partial output.

    Returns:
        A ``ReshardResult``.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: the source
            fails ``validate`` (first problem in the message) or its bytes are damaged.
        IncompatibleCheckpointError: ``expect_from`` differs from the source's rank count, or
            the source holds something this writer cannot express.
        ConfigError: bad ``world_size``, ``dst`` exists (without ``force``), is remote, or
            is (or contains) ``src``.
        CorruptCheckpointError: verification of the output failed (nothing is committed).

    Example:
        >>> r = reshard("runs/demo/step_40", world_size=4, expect_from=8)
        >>> r.destination, r.files
    """
    t0 = time.perf_counter()
    check_world_size(world_size)
    ckpt, meta = _open_source(src)
    n_src = _source_world_size(ckpt, meta, expect_from)
    out = _destination(ckpt, dst, world_size, force)
    plan = _plan_ranks(meta, world_size, source_world_size=n_src)
    with CheckpointReader(ckpt.storage, meta) as ck, atomic_path(out) as tmp:
        tmp.mkdir()
        files = _write_output(RowSource(ck, track=True), tmp, plan, out=out, verify=verify,
                              progress=progress)
        _write_manifest(ckpt, tmp, world_size, n_src, files)
    return ReshardResult(
        source=ckpt.url, destination=str(out), source_world_size=n_src, world_size=world_size,
        tensors=len(meta.tensors), objects=len(meta.objects),
        bytes=sum(t.nbytes for t in meta.tensors.values()),
        files=file_sizes(files), seconds=time.perf_counter() - t0, verified=verify)


def _write_output(source: RowSource, tmp: Path, plan: list[list[_Item]], *, out: Path,
                  verify: bool, progress: Progress | None) -> dict[str, tuple[int, str]]:
    """The ``.distcp`` files and ``.metadata`` in ``tmp`` (verified if asked): name -> (size,
    xxh3-64)."""
    ticker = Ticker(progress, sum(t.nbytes for t in source.ck.meta.tensors.values()))
    if source.ck.storage.is_local:  # the whole source, if it fits in memory
        read_ahead([source.ck.storage.path(rel) for rel in source.ck.meta.files()])

    def index_and_verify(written: list[WrittenFile[_Item]]) -> None:  # while files are fsynced
        source.check_crcs()
        write_metadata(tmp, _output_metadata(source.ck.meta, written), checkpoint_id=str(out),
                       sync=False)
        if verify:
            _verify(source, tmp, written)
        fsync_file(tmp / METADATA)

    written = write_rank_files(tmp, plan, _Copier(source, ticker, compare=verify).write_item, ticker=ticker,
                               workers=local_workers(source.ck.storage.is_local),
                               check=partial(_expected, source.ck.meta) if verify else None,
                               meanwhile=index_and_verify)
    files = {w.name: (w.size, w.digest) for w in written}
    files[METADATA] = mf.file_checksum(Storage.open(tmp), METADATA)
    return files


# ---------------------------------------------------------------------------------------------
# Source and destination


def _open_source(src: str | os.PathLike[str]) -> tuple[CheckpointDir, CheckpointMetadata]:
    """Resolve and structurally validate ``src``; raise validate's first finding."""
    from ckptool.ops.validate import require_valid

    ckpt = resolve_checkpoint(src)
    if ckpt.kind == "accelerate":
        raise IncompatibleCheckpointError(
            f"{ckpt.url} is Accelerate save_state output with parts {list(ckpt.parts)}",
            path=ckpt.url, hint=f"Reshard each part on its own, e.g. 'ckptool reshard "
                                f"{ckpt.url}/{ckpt.parts[0]} --to N'")
    report = require_valid(ckpt, action="reshard")
    return ckpt, report.metadata[""]


def _source_world_size(ckpt: CheckpointDir, meta: CheckpointMetadata,
                       expect_from: int | None) -> int | None:
    n = meta.world_size
    if n is None:
        manifest = mf.read_manifest(ckpt.storage)
        n = manifest.world_size if manifest is not None else None
    if expect_from is not None and n != expect_from:
        if n is None:
            raise IncompatibleCheckpointError(
                f"{ckpt.url}: cannot check --from {expect_from}, its file names do not say how "
                "many ranks saved it", path=ckpt.url, hint="Drop --from")
        raise IncompatibleCheckpointError(
            f"{ckpt.url} was saved by {n} ranks, not {expect_from}", path=ckpt.url,
            hint=f"Pass --from {n} (or leave --from out); nothing was written")
    return n


def default_destination(src: str | os.PathLike[str], world_size: int) -> Path:
    """Where ``reshard`` writes when no destination is given.

    A step checkpoint of a run goes to a new run folder beside the run, under the same step
    name (``runs/demo/step_300`` -> ``runs/demo-ws4/step_300``), where ``ckptool train --out
    runs/demo-ws4 --nproc 4`` resumes from it; never into the source run, where resume and
    retention would take it for one of that run's checkpoints. Any other folder gets a
    sibling ``<name>-ws<world_size>``.

    Args:
        src: a local checkpoint folder.
        world_size: the new rank count.

    Example:
        >>> default_destination("runs/demo/step_1000", 4).parts[-2:]
        ('demo-ws4', 'step_1000')
    """
    p = Path(os.path.abspath(os.fspath(src))).resolve()
    if step_of(p.name) is not None:
        return p.parent.with_name(f"{p.parent.name}-ws{world_size}") / p.name
    return p.with_name(f"{p.name}-ws{world_size}")


def _destination(ckpt: CheckpointDir, dst: str | os.PathLike[str] | None, world_size: int,
                 force: bool) -> Path:
    if dst is None:
        if not ckpt.storage.is_local:
            raise ConfigError(f"{ckpt.url} is remote; give a local DST folder")
        dst = default_destination(ckpt.url, world_size)
    source = Path(ckpt.url).resolve() if ckpt.storage.is_local else None
    return new_output_folder(dst, force=force, verb="reshard", source=source)


# ---------------------------------------------------------------------------------------------
# Planning (metadata only)


@dataclass(frozen=True)
class _Item:
    fqn: str
    chunk: Chunk | None  # None for a non-tensor value


def _plan_ranks(meta: CheckpointMetadata, world_size: int, *,
               source_world_size: int | None) -> list[list[_Item]]:
    """What each output rank's file holds: objects first (rank 0), then tensors in index order."""
    ranks: list[list[_Item]] = [[] for _ in range(world_size)]
    ranks[0] += [_Item(fqn, None) for fqn in meta.objects]
    for fqn, t in meta.tensors.items():
        if _replicated(t, source_world_size):
            ranks[0].append(_Item(fqn, Chunk((0,) * len(t.shape), t.shape, None)))
            continue
        for rank, chunk in fsdp_chunks(t.shape, world_size):
            ranks[rank].append(_Item(fqn, chunk))
    return ranks


def _replicated(t: TensorEntry, source_world_size: int | None) -> bool:
    """Saved whole, once, by a multi-rank job: not an FSDP parameter (e.g. a buffer)."""
    return (bool(t.shape) and (source_world_size or 1) > 1 and len(t.chunks) == 1
            and t.chunks[0].sizes == t.shape)


def _output_metadata(meta: CheckpointMetadata,
                     written: list[WrittenFile[_Item]]) -> CheckpointMetadata:
    chunks: dict[str, list[Chunk]] = defaultdict(list)
    objects: dict[str, BytesEntry] = {}
    for w in written:
        for item, ref in w.items:
            if item.chunk is None:
                objects[item.fqn] = BytesEntry(item.fqn, ref)
            else:
                chunks[item.fqn].append(Chunk(item.chunk.offsets, item.chunk.sizes, ref))
    tensors = {fqn: TensorEntry(fqn, t.dtype, t.shape, tuple(chunks[fqn]))
               for fqn, t in meta.tensors.items()}
    return CheckpointMetadata(tensors=tensors, objects={k: objects[k] for k in meta.objects},
                              planner_data=meta.planner_data, version=meta.version,
                              save_id=str(uuid.uuid4()))


def _expected(meta: CheckpointMetadata, item: _Item) -> Expected:
    """What ``item``'s record must hold when read back (None: a non-tensor value)."""
    return None if item.chunk is None else (meta.tensors[item.fqn].dtype, item.chunk.sizes)


def _write_manifest(ckpt: CheckpointDir, tmp: Path, world_size: int, n_src: int | None,
                    files: dict[str, tuple[int, str]]) -> None:
    old = mf.read_manifest(ckpt.storage)
    source = {"path": ckpt.url, "world_size": n_src, "operation": "reshard"}
    manifest = mf.Manifest(
        step=old.step if old is not None else step_of(ckpt.name), world_size=world_size,
        files={name: {"size": size, mf.CHECKSUM: digest} for name, (size, digest) in files.items()},
        loss=old.loss if old is not None else None, config=old.config if old is not None else {},
        source=source, created=time.time(), ckptool_version=__version__)
    mf.write_manifest(Storage.open(tmp), manifest)


# ---------------------------------------------------------------------------------------------
# Copying


class _Copier:
    """Writes reshard's items from a tracked ``RowSource``, keeping the CRC-32 of every source
    piece read so that ``check_crcs`` proves each source record. ``compare``: a copied piece
    with no stored CRC-32 to meet is read back and compared with the source as it is made."""

    def __init__(self, src: RowSource, ticker: Ticker, *, compare: bool) -> None:
        self.src = src
        self.ticker = ticker
        self.compare = compare

    def write_item(self, f: DistcpFile, item: _Item, buf: bytearray) -> bool:
        """Append ``item``'s record; True when every data byte of it in ``f`` is proven (read
        back: its CRC-32 goes to ``check_crcs``, or it was compared with the source), so the
        record's data needs no second read."""
        if item.chunk is None:
            ref = self.src.ck.meta.objects[item.fqn].storage
            self.src.ck.record(ref, item.fqn).verify_crc()  # type: ignore[arg-type]
            f.write(self.src.ck.object_bytes(item.fqn))
            return False
        t, chunk = self.src.ck.meta.tensors[item.fqn], item.chunk
        lo = chunk.offsets[0] if chunk.offsets else 0
        ranges: list[ByteRange | None] = []

        def pieces() -> Iterator[FileRange | Iterable[Any]]:
            for piece in self.src.pieces_of(t, lo, lo + (chunk.sizes[0] if chunk.sizes else 1)):
                ranges.append(piece if isinstance(piece, ByteRange) else None)
                if not isinstance(piece, ByteRange):
                    yield (piece,)
                elif piece.reader.fileno is None:  # remote: read block by block
                    yield read_blocks(piece, buf)
                else:  # with a stored CRC-32 to meet, the copy's bytes are checked, not the source's
                    yield FileRange(piece.reader.fileno, piece.start, piece.length,
                                    piece.reader.storage.url_of(piece.reader.rel),
                                    read_back=piece.key is not None,
                                    compare=piece.key is None and self.compare)

        parts = write_tensor(f, t.dtype, chunk.sizes, pieces(), self.ticker.add, buf)
        for r, (crc, _) in zip(ranges, parts):
            if r is not None and r.key is not None:
                self.src.pieces.append((r.key, r.rel, r.length, crc))
        return all(r is not None and r.reader.fileno is not None
                   and (r.key is not None or self.compare) for r in ranges)


# ---------------------------------------------------------------------------------------------
# Verification


def _verify(src: RowSource, folder: Path, written: list[WrittenFile[_Item]]) -> None:
    """Validate the output (its records were deep-checked as they were written: parsed, dtype
    and shape, CRC-32 of every entry); then each tensor's row-major CRC-32, from the records
    the written index points to, must equal the source's."""
    from ckptool.ops.validate import validate

    report = validate(str(folder))
    if not report.ok:
        raise unverified(str(folder), report.errors[0].message)
    files = {w.name: w for w in written}
    with CheckpointReader(Storage.open(folder), report.metadata[""]) as ck:
        out = RowSource(ck)
        for fqn, t in src.ck.meta.tensors.items():
            o = ck.meta.tensors[fqn]
            a, b = tensor_crc(src, t), read_back_crc(o, files)
            if b is None:  # a record not read back as written: parse it
                b = tensor_crc(out, o)
            if a is None:  # a source record whose CRC does not cover exactly the tensor
                a, b = tensor_digest(RowSource(src.ck), t), tensor_digest(out, o)
            if a != b:
                raise unverified(str(folder), f"{fqn} differs from the source ({b} != {a})")



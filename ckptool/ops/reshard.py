"""Rewrite a DCP checkpoint for another rank count, offline, streaming, byte-exact.

Output rank ``r`` of ``M`` gets one file, ``__r_0.distcp``, holding exactly what it owns under
FSDP2's layout for ``M`` ranks: every tensor ``Shard(0)`` with ``torch.chunk`` semantics
(``ceil(n/M)`` rows per rank, a ragged last shard, empty shards when rows < M, recorded once at
offset ``n`` as DCP records them), model and optimizer alike. 0-dim tensors (``step``), tensors
a multi-rank source kept whole (replicated buffers) and non-tensor values (``param_groups``)
go to rank 0's file, as DCP's planner with ``dedup_save_to_lowest_rank`` does. A one-rank
source cannot tell parameters from buffers, so all its tensors with dims are sharded.

Bytes move without torch: an output row block is contiguous byte ranges of the source's
row-block records, copied in 8 MiB blocks (``os.preadv``/``os.write``) while the new record's
CRC-32 is computed; every source record's stored CRC-32 is checked on the way (pieces combined
with ``crc32_combine``), so damaged input is refused, never laundered. Other chunk layouts
(e.g. 2-D sharding, strided records) are assembled one output chunk at a time with numpy.
Verification deep-validates the output, then compares each tensor's CRC-32 over its row-major
bytes, source vs output, derived from the verified per-record CRCs (no extra read).

Peak memory: one 8 MiB buffer per worker, plus one output chunk for non-row-block layouts.
Output goes to a temporary folder renamed at the end (``atomic_path``): ``.distcp`` files
(fsynced), then ``.metadata``, then ``ckptool.json``.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ckptool._version import __version__
from ckptool.errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import manifest as mf
from ckptool.format.dcp_writer import (DistcpFile, TensorRecord, crc32_combine, fsdp_chunks,
                                       write_metadata)
from ckptool.format.items import crc32
from ckptool.format.layout import CheckpointDir, resolve_checkpoint, step_of
from ckptool.format.metadata import (METADATA, BytesEntry, CheckpointMetadata, Chunk, StorageRef,
                                     TensorEntry)
from ckptool.format.reader import CheckpointReader, ChunkBytes
from ckptool.storage import BLOCK, RangeReader, Storage, atomic_path, is_url

Progress = Callable[[int, int], None]
_FADVISE = hasattr(os, "posix_fadvise")


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
        verified: the output passed ``validate --deep`` and per-tensor checksums match.
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

    Peak memory is one 8 MiB buffer per worker (plus one output chunk for chunk layouts that
    are not FSDP2 row blocks); it does not grow with the model.

    Args:
        src: a committed DCP checkpoint folder (``step_N``, ``step-N`` or plain; also DCP's
            safetensors storage, whose ranges are copied as they are), local or URL.
        dst: a local folder to create; default: ``default_destination(src, world_size)``.
        world_size: ranks of the new layout (1 gives a single-file checkpoint).
        expect_from: if given, the rank count ``src`` must have been saved with.
        force: replace an existing ``dst``.
        verify: deep-validate the output and compare per-tensor checksums with the source
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
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    ckpt, meta = _open_source(src)
    n_src = _source_world_size(ckpt, meta, expect_from)
    out = _destination(ckpt, dst, world_size, force)
    plan = _plan_ranks(meta, world_size, source_world_size=n_src)
    with CheckpointReader(ckpt.storage, meta) as ck, atomic_path(out) as tmp:
        tmp.mkdir()
        ticker = _Ticker(progress, sum(t.nbytes for t in meta.tensors.values()))
        source = _Source(ck, track=True)
        written = _Copier(source, ticker).run(tmp, plan)
        meta_size = write_metadata(tmp, _output_metadata(meta, plan, written),
                                   checkpoint_id=str(out))
        if verify:
            _verify(source, tmp)
        files = {name: (size, digest) for name, (size, digest, _) in written.items()}
        files[METADATA] = mf.file_checksum(Storage.open(tmp), METADATA)
        _write_manifest(ckpt, tmp, world_size, n_src, files)
    return ReshardResult(
        source=ckpt.url, destination=str(out), source_world_size=n_src, world_size=world_size,
        tensors=len(meta.tensors), objects=len(meta.objects), bytes=ticker.total,
        files={**{n: s for n, (s, _) in sorted(files.items()) if n != METADATA},
               METADATA: meta_size},
        seconds=time.perf_counter() - t0, verified=verify)


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
    if is_url(dst):
        raise ConfigError(f"{os.fspath(dst)}: reshard writes to a local folder; write locally "
                          "and upload the result")
    out = Path(os.path.abspath(os.fspath(dst))).resolve()
    if ckpt.storage.is_local:
        src = Path(ckpt.url).resolve()
        if out == src or out in src.parents:
            raise ConfigError(f"DST {out} is, or contains, the source {src}; choose another DST")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError(f"{out} already exists", path=str(out),
                          hint="Pass --force to replace it, or choose another DST")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder; remove it or choose another DST")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


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


def _output_metadata(meta: CheckpointMetadata, plan: list[list[_Item]],
                     written: dict[str, tuple[int, str, dict[str, list]]]) -> CheckpointMetadata:
    chunks: dict[str, list[Chunk]] = defaultdict(list)
    objects: dict[str, BytesEntry] = {}
    for rank in range(len(plan)):
        for fqn, refs in written[_file_name(rank)][2].items():
            for item, ref in refs:
                if item.chunk is None:
                    objects[fqn] = BytesEntry(fqn, ref)
                else:
                    chunks[fqn].append(Chunk(item.chunk.offsets, item.chunk.sizes, ref))
    tensors = {fqn: TensorEntry(fqn, t.dtype, t.shape, tuple(chunks[fqn]))
               for fqn, t in meta.tensors.items()}
    return CheckpointMetadata(tensors=tensors, objects={k: objects[k] for k in meta.objects},
                              planner_data=meta.planner_data, version=meta.version,
                              save_id=str(uuid.uuid4()))


def _file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


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


class _Ticker:
    """Progress shared by worker threads; reported from the calling thread only."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self.abort = threading.Event()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.abort.is_set():
            raise _Aborted
        with self._lock:
            self.done += n

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)


class _Aborted(Exception):
    pass


def _run_parallel(ticker: _Ticker, fn: Callable, jobs: list, workers: int) -> list:
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


class _Source:
    """Row ranges of a checkpoint's tensors as byte pieces; tracks CRC-32 pieces if asked."""

    def __init__(self, ck: CheckpointReader, *, track: bool = False) -> None:
        self.ck = ck
        self.track = track
        self.pieces: list[tuple[tuple[str, tuple[int, ...]], int, int, int]] = []
        self.whole_check: set[tuple[str, tuple[int, ...]]] = set()
        self._locs: dict[tuple[str, tuple[int, ...]], ChunkBytes] = {}
        for rel in ck.meta.files():
            ck.reader(rel)  # open every file before threads share the reader table

    def locate(self, t: TensorEntry, c: Chunk) -> ChunkBytes:
        key = (t.fqn, c.offsets)
        if key not in self._locs:
            self._locs[key] = self.ck.locate(t, c)
        return self._locs[key]

    def pieces_of(self, t: TensorEntry, lo: int, hi: int) -> Iterator[_Range | bytes]:
        """Rows ``[lo, hi)`` of ``t`` in row-major order (a 0-dim tensor has one row)."""
        row = math.prod(t.shape[1:]) * t.dtype.itemsize
        blocks = t.row_blocks()
        if blocks is None:
            self.whole_check.update((t.fqn, c.offsets) for c in t.chunks)
            yield _assemble(self.ck, t, lo, hi)
            return
        for c in blocks:
            c0 = c.offsets[0] if c.offsets else 0
            a, b = max(lo, c0), min(hi, c0 + (c.sizes[0] if c.sizes else 1))
            if b <= a:
                continue
            cb = self.locate(t, c)
            loc = cb.location
            if not cb.has_crc:  # a safetensors range: the bytes as they are, nothing to check
                yield _Range(None, cb.reader, cb.start + (a - c0) * row, (a - c0) * row, (b - a) * row)
                continue
            if not loc.contiguous:
                self.whole_check.add((t.fqn, c.offsets))
                yield memoryview(self.ck.read_chunk(t, c))[(a - c0) * row:(b - c0) * row]
                continue
            exact = loc.storage_offset == 0 and loc.entry.size == loc.nbytes
            if not exact and self.track:
                self.whole_check.add((t.fqn, c.offsets))
            key = (t.fqn, c.offsets) if exact and self.track else None
            yield _Range(key, cb.reader, cb.start + (a - c0) * row, (a - c0) * row, (b - a) * row)

    def check_crcs(self) -> None:
        """Do the CRCs of the pieces read add up to each record's stored CRC-32?"""
        by_key: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
        for key, rel, length, crc in self.pieces:
            by_key[key].append((rel, length, crc))
        for (fqn, offsets), parts in by_key.items():
            t = self.ck.meta.tensors[fqn]
            entry = self.locate(t, _chunk_at(t, offsets)).location.entry
            crc, pos = 0, 0
            for rel, length, part in sorted(parts):
                if rel != pos:
                    break
                crc, pos = crc32_combine(crc, part, length), pos + length
            if pos != entry.size:
                self.whole_check.add((fqn, offsets))
            elif crc != entry.crc:
                where = self.ck.storage.url_of(_chunk_at(t, offsets).storage.relative_path)
                raise CorruptCheckpointError(
                    f"{where} (item {fqn}): CRC-32 mismatch in its data (stored {entry.crc:08x}, "
                    f"computed {crc:08x}): the bytes are damaged", path=where,
                    hint="Nothing was written; use an earlier checkpoint")
        for fqn, offsets in sorted(self.whole_check):
            chunk = _chunk_at(self.ck.meta.tensors[fqn], offsets)
            if chunk.numel and not chunk.storage.raw:  # type: ignore[union-attr]
                self.ck.record(chunk.storage, fqn).verify_crc()  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Range:
    """``length`` bytes at ``start`` of an open file; ``rel``: offset in the record's data."""

    key: tuple[str, tuple[int, ...]] | None
    reader: RangeReader
    start: int
    rel: int
    length: int


def _chunk_at(t: TensorEntry, offsets: tuple[int, ...]) -> Chunk:
    return next(c for c in t.chunks if c.offsets == offsets)


def _assemble(ck: CheckpointReader, t: TensorEntry, lo: int, hi: int) -> bytes:
    """Rows ``[lo, hi)`` of a tensor saved in arbitrary boxes (memory: those rows + a chunk)."""
    import numpy as np

    item = np.dtype(f"V{t.dtype.itemsize}")
    out = np.zeros((hi - lo,) + t.shape[1:], dtype=item)
    for c in t.chunks:
        a, b = max(lo, c.offsets[0]), min(hi, c.offsets[0] + c.sizes[0])
        if b <= a or not c.numel:
            continue
        src = np.frombuffer(ck.read_chunk(t, c), dtype=item).reshape(c.sizes)
        box = tuple(slice(o, o + n) for o, n in zip(c.offsets[1:], c.sizes[1:]))
        out[(slice(a - lo, b - lo), *box)] = src[a - c.offsets[0]:b - c.offsets[0]]
    return out.tobytes()


def _blocks(r: _Range, buf: bytearray) -> Iterator[memoryview]:
    """The range in pieces of at most ``len(buf)`` bytes (views of ``buf`` for local files)."""
    view, done, fd = memoryview(buf), 0, r.reader.fileno
    while done < r.length:
        want = min(len(buf), r.length - done)
        if fd is not None:
            if _FADVISE and done + want < r.length:  # read the next block ahead, meanwhile
                os.posix_fadvise(fd, r.start + done + want, min(len(buf), r.length - done - want),
                                 os.POSIX_FADV_WILLNEED)
            data = view[:os.preadv(fd, [view[:want]], r.start + done)]
        else:
            data = memoryview(r.reader.pread(r.start + done, want))
        if not data:
            raise CorruptCheckpointError(f"{r.reader.storage.url_of(r.reader.rel)} is cut short",
                                         path=r.reader.storage.url)
        yield data
        done += len(data)


class _Copier:
    """Writes the output files from a tracked ``_Source``."""

    def __init__(self, src: _Source, ticker: _Ticker) -> None:
        self.src = src
        self.ticker = ticker

    def run(self, folder: Path, plan: list[list[_Item]]) -> dict[str, tuple[int, str, dict]]:
        workers = min(os.cpu_count() or 1, 4) if self.src.ck.storage.is_local else 1
        jobs = [(folder / _file_name(r), items) for r, items in enumerate(plan)]
        # Each finished file is fsynced by one flusher thread while the next ones copy.
        with ThreadPoolExecutor(1) as self.flusher:
            self.flushed: list[Future] = []
            results = _run_parallel(self.ticker, self._write_file, jobs, workers)
            self.src.check_crcs()
            for flushed in self.flushed:
                flushed.result()
        return {path.name: res for (path, _), res in zip(jobs, results)}

    def _write_file(self, job: tuple[Path, list[_Item]]) -> tuple[int, str, dict]:
        path, items = job
        refs: dict[str, list] = defaultdict(list)
        buf = bytearray(BLOCK)
        with DistcpFile(path) as f:
            for item in items:
                start = f.size
                if item.chunk is None:
                    ref = self.src.ck.meta.objects[item.fqn].storage
                    self.src.ck.record(ref, item.fqn).verify_crc()  # type: ignore[arg-type]
                    f.write(self.src.ck.object_bytes(item.fqn))
                else:
                    self._tensor(f, self.src.ck.meta.tensors[item.fqn], item.chunk, buf)
                refs[item.fqn].append((item, StorageRef(f.name, start, f.size - start)))
            f.close(sync=False)
        self.flushed.append(self.flusher.submit(_fsync, path))
        return f.size, f.digest, refs

    def _tensor(self, f: DistcpFile, t: TensorEntry, chunk: Chunk, buf: bytearray) -> None:
        rec = TensorRecord(t.dtype, chunk.sizes)
        f.write(rec.head)
        lo = chunk.offsets[0] if chunk.offsets else 0
        crc = 0
        for piece in self.src.pieces_of(t, lo, lo + (chunk.sizes[0] if chunk.sizes else 1)):
            if isinstance(piece, _Range):
                part = 0
                for data in _blocks(piece, buf):
                    part = crc32(data, part)
                    f.write(data)
                    self.ticker.add(len(data))
                if piece.key is not None:
                    self.src.pieces.append((piece.key, piece.rel, piece.length, part))
                crc = crc32_combine(crc, part, piece.length)
            else:
                f.write(piece)
                crc = crc32(piece, crc)
                self.ticker.add(len(piece))
        f.write(rec.tail(crc))


# ---------------------------------------------------------------------------------------------
# Verification


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verify(src: _Source, folder: Path) -> None:
    """Deep-validate the output; then each tensor's row-major CRC-32 must equal the source's."""
    from ckptool.ops.validate import validate

    report = validate(str(folder), deep=True)
    if not report.ok:
        raise _unverified(str(folder), report.errors[0].message)
    with CheckpointReader(Storage.open(folder), report.metadata[""]) as ck:
        out = _Source(ck)
        for fqn, t in src.ck.meta.tensors.items():
            a, b = _tensor_crc(src, t), _tensor_crc(out, ck.meta.tensors[fqn])
            if a is None:  # a source record whose CRC does not cover exactly the tensor
                a, b = _digest(_Source(src.ck), t), _digest(out, ck.meta.tensors[fqn])
            if a != b:
                raise _unverified(str(folder), f"{fqn} differs from the source ({b} != {a})")


def _unverified(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"verification failed, nothing was committed: {what}",
                                  path=where, hint="Please report this as a ckptool bug")


def _tensor_crc(src: _Source, t: TensorEntry) -> tuple[int, int] | None:
    """(CRC-32, length) of the whole tensor in row-major order, from its records' stored CRCs
    (each checked against the bytes by the copy or by ``validate --deep``); None when some
    record's CRC covers more than the tensor's own bytes."""
    blocks = t.row_blocks()
    if blocks is None:
        return None
    crc = size = 0
    for c in blocks:
        cb = src.locate(t, c)
        loc = cb.location
        if not (cb.has_crc and loc.contiguous and loc.storage_offset == 0
                and loc.entry.size == loc.nbytes):
            return None
        crc, size = crc32_combine(crc, loc.entry.crc, loc.entry.size), size + loc.entry.size
    return crc, size


def _digest(src: _Source, t: TensorEntry) -> str:
    """xxh3-64 of the whole tensor in row-major order, read in pieces, whatever its layout."""
    import xxhash

    h, buf = xxhash.xxh3_64(), bytearray(BLOCK)
    n = t.shape[0] if t.shape else 1
    bands = [0, n]
    if t.row_blocks() is None:  # assemble between the chunks' row boundaries
        bands = sorted({0, n} | {c.offsets[0] + d for c in t.chunks for d in (0, c.sizes[0])})
    for lo, hi in zip(bands, bands[1:]):
        for piece in src.pieces_of(t, lo, hi):
            for data in (_blocks(piece, buf) if isinstance(piece, _Range) else (piece,)):
                h.update(data)
    return h.hexdigest()

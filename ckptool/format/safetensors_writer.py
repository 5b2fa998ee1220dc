"""Streaming safetensors output: the header is planned from shapes alone, then bytes are placed.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
header, then every tensor's bytes back to back. The header is padded with spaces so the data
starts 8-byte aligned (as the reference writer does). Because each tensor's position is known
before any data exists, the data can be written in any order with positioned writes: consolidate
writes in source-file order so that every source file is read sequentially.

Owns: header encoding and reading, HF-style shard planning and index, the open output file
(positioned writes, in-kernel ``copy_file_range`` with a buffered fallback, optional xxh3 of
every write for a re-read check), committing a file or folder (``StagedOutput``), and element
conversion to the output dtype (``cast_bytes``, numpy). Knows nothing about DCP; which bytes go where is ``ops/consolidate.py``'s business.
Torch-free.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import CkptError, ConfigError, CorruptCheckpointError
from ckptool.format.dtypes import DType
from ckptool.storage import BLOCK, atomic_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: safetensors refuses headers larger than this (100 MB); so do we, before writing anything.
MAX_HEADER = 100_000_000
_ALIGN = 8
_WRITEBACK_MIN = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: its name, dtype and shape (the bytes come later)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileLayout:
    """A planned ``.safetensors`` file.

    Attributes:
        filename: the file's name (no folder).
        tensors: the tensors, in data order.
        header: the complete header bytes (length prefix, JSON, padding).
        offsets: name -> absolute byte offset of the tensor's first byte in the file.
    """

    filename: str
    tensors: tuple[TensorSpec, ...]
    header: bytes
    offsets: dict[str, int]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def plan_file(filename: str, tensors: list[TensorSpec] | tuple[TensorSpec, ...],
              metadata: dict[str, str] | None = None) -> FileLayout:
    """Lay out one file: header bytes and every tensor's absolute offset.

    Args:
        filename: name of the file (recorded in the layout and the index).
        tensors: tensors in the order their bytes will sit in the file; names must be unique.
        metadata: the header's ``__metadata__`` (str -> str, as safetensors requires).

    Returns:
        The ``FileLayout``.

    Raises:
        CkptError: a duplicate name, non-string metadata, or a header over 100 MB.

    Example:
        >>> lay = plan_file("model.safetensors", [TensorSpec("w", DTYPES["float32"], (2, 3))])
        >>> lay.offsets["w"], lay.size      # header + padding, then 24 data bytes
        (72, 96)
    """
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CkptError(f"safetensors metadata must map str to str, got {metadata!r}")
        header["__metadata__"] = dict(metadata)
    pos, rel = 0, {}
    for t in tensors:
        if t.name in header or t.name in rel:
            raise CkptError(f"tensor name {t.name!r} appears twice in {filename}")
        header[t.name] = {"dtype": t.dtype.safetensors, "shape": list(t.shape),
                          "data_offsets": [pos, pos + t.nbytes]}
        rel[t.name] = pos
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % _ALIGN)
    if len(text) > MAX_HEADER:
        raise CkptError(f"the header of {filename} would be {len(text)} bytes, over the 100 MB "
                        "safetensors limit; split the output with a smaller --max-shard-size")
    head = struct.pack("<Q", len(text)) + text
    return FileLayout(filename, tuple(tensors), head, {k: len(head) + v for k, v in rel.items()})


def split_shards(tensors: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most ``max_shard_size`` data bytes.

    Follows huggingface_hub's rule: a tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards if shards[0] else []


def shard_filenames(n: int) -> list[str]:
    """HF names: ``model.safetensors`` for one shard, ``model-0000i-of-0000n.safetensors`` else."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def index_json(layouts: list[FileLayout], metadata: dict[str, str] | None = None) -> bytes:
    """The ``model.safetensors.index.json`` of a sharded output (transformers' format)."""
    weight_map = {t.name: lay.filename for lay in layouts for t in lay.tensors}
    meta: dict[str, object] = {"total_size": sum(lay.data_bytes for lay in layouts)}
    meta.update(metadata or {})
    return (json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n").encode()


class OutputFile:
    """One ``.safetensors`` file being written: header at open, data by positioned writes.

    The file is sized up front, so tensors may arrive in any order, from several threads.
    ``close()`` flushes to disk (fsync) unless ``fsync=False``. With ``track=True`` every
    ``pwrite`` records the xxh3-64 of its bytes, and ``verify()`` re-reads and compares them.

    Example:
        >>> with OutputFile("/tmp/x.safetensors", layout) as out:
        ...     out.pwrite(raw_bytes, layout.offsets["w"])
    """

    def __init__(self, path: str | os.PathLike[str], layout: FileLayout, *, fsync: bool = True,
                 track: bool = False) -> None:
        self.path = os.fspath(path)
        self.layout = layout
        self._fsync = fsync
        self.hashes: dict[tuple[int, int], int] | None = {} if track else None
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pwrite(layout.header, 0)
        os.ftruncate(self.fd, layout.size)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(sync=exc[0] is None)

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Write all of ``data`` at absolute ``offset``."""
        assert self.fd is not None
        view = memoryview(data).cast("B")
        if self.hashes is not None:
            self.hashes[(offset, len(view))] = _xxh3(view)
        start, length = offset, len(view)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n
        self._writeback(start, length)

    def copy_from(self, src_fd: int, src_offset: int, length: int, offset: int) -> None:
        """Copy ``length`` bytes of an open local file into this one at ``offset``.

        Uses ``os.copy_file_range`` (in-kernel, no user-space buffer); falls back to 8 MiB
        ``pread``/``pwrite`` blocks where the kernel or file systems cannot (EXDEV, ENOSYS, ...).

        Raises:
            CorruptCheckpointError: the source ends before ``length`` bytes.
        """
        assert self.fd is not None
        copied = _copy_file_range(src_fd, src_offset, self.fd, offset, length)
        self._writeback(offset, copied)
        src_offset, offset, length = src_offset + copied, offset + copied, length - copied
        while length > 0:
            data = os.pread(src_fd, min(BLOCK, length), src_offset)
            if not data:
                raise CorruptCheckpointError(f"source ends {length} bytes early while writing "
                                             f"{self.path}; run 'ckptool validate --deep'")
            self.pwrite(data, offset)
            src_offset, offset, length = src_offset + len(data), offset + len(data), length - len(data)

    def _writeback(self, offset: int, length: int) -> None:
        # Start writing these pages to disk now (async: WB_SYNC_NONE), so disk writes overlap
        # the reads that follow and the final fsync has little left. Otherwise the kernel
        # starts writeback only at 10% of RAM dirty, i.e. not at all for a 2 GB export here.
        if self._fsync and length >= _WRITEBACK_MIN and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)  # type: ignore[arg-type]

    def verify(self) -> None:
        """Re-read every tracked write from disk and compare its xxh3-64 (file must be closed).

        Raises:
            CkptError: a range reads back different bytes than were written.
        """
        import xxhash

        assert self.hashes is not None and self.fd is None
        with open(self.path, "rb") as f:
            for (offset, length), digest in sorted(self.hashes.items()):
                f.seek(offset)
                h, left = xxhash.xxh3_64(), length
                while left > 0 and (block := f.read(min(left, BLOCK))):
                    h.update(block)
                    left -= len(block)
                if left or h.intdigest() != digest:
                    raise CkptError(f"verify failed: {self.path} bytes {offset}..{offset + length} "
                                    "read back different from what was written; the disk may be "
                                    "failing, write the output elsewhere")

    def close(self, *, sync: bool = True) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if sync and self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


class StagedOutput:
    """Where to write an export: a temporary path, committed only when the block succeeds.

    A ``.safetensors`` file (``single=True``) is written under a temporary sibling name and
    renamed onto ``dst``. A folder is written as a temporary sibling folder and renamed into
    place. An existing output is refused unless ``replace``: then a file is replaced, and in a
    non-empty folder only the export's own files are (``model*.safetensors`` shards and the
    index, as ``save_pretrained`` does; ``removed`` lists the old ones that went): the new
    files are moved in one by one, the old index removed first and the new index moved in
    last; other files (a tokenizer, a README) are left. On any exception (including
    ``KeyboardInterrupt``) the temporary path is removed and ``dst`` is left as it was.

    Example:
        >>> with StagedOutput(Path("out/hf"), single=False) as tmp:
        ...     (tmp / "model.safetensors").write_bytes(data)
    """

    def __init__(self, dst: Path, *, single: bool, replace: bool = False) -> None:
        self.dst, self.single, self.replace = dst, single, replace
        fresh = single or not dst.exists() or (dst.is_dir() and not any(dst.iterdir()))
        self._staging = dst if fresh else dst / ".ckptool-staging"
        self._atomic = atomic_path(self._staging)
        self._merge = not fresh
        self._replaced_file = single and replace and dst.is_file()
        self.removed: list[str] = []

    def __enter__(self) -> Path:
        if not self.dst.parent.is_dir():
            raise ConfigError(f"{self.dst.parent} does not exist; create it first")
        self._refuse_existing()
        tmp = self._atomic.__enter__()
        if not self.single:
            try:
                tmp.mkdir()
            except OSError as e:  # e.g. a read-only destination: let atomic_path word it
                self._atomic.__exit__(type(e), e, e.__traceback__)
                raise
        return tmp

    def _refuse_existing(self) -> None:
        dst = self.dst
        if self._merge and not dst.is_dir():
            raise ConfigError(f"{dst} is a file; pass a new folder or a .safetensors name")
        if self.replace:
            return
        if self.single and (dst.exists() or dst.is_symlink()):
            raise ConfigError(f"{dst} already exists", path=str(dst),
                              hint="Pass --force to replace it, or choose another OUTPUT")
        if self._merge:
            held = sorted(p.name for p in dst.iterdir())
            shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            raise ConfigError(
                f"{dst} is not empty ({shown})", path=str(dst),
                hint="Pass --force to replace the weight files in it (model*.safetensors and "
                     "the index; other files are kept), or choose a new folder")

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> bool:
        self._atomic.__exit__(et, ev, tb)  # on failure: removes tmp; the error then propagates
        if self._merge and ev is None:
            self.removed = _merge_into(self._staging, self.dst)
        elif self._replaced_file and ev is None:
            self.removed = [self.dst.name]  # the rename replaced it
        return False


def _merge_into(staging: Path, dst: Path) -> list[str]:
    """Move the new export files in; return the names of old export files that went."""
    new = {p.name for p in staging.iterdir()}
    removed = []
    if (dst / INDEX_NAME).exists():  # never leave an index naming stale shards
        (dst / INDEX_NAME).unlink()
        removed.append(INDEX_NAME)
    for old in sorted(dst.glob("model*.safetensors")):
        if old.name == SINGLE_NAME or "-of-" in old.name:
            removed.append(old.name)
            if old.name not in new:
                old.unlink()
    removed += sorted(n for n in new if n not in removed and (dst / n).exists())
    for name in sorted(new, key=lambda n: n == INDEX_NAME):
        os.replace(staging / name, dst / name)
    shutil.rmtree(staging, ignore_errors=True)
    return removed


_NO_CFR = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


def _copy_file_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> int:
    """Bytes copied in-kernel; stops early (caller finishes buffered) where unsupported."""
    if not hasattr(os, "copy_file_range"):
        return 0
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(length - done, 1 << 30),
                                   src_offset + done, dst_offset + done)
        except OSError as e:
            if e.errno in _NO_CFR:
                return done
            raise
        if n == 0:  # end of source: let the buffered path report it
            return done
        done += n
    return done


def _xxh3(data: bytes | memoryview) -> int:
    import xxhash  # lazy: only --verify needs it

    return xxhash.xxh3_64_intdigest(data)


# ---------------------------------------------------------------------------------------------
# Casts (numpy, bit-exact with torch's .to() for every non-NaN value)

#: Dtypes ``cast_bytes`` converts between.
CASTABLE = ("float64", "float32", "float16", "bfloat16")


def cast_bytes(raw: bytes | memoryview, src: DType, dst: DType) -> memoryview:
    """Convert little-endian ``src`` elements to ``dst`` (both in ``CASTABLE``), torch-free.

    Rounding is round-to-nearest-even, as torch does; float64 goes through float32 first,
    as torch's double -> half/bfloat16 kernels do. NaN becomes a quiet NaN: 0x7FC0 for
    bfloat16 (c10's reference conversion; torch's AVX2/AVX-512 kernels give 0xFFFF) and the
    F16C pattern (sign, quiet bit, top payload bits) for float16, as torch's kernels give.

    Args:
        raw: whole elements of ``src``.
        src, dst: source and target dtypes.

    Returns:
        The converted elements as bytes (``raw`` itself when ``src == dst``).

    Example:
        >>> bytes(cast_bytes(struct.pack("<f", 1.0), DTYPES["float32"], DTYPES["bfloat16"]))
        b'\\x80?'
    """
    if src == dst:
        return memoryview(raw)
    import numpy as np

    x = _to_float32(np, raw, src)
    if dst.name == "float32":
        out = x
    elif dst.name == "bfloat16":
        u = x.view(np.uint32)
        out = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
        out[np.isnan(x)] = 0x7FC0
    else:
        with np.errstate(over="ignore"):
            out = x.astype(np.float16).view(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            u = x.view(np.uint32)[nan]
            out[nan] = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
    return memoryview(np.ascontiguousarray(out)).cast("B")


def _to_float32(np: Any, raw: bytes | memoryview, src: DType) -> Any:
    if src.name == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if src.name == "float32":
        return np.frombuffer(raw, np.float32)
    if src.name == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        return np.frombuffer(raw, np.float64).astype(np.float32)

"""Streaming safetensors output: the header is planned from shapes alone, then bytes are placed.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
header, then every tensor's bytes back to back. The header is padded with spaces so the data
starts 8-byte aligned (as the reference writer does). Because each tensor's position is known
before any data exists, the data can be written in any order with positioned writes: consolidate
writes in source-file order so that every source file is read sequentially.

Owns: header encoding, HF-style shard planning and index, and the open output file
(positioned writes, in-kernel ``copy_file_range`` with a buffered fallback, optional xxh3 of
every write for a re-read check). Committing a file or folder is ``staged_output.py``'s,
element conversion to the output dtype ``dtype_cast.py``'s, reading a header
``safetensors_source.py``'s. Knows nothing about DCP; which bytes go where is
``ops/consolidate.py``'s business. Torch-free.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass

from ckptool.errors import CkptError, CorruptCheckpointError
from ckptool.format.dtype_cast import CASTABLE, cast_bytes
from ckptool.format.dtypes import DType
from ckptool.format.staged_output import StagedOutput
from ckptool.storage import BLOCK
from ckptool.storage.writeback import start_writeback

__all__ = ["CASTABLE", "INDEX_NAME", "MAX_HEADER", "SINGLE_NAME", "FileLayout", "OutputFile",
           "StagedOutput", "TensorSpec", "cast_bytes", "index_json", "plan_file", "shard_filenames",
           "split_shards"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: safetensors refuses headers larger than this (100 MB); so do we, before writing anything.
MAX_HEADER = 100_000_000
_ALIGN = 8


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
        if self._fsync:  # (an output that is not fsynced need not be written out early)
            start_writeback(self.fd, offset, length)  # (declined: left to the fsync)

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

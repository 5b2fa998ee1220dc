"""How ``import`` writes one output rank's chunk of a tensor from the open safetensors files.

``Copier.write_item`` appends the chunk's record: its rows are one contiguous range of a
source file, copied in the kernel (``FileRange``, compared with the source as it is made when
verifying), or read and cast (bf16 -> float32) ``CAST_BLOCK`` at a time, each block written and,
when verifying, read back and compared at once. ``Copier.prefetch`` asks the OS for a chunk's
rows ahead of their copy. The CRC-32 of every chunk written is kept for the verification.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

from ckptool.errors import CorruptCheckpointError
from ckptool.format.copy_engine import Ticker
from ckptool.format.dcp_output import FileRange, write_tensor
from ckptool.format.dcp_writer import DistcpFile
from ckptool.format.dtypes import DType
from ckptool.format.hf_source import SourceTensor
from ckptool.format.metadata import Chunk
from ckptool.format.safetensors_writer import cast_bytes

_FADVISE = hasattr(os, "posix_fadvise")
#: Bytes of the source cast at a time (a cast allocates a few times its output).
CAST_BLOCK = 256 << 10


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its key, source, and output dtype."""

    fqn: str
    src: SourceTensor
    dtype: DType


class Copier:
    """Writes import's rank chunks from the open source files, casting when asked; keeps the
    CRC-32 of every chunk written for the verification. ``compare``: each copy is read back
    and compared with the source's bytes as it is made."""

    def __init__(self, ticker: Ticker, paths: set[str], *, compare: bool) -> None:
        self.ticker = ticker
        self.compare = compare
        self.paths = sorted(paths)
        self.fds: dict[str, int] = {}
        self.crcs: dict[tuple[str, int], int] = {}  # (fqn, first row) -> CRC-32 written

    def __enter__(self) -> Self:
        for p in self.paths:
            self.fds[p] = os.open(p, os.O_RDONLY)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)

    @staticmethod
    def _rows(item: tuple[OutTensor, Chunk]) -> tuple[int, int, int]:
        """(first row, file offset, length) of a chunk's rows in its source file."""
        t, chunk = item[0].src, item[1]
        row = t.nbytes // t.shape[0] if t.shape else t.nbytes
        lo = chunk.offsets[0] if chunk.offsets else 0
        return lo, t.offset + lo * row, (chunk.sizes[0] if chunk.sizes else 1) * row

    def prefetch(self, item: tuple[OutTensor, Chunk]) -> int:
        """Ask the OS to read a chunk's source rows ahead; the bytes asked."""
        _, start, length = self._rows(item)
        if _FADVISE and length:  # (a length of 0 would ask for the rest of the file)
            os.posix_fadvise(self.fds[item[0].src.path], start, length, os.POSIX_FADV_WILLNEED)
        return length

    def write_item(self, f: DistcpFile, item: tuple[OutTensor, Chunk], buf: bytearray) -> bool:
        """Append one chunk's record; True when its data was compared as it was written with
        the source's bytes or their cast (the read-back then skips the data)."""
        o, chunk = item
        t = o.src
        lo, start, length = self._rows(item)
        if t.dtype == o.dtype:
            piece: FileRange | Iterable[Any] = FileRange(self.fds[t.path], start, length, t.path,
                                                         compare=self.compare)
        else:  # a cast allocates a few times its output: cast 256 KiB at a time
            piece = (cast_bytes(data, t.dtype, o.dtype) for data in
                     _read(self.fds[t.path], start, length, memoryview(buf)[:CAST_BLOCK], t.path))
        ratio = (t.dtype.itemsize, o.dtype.itemsize)
        [(crc, _)] = write_tensor(f, o.dtype, chunk.sizes, [piece],
                                  lambda n: self.ticker.add(n * ratio[0] // ratio[1]), buf,
                                  compare=self.compare)
        self.crcs[(o.fqn, lo)] = crc
        return self.compare


def _read(fd: int, start: int, length: int, buf: memoryview, where: str
          ) -> Iterator[memoryview]:
    """``length`` bytes at ``start`` of ``fd`` in views of ``buf`` (read ahead meanwhile)."""
    view, done = buf, 0
    while done < length:
        want = min(len(buf), length - done)
        if _FADVISE and done + want < length:
            os.posix_fadvise(fd, start + done + want, min(len(buf), length - done - want),
                             os.POSIX_FADV_WILLNEED)
        n = os.preadv(fd, [view[:want]], start + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{where} ended while reading it (changed meanwhile?)",
                                         path=where, hint="Nothing was written")
        yield view[:n]
        done += n

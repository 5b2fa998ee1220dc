"""A local file mapped into memory read-only, to checksum its bytes where the page cache holds them.

Reading a file with ``pread`` copies every byte from the page cache into a new buffer; a
mapping lets CRC-32 read the cached pages themselves (``validate --deep`` on a warm cache is
then bound by the CRC, not by the copy). Remote files, empty files and systems without
``mmap`` get None from ``MappedFile.open`` and are read as before.
"""

from __future__ import annotations

import mmap
import os


class MappedFile:
    """One read-only mapping of a whole local file.

    ``view(offset, length)`` slices it without copying; views should be dropped before
    ``close``. The file must not shrink while mapped (reading past its new end is SIGBUS).
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map = mapping
        self._view = memoryview(mapping)
        self.size = len(mapping)

    @classmethod
    def open(cls, fd: int | None) -> MappedFile | None:
        """Map the open file ``fd``; None when it cannot be mapped (no fd, empty, no mmap)."""
        if fd is None or not hasattr(mmap, "MADV_SEQUENTIAL"):
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError, OverflowError):
            return None
        mapping.madvise(mmap.MADV_SEQUENTIAL)
        return cls(mapping)

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)``, shorter if the file ends first."""
        return self._view[offset:offset + length]

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading a range into the page cache (``MADV_WILLNEED``) and return: the
        next window of a record is read from disk while this one is checksummed."""
        start = offset - offset % mmap.PAGESIZE
        length = min(length + offset - start, self.size - start)
        if length > 0:
            self._map.madvise(mmap.MADV_WILLNEED, start, length)

    def close(self) -> None:
        self._view.release()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A local file mapped into memory read-only, to checksum its bytes where the page cache holds them.

Reading a file with ``pread`` copies every byte from the page cache into a new buffer; a
mapping lets CRC-32 read the cached pages themselves (``validate --deep`` on a warm cache is
then bound by the CRC, not by the copy). Bytes not in the page cache are faster to ``pread``
(large requests) than to fault in page by page, so ``resident`` tells which is which. Remote
files, empty files and systems without ``mmap`` get None from ``MappedFile.open``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

_NOWAIT = getattr(os, "RWF_NOWAIT", None)


class MappedFile:
    """One read-only mapping of a whole local file.

    ``view(offset, length)`` slices it without copying; views should be dropped before
    ``close``. The file must not shrink while mapped (reading past its new end is SIGBUS).
    """

    def __init__(self, mapping: mmap.mmap, fd: int) -> None:
        self._map = mapping
        self._view = memoryview(mapping)
        self._fd = fd
        self._probe = bytearray(1)
        self.size = len(mapping)

    @classmethod
    def open(cls, fd: int | None) -> MappedFile | None:
        """Map the open file ``fd`` (which must stay open until ``close``); None when it cannot
        be mapped (no fd, empty, no mmap)."""
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            return cls(mmap.mmap(fd, size, prot=mmap.PROT_READ), fd)
        except (OSError, ValueError, OverflowError, TypeError, AttributeError):
            return None

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)``, shorter if the file ends first."""
        return self._view[offset:offset + length]

    def resident(self, offset: int, length: int) -> bool:
        """Are the range's first, middle and last bytes in the page cache? (A read that may not
        wait: ``RWF_NOWAIT``.) True where the system cannot tell."""
        if _NOWAIT is None or length <= 0:
            return True
        for at in (offset, offset + length // 2, offset + length - 1):
            try:
                if os.preadv(self._fd, [self._probe], at, _NOWAIT) != 1:
                    return False
            except BlockingIOError:
                return False
            except OSError:  # flag not supported here
                return True
        return True

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


@contextlib.contextmanager
def cached_window(fd: int | None, offset: int, length: int) -> Iterator[memoryview | None]:
    """The bytes ``[offset, offset + length)`` of the open local file ``fd`` where they lie in
    the page cache (a read-only mapping of just that window, unmapped on exit: resident memory
    stays bounded by one window); None when ``fd`` is None, the window is not all cached (a
    cold read is faster with ``pread``) or it cannot be mapped. The view must not outlive the
    ``with`` block, and the file must not shrink meanwhile."""
    if fd is None or length <= 0 or not _all_resident(fd, offset, length):
        yield None
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        window = mmap.mmap(fd, offset + length - start, prot=mmap.PROT_READ, offset=start)
    except (OSError, ValueError, OverflowError):
        yield None
        return
    view = memoryview(window)[offset - start:]
    try:
        yield view
    finally:
        view.release()
        with contextlib.suppress(BufferError):  # a caller kept a view: it holds the mapping
            window.close()


def _all_resident(fd: int, offset: int, length: int) -> bool:
    """Is every 2 MiB step of the range in the page cache (one-byte reads that may not wait)?"""
    if _NOWAIT is None:
        return False
    probe = bytearray(1)
    for at in [*range(offset, offset + length, 2 << 20), offset + length - 1]:
        try:
            if os.preadv(fd, [probe], at, _NOWAIT) != 1:
                return False
        except OSError:  # BlockingIOError: not cached; others: flag not supported
            return False
    return True

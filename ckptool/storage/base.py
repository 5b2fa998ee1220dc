"""What both storage backends share: the ``Backend`` interface, ``Entry``, ``BLOCK``, ``is_url``.

A backend answers for absolute paths in its own name space (``/data/run`` locally,
``bucket/run`` for s3fs); ``Storage`` (``ckptool.storage``) joins them to a root and is what
callers use. ``local.LocalBackend`` and ``remote.FsspecBackend`` implement it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

#: Read granularity for streaming copies and checksums.
BLOCK = 8 << 20


@dataclass(frozen=True)
class Entry:
    """One item of a folder listing (``Storage.listdir``)."""

    name: str
    is_dir: bool
    size: int
    mtime: float | None


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for an fsspec URL (``s3://...``, ``memory://...``); ``file://`` counts as local."""
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def strip_file_scheme(s: str) -> str:
    return s[len("file://") :] if s.startswith("file://") else s


class OpenFile(Protocol):
    """One open file with positional reads; what ``RangeReader`` wraps."""

    #: The OS file descriptor (local files only), for ``os.copy_file_range`` and friends.
    fileno: int | None

    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer only at the end of the file)."""

    def close(self) -> None:
        """Release the file; ``pread`` is not called after this."""


class Backend(Protocol):
    """How bytes move on one kind of storage. Every path is absolute in the backend's space.

    Local: ``os.*``, real ``fsync``, atomic ``rename``. fsspec: ``fsync`` is a no-op (an
    object store has no folders and each PUT is durable once it returns) and ``rename`` is a
    copy and delete (``atomic_rename`` is False), so callers that need an atomic step use
    another protocol there (``run_folder.remove_checkpoint`` deletes ``.metadata`` first).
    """

    is_local: bool
    atomic_rename: bool
    fs: Any  # the fsspec file system, None locally

    def join(self, root: str, rel: str) -> str: ...
    def dirname(self, path: str) -> str: ...
    def url(self, path: str) -> str: ...
    def exists(self, path: str, *, fresh: bool = False) -> bool: ...
    def isdir(self, path: str, *, fresh: bool = False) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def islink(self, path: str) -> bool: ...
    def inside(self, root: str, rel: str) -> bool: ...
    def listdir(self, path: str) -> list[Entry]: ...
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_file(self, path: str, *, keep_block: bool = True) -> OpenFile:
        """Open for ``pread``; ``keep_block=False`` for a reader used once (no read-ahead)."""
    def makedirs(self, path: str) -> None: ...
    def write_bytes(self, path: str, data: bytes) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def fsync(self, path: str) -> None: ...

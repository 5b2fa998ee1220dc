"""File access for checkpoints: local paths (fast path: os.pread) and fsspec URLs.

Owns *how bytes move*: listing, stat, ranged reads, small writes, renames, removal, fsync,
and atomic output (``atomic_path``). It knows nothing about the DCP format (that is
``format/``). A ``Storage`` is rooted at one folder; every path given to it is relative to
that root. Which backend serves it (``local.LocalBackend`` or ``remote.FsspecBackend``) is
decided once, in ``Storage.open``, and inherited by ``child`` and ``parent``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ckptool.errors import CkptError
from ckptool.storage.atomic import atomic_path
from ckptool.storage.base import BLOCK, Backend, Entry, OpenFile, is_url, strip_file_scheme
from ckptool.storage.local import LocalBackend
from ckptool.storage.remote import FsspecBackend

__all__ = ["BLOCK", "Backend", "Entry", "RangeReader", "Storage", "atomic_path", "is_url"]

_LOCAL = LocalBackend()


class Storage:
    """A folder, local or remote, with ranged reads.

    Args:
        root: the folder, absolute in the backend's name space.
        fs: an fsspec file system for a remote root (None: the local file system).
        backend: the backend itself (``child``/``parent`` pass theirs on); overrides ``fs``.

    Example:
        >>> st = Storage.open("runs/demo/step_10")
        >>> head = st.read_range(".metadata", 0, 16)
    """

    def __init__(self, root: str, fs: Any = None, *, backend: Backend | None = None) -> None:
        self.root = root
        self.backend: Backend = backend or (_LOCAL if fs is None else FsspecBackend(fs))

    # -- construction -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Storage:
        """The storage rooted at a local path or an fsspec URL (credentials from the
        environment, as fsspec reads them)."""
        s = os.fspath(path)
        if is_url(s):
            import fsspec  # lazy: fsspec is only needed for URLs

            fs, root = fsspec.core.url_to_fs(s)
            return cls(root.rstrip("/"), fs)
        return cls(os.path.abspath(strip_file_scheme(s)))

    @property
    def fs(self) -> Any:
        """The fsspec file system, or None for local storage."""
        return self.backend.fs

    @property
    def is_local(self) -> bool:
        return self.backend.is_local

    @property
    def atomic_rename(self) -> bool:
        """Whether ``rename`` is one atomic step (local) or a copy and delete (fsspec)."""
        return self.backend.atomic_rename

    @property
    def url(self) -> str:
        return self.backend.url(self.root)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def child(self, rel: str) -> Storage:
        return Storage(self.path(rel), backend=self.backend)

    def parent(self) -> Storage:
        return Storage(self.backend.dirname(self.root), backend=self.backend)

    @property
    def name(self) -> str:
        return os.path.basename(self.root.rstrip("/"))

    def path(self, rel: str = "") -> str:
        return self.backend.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return self.url if not rel else f"{self.url.rstrip('/')}/{rel}"

    # -- queries ------------------------------------------------------------------------
    # The root's own existence is checked against a fresh listing (remote caches go stale when
    # peers write); a path inside is checked against that listing (see remote.FsspecBackend).
    def exists(self, rel: str = "") -> bool:
        return self.backend.exists(self.path(rel), fresh=not rel)

    def isdir(self, rel: str = "") -> bool:
        return self.backend.isdir(self.path(rel), fresh=not rel)

    def isfile(self, rel: str) -> bool:
        return self.backend.isfile(self.path(rel))

    def islink(self, rel: str) -> bool:
        return self.backend.islink(self.path(rel))

    def realpath_inside(self, rel: str) -> bool:
        """True when ``rel`` (after following symlinks) stays inside the root."""
        return self.backend.inside(self.root, rel)

    def listdir(self, rel: str = "") -> list[Entry]:
        """The folder's entries sorted by name (always a fresh listing).

        Raises:
            CheckpointNotFoundError: the folder does not exist (or is a file).
        """
        return self.backend.listdir(self.path(rel))

    def size(self, rel: str) -> int:
        return self.backend.size(self.path(rel))

    # -- reads --------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        return self.backend.read_bytes(self.path(rel))

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer only if the file is shorter. Remotely one
        ranged request for exactly those bytes (no read-ahead: the reader is used once)."""
        r = RangeReader(self, rel, keep_block=False)
        try:
            return r.pread(offset, length)
        finally:
            r.close()

    @contextlib.contextmanager
    def reader(self, rel: str) -> Iterator[RangeReader]:
        r = RangeReader(self, rel)
        try:
            yield r
        finally:
            r.close()

    # -- writes -------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        self.backend.makedirs(self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file (locally fsynced before it returns)."""
        self.backend.write_bytes(self.path(rel), data)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        """Move a file or folder; atomic only where ``atomic_rename`` says so."""
        self.backend.rename(self.path(src_rel), self.path(dst_rel))

    def remove(self, rel: str) -> None:
        """Delete one file; a missing one is no error."""
        self.backend.remove(self.path(rel))

    def remove_tree(self, rel: str = "") -> None:
        """Delete a folder with everything in it (or a single file); missing is no error."""
        self.backend.remove_tree(self.path(rel))

    def fsync(self, rel: str = "") -> None:
        """Make a file, or a folder's entries (a rename into it), durable. Locally a real
        ``fsync`` (best effort for folders); on fsspec storage a no-op, since each PUT is
        durable once it returns."""
        self.backend.fsync(self.path(rel))


class RangeReader:
    """One open file with positional reads (``os.pread`` locally, ranged GETs remotely).

    ``pread`` keeps no file position, so several threads may call it at once, on either
    backend (remotely each call is its own ranged request). ``keep_block=False`` turns off the
    remote read-ahead of small reads (``remote.RemoteFile``), for a reader used once.
    """

    def __init__(self, storage: Storage, rel: str, *, keep_block: bool = True) -> None:
        self.storage = storage
        self.rel = rel
        self._file: OpenFile | None = storage.backend.open_file(storage.path(rel),
                                                                keep_block=keep_block)

    def pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``; fewer only at the end of the file."""
        if offset < 0 or length < 0:
            raise CkptError(f"negative read ({offset}, {length}) in {self.storage.url_of(self.rel)}")
        assert self._file is not None, "pread after close"
        return self._file.pread(offset, length)

    @property
    def fileno(self) -> int | None:
        """The OS file descriptor of a local file (None remotely or once closed)."""
        return self._file.fileno if self._file is not None else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

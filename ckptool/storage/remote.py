"""The fsspec backend (``s3://``, ``hf://``, ``memory://``, ...): ranged GETs, fresh listings.

Implements ``base.Backend`` over one fsspec file system. Differences from the local one,
which callers must not rely on away: ``fsync`` is a no-op (there are no folders to sync, and a
PUT is durable once it returns), ``rename`` copies and deletes (``atomic_rename`` is False),
and listings of a root are made fresh (``exists``/``isdir`` with ``fresh=True``, ``listdir``).
"""

from __future__ import annotations

import posixpath
import threading
from typing import Any

from ckptool.errors import CheckpointNotFoundError
from ckptool.storage.base import Entry


class RemoteFile:
    """An open remote file. Each read is its own ranged request (``fs.cat_file(start=,
    end=)``), so ``pread`` is safe to call from several threads at once.

    With ``keep_block`` (the default), a read shorter than ``WINDOW`` fetches ``WINDOW`` bytes
    from its offset, and each thread keeps its last two such windows: later reads inside one
    are answered from memory (parsers read a header a few bytes at a time; a record's zip
    directory lies just before the next record's headers, so locating a file's records in
    order costs about one request each), and a read that starts inside one fetches only the
    rest. Without it every read fetches exactly its bytes (one-shot reads).
    """

    fileno = None
    WINDOW = 4 << 20

    def __init__(self, fs: Any, path: str, *, keep_block: bool = True) -> None:
        self.fs = fs
        self.path = path
        self.size = int(fs.size(path))  # FileNotFoundError here, as opening would raise
        self.keep_block = keep_block
        self._kept = threading.local()  # .windows: [(start, bytes)], newest first

    def pread(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        for start, data in getattr(self._kept, "windows", ()):
            if start <= offset < start + len(data):
                head = data[offset - start : end - start]
                return head if offset + len(head) == end else head + self._fetch(offset + len(head), end)
        return self._fetch(offset, end)

    def _fetch(self, offset: int, end: int) -> bytes:
        """Bytes ``offset:end`` from the store (``end`` within the file)."""
        if not self.keep_block or end - offset >= self.WINDOW:
            return self._get(offset, end)
        data = self._get(offset, min(self.size, offset + self.WINDOW))
        self._kept.windows = [(offset, data), *getattr(self._kept, "windows", ())[:1]]
        return data[: end - offset]

    def _get(self, start: int, end: int) -> bytes:
        return bytes(self.fs.cat_file(self.path, start=start, end=end))

    def close(self) -> None:
        self._kept = threading.local()


class FsspecBackend:
    """``base.Backend`` over an fsspec file system ``fs``."""

    is_local = False
    atomic_rename = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def join(self, root: str, rel: str) -> str:
        return posixpath.join(root, rel)

    def dirname(self, path: str) -> str:
        return posixpath.dirname(path.rstrip("/"))

    def url(self, path: str) -> str:
        protocol = self.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return f"{protocol}://{path.lstrip('/') if protocol != 'memory' else path}"

    def _fresh(self, path: str) -> str:
        """``path``, with fsspec's listing cache for it (and its parents) dropped: s3fs answers
        ``ls``/``exists`` from listings it cached earlier, so files another process (a peer
        rank, DCP's async saver) wrote since would stay invisible. A file inside is then
        checked against that fresh listing (one request per folder, not one per file)."""
        self.fs.invalidate_cache(path)
        return path

    def exists(self, path: str, *, fresh: bool = False) -> bool:
        return bool(self.fs.exists(self._fresh(path) if fresh else path))

    def isdir(self, path: str, *, fresh: bool = False) -> bool:
        return bool(self.fs.isdir(self._fresh(path) if fresh else path))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def islink(self, path: str) -> bool:
        return False

    def inside(self, root: str, rel: str) -> bool:
        norm = posixpath.normpath(rel)
        return not (norm.startswith("..") or norm.startswith("/"))

    def listdir(self, path: str) -> list[Entry]:
        try:
            infos = self.fs.ls(self._fresh(path), detail=True)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{self.url(path)} does not exist", path=path) from e
        out = []
        for info in infos:
            name = posixpath.basename(info["name"].rstrip("/"))
            is_dir = info.get("type") == "directory"
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(Entry(name, is_dir, int(info.get("size") or 0), mtime))
        return sorted(out, key=lambda x: x.name)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def open_file(self, path: str, *, keep_block: bool = True) -> RemoteFile:
        return RemoteFile(self.fs, path, keep_block=keep_block)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def fsync(self, path: str) -> None:
        """Nothing to do: an object store has no folder entries to flush, and each PUT is
        durable once it returns."""

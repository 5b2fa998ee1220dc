"""The fsspec backend (``s3://``, ``hf://``, ``memory://``, ...): ranged GETs, fresh listings.

Implements ``base.Backend`` over one fsspec file system; ``StreamedFile`` reads a file front to
back over one request (consolidate's remote copy). Differences from the local one,
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


class StreamedFile:
    """A remote file read front to back, up to byte ``end``, in bounded memory.

    Where the file system streams files (``fs.open_async``, e.g. s3fs), the bytes come over
    ONE request, its body read as it arrives, as ``s3fs``'s ``get`` reads a file; elsewhere
    (``memory://``, file systems without streamed files) as ranged requests of ``block``
    bytes. After a skip longer than ``block`` (a new request costs less than reading through)
    or a failed read of the stream (a reset connection), ranged requests go on from there:
    they retry, and raise what persists. At most ``block`` bytes are held between reads.
    One thread at a time; ``close`` (or the ``with`` block's end) ends the request.
    """

    def __init__(self, fs: Any, path: str, end: int, *, block: int) -> None:
        self.fs, self.path, self.end, self.block = fs, path, end, block
        self.pos = 0  # of the next byte ``read`` returns; ``_buf`` holds the bytes from there
        self._buf = memoryview(b"")
        self._stream: Any = None
        if getattr(fs, "async_impl", False):
            try:
                self._stream = _sync(fs, fs.open_async, path, "rb")  # no request yet
            except NotImplementedError:  # an async file system without streamed files
                pass

    def __enter__(self) -> StreamedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def peek(self, n: int) -> memoryview:
        """The next ``n`` bytes (fewer only at ``end`` or at the end of the file), left unread."""
        n = max(0, min(n, self.end - self.pos))
        if len(self._buf) < n:  # ranged: a block's worth at once, not a request a read
            self._buf = memoryview(self._fetch(n if self._stream is not None
                                               else max(n, self.block)))
        return self._buf[:n]

    def read(self, n: int) -> memoryview:
        """The next ``n`` bytes (fewer only at ``end`` or at the end of the file)."""
        out = self.peek(n)
        self._buf = self._buf[len(out):] if len(self._buf) > len(out) else memoryview(b"")
        self.pos += len(out)
        return out

    def skip(self, n: int) -> None:
        """Pass the next ``n`` bytes: read through (and dropped) on the stream, else jumped."""
        if n < 0:
            raise ValueError(f"{self.path}: a stream cannot go back {-n} bytes")
        if n > self.block:
            self.close()
        while n > 0 and self._stream is not None and (got := len(self.read(min(n, self.block)))):
            n -= got
        if self._stream is None:
            self._buf, self.pos = self._buf[n:], self.pos + n

    def _fetch(self, n: int) -> bytes | bytearray:
        """The next ``n`` bytes (fewer at the end): those buffered, then those fetched."""
        have, start = self._buf, self.pos + len(self._buf)
        n = min(n, self.end - self.pos)
        if self._stream is not None:
            try:
                return _sync(self.fs, _read_exact, self._stream, n, have)
            except Exception:  # noqa: BLE001  (ranged requests go on, and raise what persists)
                self.close()
        more = self.fs.cat_file(self.path, start=start, end=self.pos + n)
        return bytes(have) + more if len(have) else more

    def close(self) -> None:
        """End the streamed request, if any (its connection is dropped, not reused half read)."""
        f, self._stream = self._stream, None
        if f is not None:
            _sync(self.fs, _close, f)


def _sync(fs: Any, coro_fn: Any, *args: Any) -> Any:
    """``await coro_fn(*args)`` on the file system's event loop, from this thread."""
    from fsspec.asyn import sync  # lazy: fsspec is imported only for URLs

    return sync(fs.loop, coro_fn, *args)


async def _read_exact(f: Any, n: int, head: memoryview) -> bytearray:
    """``head``, then the next bytes of an async streamed file up to ``n`` in all (fewer at
    its end). Its ``read`` returns at most what has arrived, joined: asked for at most 1 MiB
    at a time, so that copy stays small."""
    out, got = bytearray(n), len(head)
    out[:got] = head
    while got < n:
        data = await f.read(min(n - got, 1 << 20))
        if not data:
            del out[got:]
            break
        out[got:got + len(data)] = data
        got += len(data)
    return out


async def _close(f: Any) -> None:
    body = getattr(f, "r", None)  # the response being read (s3fs, http): closing it ends the GET
    if body is not None:
        body.close()
    await f.close()


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

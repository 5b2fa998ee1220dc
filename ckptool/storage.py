"""File access for checkpoints: local paths (fast path: os.pread) and fsspec URLs.

Owns *how bytes move*: listing, stat, ranged reads, and atomic output (write under a temporary
name, rename at the end). It knows nothing about the DCP format (that is ``format/``).
A ``Storage`` is rooted at one folder; every path given to it is relative to that root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import CheckpointNotFoundError, CkptError

#: Read granularity for streaming copies and checksums.
BLOCK = 8 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool
    size: int
    mtime: float | None


def is_url(path: str | os.PathLike[str]) -> bool:
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def _strip_file_scheme(s: str) -> str:
    return s[len("file://") :] if s.startswith("file://") else s


class Storage:
    """A folder, local or remote, with ranged reads.

    Example:
        >>> st = Storage.open("runs/demo/step_10")
        >>> head = st.read_range(".metadata", 0, 16)
    """

    def __init__(self, root: str, fs: Any = None) -> None:
        self.root = root
        self.fs = fs  # None: local file system through os.*

    # -- construction -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Storage:
        s = os.fspath(path)
        if is_url(s):
            import fsspec  # lazy: fsspec is only needed for URLs

            fs, root = fsspec.core.url_to_fs(s)
            return cls(root.rstrip("/"), fs)
        return cls(os.path.abspath(_strip_file_scheme(s)))

    @property
    def is_local(self) -> bool:
        return self.fs is None

    @property
    def url(self) -> str:
        if self.fs is None:
            return self.root
        protocol = self.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return f"{protocol}://{self.root.lstrip('/') if protocol != 'memory' else self.root}"

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def child(self, rel: str) -> Storage:
        return Storage(self.path(rel), self.fs)

    def parent(self) -> Storage:
        if self.fs is None:
            return Storage(os.path.dirname(self.root.rstrip("/")) or "/", None)
        return Storage(posixpath.dirname(self.root.rstrip("/")), self.fs)

    @property
    def name(self) -> str:
        return os.path.basename(self.root.rstrip("/"))

    def path(self, rel: str = "") -> str:
        if not rel:
            return self.root
        if self.fs is None:
            return os.path.join(self.root, rel)
        return posixpath.join(self.root, rel)

    # -- queries ------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        if self.fs is None:
            return os.path.lexists(self.path(rel))
        return bool(self.fs.exists(self.path(rel) if rel else self._fresh()))

    def isdir(self, rel: str = "") -> bool:
        if self.fs is None:
            return os.path.isdir(self.path(rel))
        return bool(self.fs.isdir(self.path(rel) if rel else self._fresh()))

    def isfile(self, rel: str) -> bool:
        if self.fs is None:
            return os.path.isfile(self.path(rel))
        return bool(self.fs.isfile(self.path(rel)))

    def _fresh(self, rel: str = "") -> str:
        """The remote path of ``rel``, with fsspec's listing cache for it (and its parents)
        dropped: s3fs answers ``ls``/``exists`` from listings it cached earlier, so files
        another process (a peer rank, DCP's async saver) wrote since would stay invisible.
        Used by ``listdir`` and by ``exists``/``isdir`` of the root; a file inside is then
        checked against that fresh listing (one request per folder, not one per file)."""
        p = self.path(rel)
        self.fs.invalidate_cache(p)
        return p

    def islink(self, rel: str) -> bool:
        return self.fs is None and os.path.islink(self.path(rel))

    def realpath_inside(self, rel: str) -> bool:
        """True when ``rel`` (after following symlinks) stays inside the root."""
        if self.fs is not None:
            norm = posixpath.normpath(rel)
            return not (norm.startswith("..") or norm.startswith("/"))
        root = os.path.realpath(self.root)
        target = os.path.realpath(self.path(rel))
        return target == root or target.startswith(root + os.sep)

    def listdir(self, rel: str = "") -> list[Entry]:
        p = self.path(rel)
        if self.fs is None:
            out = []
            try:
                with os.scandir(p) as it:
                    for e in it:
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        out.append(Entry(e.name, e.is_dir(), st.st_size, st.st_mtime))
            except FileNotFoundError as e:
                raise CheckpointNotFoundError(f"{p} does not exist", path=p) from e
            except NotADirectoryError as e:
                raise CheckpointNotFoundError(f"{p} is not a folder", path=p) from e
            return sorted(out, key=lambda x: x.name)
        out = []
        try:
            infos = self.fs.ls(self._fresh(rel), detail=True)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{self.url_of(rel)} does not exist", path=p) from e
        for info in infos:
            name = posixpath.basename(info["name"].rstrip("/"))
            is_dir = info.get("type") == "directory"
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(Entry(name, is_dir, int(info.get("size") or 0), mtime))
        return sorted(out, key=lambda x: x.name)

    def url_of(self, rel: str = "") -> str:
        return self.url if not rel else f"{self.url.rstrip('/')}/{rel}"

    def size(self, rel: str) -> int:
        if self.fs is None:
            return os.stat(self.path(rel)).st_size
        return int(self.fs.size(self.path(rel)))

    # -- reads --------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        if self.fs is None:
            with open(self.path(rel), "rb") as f:
                return f.read()
        return bytes(self.fs.cat_file(self.path(rel)))

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer only if the file is shorter."""
        with self.reader(rel) as r:
            return r.pread(offset, length)

    @contextlib.contextmanager
    def reader(self, rel: str) -> Iterator[RangeReader]:
        r = RangeReader(self, rel)
        try:
            yield r
        finally:
            r.close()

    # -- writes -------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        if self.fs is None:
            os.makedirs(self.path(rel), exist_ok=True)
        else:
            self.fs.makedirs(self.path(rel), exist_ok=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.fs is None:
            with open(self.path(rel), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(self.path(rel), data)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        if self.fs is None:
            os.replace(self.path(src_rel), self.path(dst_rel))
        else:
            self.fs.mv(self.path(src_rel), self.path(dst_rel), recursive=True)

    def remove_tree(self, rel: str = "") -> None:
        if self.fs is None:
            p = self.path(rel)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.lexists(p):
                os.remove(p)
        elif self.fs.exists(self.path(rel)):
            self.fs.rm(self.path(rel), recursive=True)


class RangeReader:
    """One open file with positional reads (``os.pread`` locally, ranged GETs remotely)."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage = storage
        self.rel = rel
        self._fd: int | None = None
        self._fh: Any = None
        p = storage.path(rel)
        if storage.fs is None:
            self._fd = os.open(p, os.O_RDONLY)
        else:
            self._fh = storage.fs.open(p, "rb", block_size=BLOCK, cache_type="readahead")

    def pread(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise CkptError(f"negative read ({offset}, {length}) in {self.storage.url_of(self.rel)}")
        if self._fd is not None:
            chunks = []
            while length > 0:
                b = os.pread(self._fd, min(length, 1 << 30), offset)
                if not b:
                    break
                chunks.append(b)
                offset += len(b)
                length -= len(b)
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]
        self._fh.seek(offset)
        return self._fh.read(length)

    @property
    def fileno(self) -> int | None:
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@contextlib.contextmanager
def atomic_path(dst: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling path of local ``dst``; rename it onto ``dst`` on success.

    On any exception the temporary file or folder is removed, so a failure never leaves
    output that looks valid. ``dst`` itself is replaced only at the very end.
    """
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException as e:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        if isinstance(e, OSError) and _is_output_error(e, dst):
            raise CkptError(
                f"cannot write {dst}: {e.strerror or e}; nothing was written", path=str(dst),
                hint="Free space, fix the permissions, or choose another destination",
            ) from e
        raise


# Errors that can only come from writing (or from a file under the destination's folder).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR}


def _is_output_error(e: OSError, dst: Path) -> bool:
    if e.errno in _WRITE_ERRNOS:
        return True
    if e.errno in _PATH_ERRNOS and e.filename is not None:
        return os.path.abspath(os.fsdecode(e.filename)).startswith(os.path.abspath(dst.parent))
    return False

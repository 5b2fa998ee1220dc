"""The local file system backend: ``os.*`` calls, ``os.pread`` reads, real ``fsync``.

Implements ``base.Backend`` for absolute local paths. ``Storage.open`` picks it for any path
that is not an fsspec URL (``file://`` included).
"""

from __future__ import annotations

import os

from ckptool.errors import CheckpointNotFoundError
from ckptool.storage.base import Entry

#: Largest single ``os.pread`` (Linux caps one read near 2 GiB).
_MAX_READ = 1 << 30


class LocalFile:
    """An open local file: ``os.pread`` at any offset, from any thread (no shared position)."""

    def __init__(self, path: str) -> None:
        self.fileno: int | None = os.open(path, os.O_RDONLY)

    def pread(self, offset: int, length: int) -> bytes:
        assert self.fileno is not None, "pread after close"
        chunks = []
        while length > 0:
            b = os.pread(self.fileno, min(length, _MAX_READ), offset)
            if not b:
                break
            chunks.append(b)
            offset += len(b)
            length -= len(b)
        return b"".join(chunks) if len(chunks) != 1 else chunks[0]

    def close(self) -> None:
        if self.fileno is not None:
            os.close(self.fileno)
            self.fileno = None


class LocalBackend:
    """``base.Backend`` over ``os.*``; ``rename`` is atomic and ``fsync`` reaches the disk."""

    is_local = True
    atomic_rename = True
    fs = None

    def join(self, root: str, rel: str) -> str:
        return os.path.join(root, rel)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path.rstrip("/")) or "/"

    def url(self, path: str) -> str:
        return path

    def exists(self, path: str, *, fresh: bool = False) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str, *, fresh: bool = False) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def islink(self, path: str) -> bool:
        return os.path.islink(path)

    def inside(self, root: str, rel: str) -> bool:
        real_root = os.path.realpath(root)
        target = os.path.realpath(os.path.join(root, rel))
        return target == real_root or target.startswith(real_root + os.sep)

    def listdir(self, path: str) -> list[Entry]:
        out = []
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except OSError:  # vanished or a dangling link: not part of the listing
                        continue
                    out.append(Entry(e.name, e.is_dir(), st.st_size, st.st_mtime))
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path} does not exist", path=path) from e
        except NotADirectoryError as e:
            raise CheckpointNotFoundError(f"{path} is not a folder", path=path) from e
        return sorted(out, key=lambda x: x.name)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_file(self, path: str, *, keep_block: bool = True) -> LocalFile:
        return LocalFile(path)  # the page cache is the kept block here

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def write_bytes(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil  # (here: a command that only reads starts faster)

            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)

    def fsync(self, path: str) -> None:
        """Flush a file or a folder (its entries: a rename inside it) to disk; best effort,
        since some file systems cannot fsync a folder (the files themselves were synced)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

"""Atomic local output: write under a temporary sibling name, rename onto the target at the end.

Used by the ops that write local outputs (consolidate, reshard, import). A failure never
leaves output that looks valid, and errors that can only come from writing become one-line
``CkptError``s naming the destination.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckptool.errors import CkptError


@contextlib.contextmanager
def atomic_path(dst: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling path of local ``dst``; rename it onto ``dst`` on success.

    On any exception the temporary file or folder is removed, so a failure never leaves
    output that looks valid. ``dst`` itself is replaced only at the very end.
    """
    import shutil  # (here: a command that only reads starts faster)

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

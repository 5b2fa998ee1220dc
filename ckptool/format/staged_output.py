"""Committing an export: write into a temporary path, then rename it (or merge it) into place.

Owns ``StagedOutput`` (a ``.safetensors`` file or a folder of shards written under a temporary
sibling name, refused over an existing output unless ``replace``) and the merge of a new
export into a non-empty folder, replacing only the export's own files. Writing the bytes is
``safetensors_writer.py``'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckptool.errors import ConfigError
from ckptool.format.hf_source import INDEX_NAME, SINGLE_NAME
from ckptool.storage import atomic_path


class StagedOutput:
    """Where to write an export: a temporary path, committed only when the block succeeds.

    A ``.safetensors`` file (``single=True``) is written under a temporary sibling name and
    renamed onto ``dst``. A folder is written as a temporary sibling folder and renamed into
    place. An existing output is refused unless ``replace``: then a file is replaced, and in a
    non-empty folder only the export's own files are (``model*.safetensors`` shards and the
    index, as ``save_pretrained`` does; ``removed`` lists the old ones that went): the new
    files are moved in one by one, the old index removed first and the new index moved in
    last; other files (a tokenizer, a README) are left. On any exception (including
    ``KeyboardInterrupt``) the temporary path is removed and ``dst`` is left as it was.

    Example:
        >>> with StagedOutput(Path("out/hf"), single=False) as tmp:
        ...     (tmp / "model.safetensors").write_bytes(data)
    """

    def __init__(self, dst: Path, *, single: bool, replace: bool = False) -> None:
        self.dst, self.single, self.replace = dst, single, replace
        fresh = single or not dst.exists() or (dst.is_dir() and not any(dst.iterdir()))
        self._staging = dst if fresh else dst / ".ckptool-staging"
        self._atomic = atomic_path(self._staging)
        self._merge = not fresh
        self._replaced_file = single and replace and dst.is_file()
        self.removed: list[str] = []

    def __enter__(self) -> Path:
        if not self.dst.parent.is_dir():
            raise ConfigError(f"{self.dst.parent} does not exist; create it first")
        self._refuse_existing()
        tmp = self._atomic.__enter__()
        if not self.single:
            try:
                tmp.mkdir()
            except OSError as e:  # e.g. a read-only destination: let atomic_path word it
                self._atomic.__exit__(type(e), e, e.__traceback__)
                raise
        return tmp

    def _refuse_existing(self) -> None:
        dst = self.dst
        if self._merge and not dst.is_dir():
            raise ConfigError(f"{dst} is a file; pass a new folder or a .safetensors name")
        if self.replace:
            return
        if self.single and (dst.exists() or dst.is_symlink()):
            raise ConfigError(f"{dst} already exists", path=str(dst),
                              hint="Pass --force to replace it, or choose another OUTPUT")
        if self._merge:
            held = sorted(p.name for p in dst.iterdir())
            shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            raise ConfigError(
                f"{dst} is not empty ({shown})", path=str(dst),
                hint="Pass --force to replace the weight files in it (model*.safetensors and "
                     "the index; other files are kept), or choose a new folder")

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> bool:
        self._atomic.__exit__(et, ev, tb)  # on failure: removes tmp; the error then propagates
        if self._merge and ev is None:
            self.removed = _merge_into(self._staging, self.dst)
        elif self._replaced_file and ev is None:
            self.removed = [self.dst.name]  # the rename replaced it
        return False


def _merge_into(staging: Path, dst: Path) -> list[str]:
    """Move the new export files in; return the names of old export files that went."""
    new = {p.name for p in staging.iterdir()}
    removed = []
    if (dst / INDEX_NAME).exists():  # never leave an index naming stale shards
        (dst / INDEX_NAME).unlink()
        removed.append(INDEX_NAME)
    for old in sorted(dst.glob("model*.safetensors")):
        if old.name == SINGLE_NAME or "-of-" in old.name:
            removed.append(old.name)
            if old.name not in new:
                old.unlink()
    removed += sorted(n for n in new if n not in removed and (dst / n).exists())
    for name in sorted(new, key=lambda n: n == INDEX_NAME):
        os.replace(staging / name, dst / name)
    shutil.rmtree(staging, ignore_errors=True)
    return removed

"""Checks of the safetensors files ``upload`` is about to send; no tensor is loaded.

Owns: that every ``*.safetensors`` header parses and its tensors tile the file exactly (the
header itself is read by ``safetensors_source.read_header``), that ``model.safetensors.index.json``
names files that exist, the tensors they hold and their total size, and the one error shape
of these checks (``CorruptCheckpointError`` ending "nothing was sent").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.format.safetensors_writer import INDEX_NAME


@dataclass(frozen=True)
class Weights:
    """What the checked weight files hold."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    dtypes: tuple[str, ...]
    metadata: dict[str, str]



def check_weights(folder: str | os.PathLike[str]) -> Weights:
    """Check every ``*.safetensors`` file in ``folder`` and its index, reading headers only.

    Args:
        folder: holds ``model.safetensors``, or shards and ``model.safetensors.index.json``.

    Returns:
        The weight files (sorted), tensor count, data bytes and dtypes.

    Raises:
        CorruptCheckpointError: a header does not parse or does not cover its file exactly,
            or the index names a missing file or tensor, or its ``total_size`` is wrong.
    """
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise not_sent(shown(folder), "there are no .safetensors files to send")
    checked = {p.name: _check_file(p) for p in shards}
    held = {name: tensors for name, (tensors, _) in checked.items()}
    index = folder / INDEX_NAME
    if index.exists():
        _check_index(index, held)
    elif len(shards) != 1:
        raise CorruptCheckpointError(
            f"{shown(folder)} holds {len(shards)} .safetensors files and no {INDEX_NAME}; "
            "nothing was sent", hint="Export with 'ckptool consolidate CKPT FOLDER' to get an index")
    sizes = {name: n for tensors in held.values() for name, (_, n) in tensors.items()}
    dtypes = {dt for tensors in held.values() for dt, _ in tensors.values()}
    meta = checked[shards[0].name][1]
    return Weights(tuple(held), len(sizes), sum(sizes.values()), tuple(sorted(dtypes)), meta)


def _check_file(path: Path) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """(name -> (dtype, data bytes), ``__metadata__``) of a file whose tensors tile its data.

    The header is checked by the one safetensors reader (``safetensors_source.read_header``:
    bounds, dtypes, sizes, overlaps); here, also that the tensors leave no gap or tail."""
    from ckptool.format.safetensors_source import SourceError, read_header
    from ckptool.storage import Storage

    where = shown(path)
    try:
        header = read_header(Storage.open(path.parent), path.name)
    except SourceError as e:
        raise not_sent(where, f"not a valid safetensors file: {e.what}") from None
    out, end = {}, header.header_bytes
    for t in header.tensors.values():  # data order
        if t.start != end:
            raise not_sent(where, f"tensor {t.name} starts at byte {t.start}, expected {end} "
                              "(a gap in the data)")
        out[t.name], end = (t.dtype.name, t.nbytes), t.start + t.nbytes
    if end != header.size:
        raise not_sent(where, f"the tensors end at byte {end} but the file has {header.size} bytes "
                          "(truncated or with trailing data)")
    return out, dict(header.metadata)


def _check_index(index: Path, held: dict[str, dict[str, tuple[str, int]]]) -> None:
    where = shown(index)
    weight_map, total = read_index(index)
    for name, file in weight_map.items():
        if file not in held:
            raise not_sent(where, f"its weight_map puts {name} in {file}, which does not exist")
        if name not in held[file]:
            raise not_sent(where, f"its weight_map puts {name} in {file}, which does not hold it")
    for file, tensors in held.items():
        extra = sorted(set(tensors) - {n for n, f in weight_map.items() if f == file})
        if extra:
            raise not_sent(where, f"{file} holds {extra[0]}, which its weight_map does not list")
    nbytes = sum(n for tensors in held.values() for _, n in tensors.values())
    if total != nbytes:
        raise not_sent(where, f"metadata.total_size is {total} but the shards hold {nbytes} bytes of "
                          "tensors")


def read_index(index: Path) -> tuple[dict[str, str], Any]:
    try:
        obj = json.loads(index.read_bytes())
        weight_map = obj["weight_map"]
        ok = isinstance(weight_map, dict) and bool(weight_map) and all(
            isinstance(f, str) and f == os.path.basename(f) and f.endswith(".safetensors")
            for f in weight_map.values())
        total = (obj.get("metadata") or {}).get("total_size")
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise not_sent(shown(index), "not a safetensors index (a JSON object whose weight_map maps "
                                  "tensor names to .safetensors files in the same folder)")
    return weight_map, total


def not_sent(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {what}; nothing was sent", path=where,
        hint="Re-export it with 'ckptool consolidate', or upload the DCP checkpoint directly")


def shown(path: Path) -> str:
    """The user's own path for a link in the staging folder."""
    return os.path.realpath(path)

"""One safetensors file's header, read as untrusted data and checked against the file (torch-free).

Owns ``read_header``, the one safetensors header reader (header length inside the file, a JSON
object of known dtypes, ``data_offsets`` consistent with shape x itemsize and inside the file,
no two tensors overlapping), its ``Header``/``HeaderTensor`` records and ``SourceError``. Which
files make a checkpoint, and its index, are ``safetensors_source.py``'s.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.format.dtypes import BY_SAFETENSORS, DType
from ckptool.format.metadata import MAX_NDIM
from ckptool.storage import Storage

#: safetensors' own limit on the header (100 MB).
MAX_HEADER = 100_000_000


class SourceError(CorruptCheckpointError):
    """A problem with a safetensors checkpoint; ``code`` is the validate finding code."""

    def __init__(self, code: str, message: str, *, path: str | None = None,
                 hint: str | None = None, what: str | None = None) -> None:
        super().__init__(message, path=path, hint=hint, code=code)
        self.what = what or message  # the problem without the file name, for re-wording


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of a safetensors file: ``nbytes`` at absolute byte ``start`` of the file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: tensors in data order, ``__metadata__``, the file size."""

    rel: str
    tensors: dict[str, HeaderTensor]
    metadata: dict[str, str]
    header_bytes: int
    size: int


def read_header(storage: Storage, rel: str, *, size: int | None = None) -> Header:
    """Read and check the header of ``rel`` against the file's size (no tensor data is read).

    Raises:
        SourceError: the file is too short, the header does not fit, is not a JSON object of
            known dtypes, or a tensor's ``data_offsets`` disagree with its shape, lie past the
            end of the file or overlap another tensor.
    """
    where = storage.url_of(rel)
    size = storage.size(rel) if size is None else size

    def bad(code: str, what: str) -> SourceError:
        return SourceError(code, f"{where}: {what}", path=where, what=what,
                           hint="The file is damaged or was not written completely")

    if size < 8:
        raise bad("truncated-file", f"{size} bytes, too short for a safetensors file")
    prefix = storage.read_range(rel, 0, 8)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER or 8 + n > size:
        raise bad("bad-header" if n > MAX_HEADER else "truncated-file",
                  f"header length {n} does not fit the file ({size} bytes)")
    try:
        header = json.loads(storage.read_range(rel, 8, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("bad-header", f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("bad-header", "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("bad-header", "__metadata__ is not a map of strings")
    start, data = 8 + n, size - 8 - n
    tensors = [_entry(name, info, start, data, bad) for name, info in header.items()]
    tensors.sort(key=lambda t: (t.start, t.nbytes))
    end = start
    for t in tensors:
        if t.start < end and t.nbytes:
            raise bad("record-overlap", f"tensor {t.name} overlaps the tensor before it")
        end = max(end, t.start + t.nbytes)
    return Header(rel, {t.name: t for t in tensors}, meta, start, size)


def _entry(name: str, info: Any, start: int, data: int, bad: Any) -> HeaderTensor:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad("bad-header", f"tensor {name!r} is not a {{dtype, shape, data_offsets}} entry")
    dtype = BY_SAFETENSORS.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise bad("bad-header", f"tensor {name!r} has unknown dtype {info['dtype']!r}")
    shape, offs = info["shape"], info["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise bad("bad-header", f"tensor {name!r} has a bad shape {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise bad("bad-header", f"tensor {name!r} has bad data_offsets {offs!r}")
    if offs[1] > data:
        raise bad("truncated-file", f"tensor {name!r} ends at data byte {offs[1]}, past the end "
                  f"of the file ({data} data bytes): the file is truncated or its header lies")
    nbytes = math.prod(shape) * dtype.itemsize
    if offs[1] - offs[0] != nbytes:
        raise bad("bad-header", f"tensor {name!r} spans {offs[1] - offs[0]} bytes but shape "
                  f"{shape} of {dtype} needs {nbytes}")
    return HeaderTensor(name, dtype, tuple(shape), start + offs[0], nbytes)

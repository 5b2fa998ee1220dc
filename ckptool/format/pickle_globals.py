"""Every global a checkpoint pickle may name, and the inert stand-in each one loads as.

The one place that spells torch's module and class paths, its private ones included
(``torch.distributed.checkpoint.filesystem._StorageInfo``, ``_MEM_FORMAT_ENCODING``,
``torch._utils._rebuild_tensor_v2``, ``torch.serialization._get_layout``). ckptool never
imports them: it reads pickles through ``safe_pickle`` with one of the allow-lists below, and
``_dcp_compat.py`` writes ``.metadata`` naming the same globals. When torch renames one, this
module and ``tests/unit/test_reshard_format.py`` (pinned to ``_dcp_compat.TESTED_TORCH``)
change together.

Two allow-lists, for two kinds of pickle:

* ``METADATA_GLOBALS``: DCP's ``.metadata`` (a ``_Metadata`` and the classes it holds), read
  by ``metadata.py``. Each DCP class loads as a ``Record`` stand-in.
* ``TENSOR_GLOBALS`` / ``OBJECT_GLOBALS``: the ``data.pkl`` of a ``torch.save`` record inside
  a ``.distcp`` file (a tensor, or a non-tensor value, which may also be an ``io.BytesIO``),
  read by ``torch_records.py``. A tensor loads as a ``_TensorStub`` of its geometry.

Both share ``torch.Size`` (as a tuple). The stand-ins keep the names they had in the modules
that read them (``_StorageInfo``, ``_TensorStub``, ...): error messages name them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptool.format.dtypes import BY_STORAGE, DTYPES, DType
from ckptool.format.safe_pickle import Record

__all__ = [
    "BYTES_IO", "DCP_FILESYSTEM", "DCP_METADATA", "GET_LAYOUT", "MEM_FORMAT_ENCODING",
    "METADATA_GLOBALS", "OBJECT_GLOBALS", "REBUILD_TENSOR_V2", "STORAGE_INFO", "STRIDED",
    "TENSOR_GLOBALS", "TORCH_SIZE", "SavedBytes", "torch_size",
    # the stand-ins, for the isinstance checks of metadata.py and torch_records.py
    "_BytesStorageMetadata", "_ChunkStorageMetadata", "_DTypeToken", "_Metadata",
    "_MetadataIndex", "_StorageInfo", "_StorageMeta", "_StorageStub", "_StorageType",
    "_TensorProperties", "_TensorStorageMetadata", "_TensorStub", "_storage_pid",
]

#: Where DCP's public metadata classes live (and its private ``_MEM_FORMAT_ENCODING``).
DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: Where DCP's private ``_StorageInfo`` lives.
DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
TORCH_SIZE = ("torch", "Size")
STORAGE_INFO = (DCP_FILESYSTEM, "_StorageInfo")
MEM_FORMAT_ENCODING = (DCP_METADATA, "_MEM_FORMAT_ENCODING")
GET_LAYOUT = ("torch.serialization", "_get_layout")
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
BYTES_IO = ("_io", "BytesIO")
#: ``str(torch.strided)``: the only layout DCP records.
STRIDED = "torch.strided"


def torch_size(dims: Any = ()) -> tuple[Any, ...]:
    """``torch.Size(dims)`` as a plain tuple."""
    return tuple(dims)


# ---------------------------------------------------------------------------------------------
# .metadata: DCP's classes as records


class _Metadata(Record):
    pass


class _TensorStorageMetadata(Record):
    pass


class _BytesStorageMetadata(Record):
    pass


class _ChunkStorageMetadata(Record):
    pass


class _TensorProperties(Record):
    _positional = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class _StorageMeta(Record):
    pass


class _StorageInfo(Record):
    pass


class _MetadataIndex(Record):
    _positional = ("fqn", "offset", "index")

    def __hash__(self) -> int:  # used as a dict key in storage_data
        return id(self)


@dataclass(frozen=True)
class _DTypeToken:
    """A ``torch.<dtype>`` global, by name."""

    name: str


# Real torch dtypes ckptool does not convert: read as data, refused with a clear message.
_OTHER_TORCH_DTYPES = (
    "complex128", "complex32", "cdouble", "chalf", "qint8", "quint8", "qint32", "quint4x2",
    "quint2x4", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    *(f"uint{i}" for i in range(1, 8)), *(f"int{i}" for i in range(1, 8)),
)

METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (DCP_METADATA, "Metadata"): _Metadata,
    (DCP_METADATA, "TensorStorageMetadata"): _TensorStorageMetadata,
    (DCP_METADATA, "BytesStorageMetadata"): _BytesStorageMetadata,
    (DCP_METADATA, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (DCP_METADATA, "TensorProperties"): _TensorProperties,
    (DCP_METADATA, "MetadataIndex"): _MetadataIndex,
    (DCP_METADATA, "StorageMeta"): _StorageMeta,
    MEM_FORMAT_ENCODING: lambda v: int(v),
    STORAGE_INFO: _StorageInfo,
    TORCH_SIZE: torch_size,
    GET_LAYOUT: lambda name: str(name),
    ("torch", "strided"): STRIDED,
    ("pathlib", "PosixPath"): lambda *a: "/".join(map(str, a)),
    ("pathlib", "WindowsPath"): lambda *a: "\\".join(map(str, a)),
    ("pathlib", "PurePosixPath"): lambda *a: "/".join(map(str, a)),
    **{("torch", name): _DTypeToken(name) for name in (*DTYPES, *_OTHER_TORCH_DTYPES)},
}


# ---------------------------------------------------------------------------------------------
# torch.save records: a tensor's geometry, or a value's plain data


@dataclass(frozen=True)
class _StorageStub:
    dtype: DType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorStub:
    storage: _StorageStub
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: DType


def _storage_pid(pid: Any) -> _StorageStub:
    """The ``persistent_load`` of a record: a storage reference, checked, as a stub."""
    # torch.save's zip format: ('storage', storage_type, key, location, numel)
    if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
            or type(pid[4]) is not int or pid[4] < 0 or not pid[2].isdigit()):
        raise ValueError(f"unexpected persistent id {pid!r}")
    return _StorageStub(pid[1].dtype, pid[2], pid[4])


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorStub:
    if not isinstance(storage, _StorageStub):
        raise ValueError("tensor without storage")
    dims = (offset, *size, *stride)
    if not all(type(x) is int and x >= 0 for x in dims) or len(size) != len(stride):
        raise ValueError("bad tensor geometry")
    return _TensorStub(storage, offset, tuple(size), tuple(stride))


TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    REBUILD_TENSOR_V2: _rebuild_tensor_v2,
    TORCH_SIZE: torch_size,
    **{("torch", name): _StorageType(dt) for name, dt in BY_STORAGE.items()},
}


class SavedBytes:
    """An ``io.BytesIO`` value of a state dict, as data: its bytes, nothing else.

    DCP's default planner saves every non-tensor value with ``torch.save``, a ``BytesIO`` too,
    so its record pickles ``_io.BytesIO``: NEWOBJ (``BytesIO.__new__``) then BUILD with the
    object's state ``(value, position, __dict__)``. This stand-in accepts exactly that shape
    (type-checked) and keeps only ``data``; nothing in it can run code. (torchtitan's older
    ``train_state`` held three, each a ``torch.save`` archive of a list: opaque bytes here.)
    """

    __slots__ = ("data",)

    def __init__(self, initial: Any = b"") -> None:  # a hand-made REDUCE(BytesIO, (b"...",))
        self.data = _bytes_of(initial)

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and type(state[1]) is int
                and (state[2] is None or type(state[2]) is dict)):
            raise ValueError("bad state for io.BytesIO")
        self.data = _bytes_of(state[0])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SavedBytes) and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        return f"SavedBytes({len(self.data)} bytes)"


def _bytes_of(value: Any) -> bytes:
    if type(value) not in (bytes, bytearray):
        raise ValueError(f"io.BytesIO value is a {type(value).__name__}, not bytes")
    return bytes(value)


#: What a non-tensor value's record may name: the tensor globals (a value may hold tensors)
#: and ``io.BytesIO`` as ``SavedBytes``.
OBJECT_GLOBALS: dict[tuple[str, str], Any] = {**TENSOR_GLOBALS, BYTES_IO: SavedBytes}

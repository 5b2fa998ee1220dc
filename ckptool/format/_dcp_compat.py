"""Writing DCP's ``.metadata`` without torch: the pickle of its private, version-specific classes.

ckptool writes DCP's ``.metadata`` without importing torch (importing it costs seconds and
~265 MB, more than reshard's whole memory budget). The file is a pickle of
``torch.distributed.checkpoint.metadata.Metadata``; this module writes its opcodes directly
(``_Pickle``), so that it loads as what ``pickle.dump`` of the real objects gives: the same
class names (including the private ``torch.distributed.checkpoint.filesystem._StorageInfo``
and ``_MEM_FORMAT_ENCODING``), the same pickled state of each class (``TensorProperties``
pickles a 5-tuple, ``_StorageInfo`` drops ``None`` fields, ``MetadataIndex`` of a non-tensor
has no ``offset``), ``torch.Size`` as ``Size(tuple)``, dtypes as ``torch.<name>`` globals.

Globals are written by name and never imported; the names are ``pickle_globals.py``'s (the
one place that spells torch's paths, also for reading). ``tests/unit/test_reshard_format.py`` loads
the result with torch and compares it with the real dataclasses, pinned to ``TESTED_TORCH``.
Reading ``.metadata`` stays in ``metadata.py`` (allow-listed unpickler).
"""

from __future__ import annotations

import pickle
import struct
import uuid
from typing import Any

from ckptool.errors import IncompatibleCheckpointError
from ckptool.format.metadata import CheckpointMetadata, StorageRef
from ckptool.format.pickle_globals import (DCP_METADATA, GET_LAYOUT, MEM_FORMAT_ENCODING, STORAGE_INFO,
                                           STRIDED, TORCH_SIZE)

#: torch versions whose DCP format this module was checked against (major.minor).
TESTED_TORCH = ("2.13",)
#: DCP's ``CURRENT_DCP_VERSION``; written when the source index has none.
DCP_VERSION = "1.0.0"

_NEWOBJ_CLASSES = {name: (DCP_METADATA, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta")}
_NEWOBJ_CLASSES["_StorageInfo"] = STORAGE_INFO


class _Pickle:
    """Pickle opcodes (protocol 2) written directly, for the one shape ``.metadata`` has.

    What ``pickle.dump`` of the real objects does, without their classes: globals are written
    by name (``GLOBAL``), a DCP class instance as ``NEWOBJ`` of its class then ``BUILD`` with
    its state (``copyreg.__newobj__``'s reduction), ``torch.Size(dims)`` and the two enum
    values as ``REDUCE``. Strings and globals are memoized, so each is written once. An index
    of 1,608 chunks takes 0.06 s (0.25 s driving Python's ``pickle._Pickler`` with stand-in
    objects, as before), and loads as the same objects.
    """

    def __init__(self) -> None:
        self.out = bytearray(pickle.PROTO + b"\x02")
        self._memo: dict[tuple[str | None, str], int] = {}  # (None, text) or (module, name)

    def _recall(self, key: tuple[str | None, str]) -> None:
        """Memoize the object just written under ``key``, or write a reference to it."""
        i = self._memo.get(key)
        if i is None:
            self._memo[key] = i = len(self._memo)
            self.out += pickle.BINPUT + bytes((i,)) if i < 256 else pickle.LONG_BINPUT + _U32(i)
        else:
            self.out += pickle.BINGET + bytes((i,)) if i < 256 else pickle.LONG_BINGET + _U32(i)

    def text(self, s: str) -> None:
        if (None, s) not in self._memo:
            data = s.encode("utf-8", "surrogatepass")
            self.out += pickle.BINUNICODE + _U32(len(data)) + data
        self._recall((None, s))

    def global_(self, module: str, name: str) -> None:
        if (module, name) not in self._memo:
            self.out += pickle.GLOBAL + f"{module}\n{name}\n".encode()
        self._recall((module, name))

    def integer(self, v: int) -> None:
        if 0 <= v < 256:
            self.out += pickle.BININT1 + bytes((v,))
        elif 0 <= v < 65536:
            self.out += pickle.BININT2 + struct.pack("<H", v)
        elif -0x80000000 <= v < 0x80000000:
            self.out += pickle.BININT + struct.pack("<i", v)
        else:
            data = pickle.encode_long(v)
            self.out += pickle.LONG1 + bytes((len(data),)) + data if len(data) < 256 else \
                pickle.LONG4 + struct.pack("<i", len(data)) + data

    def ints(self, dims: tuple[int, ...]) -> None:
        """A tuple of ints."""
        if len(dims) > 3:
            self.out += pickle.MARK
        for v in dims:
            self.integer(v)
        self.out += _TUPLES[len(dims)] if len(dims) <= 3 else pickle.TUPLE

    def size(self, dims: tuple[int, ...]) -> None:
        """``torch.Size(dims)``."""
        self.global_(*TORCH_SIZE)
        self.ints(dims)
        self.out += pickle.TUPLE1 + pickle.REDUCE

    def reduce(self, func: tuple[str, str], arg: Any) -> None:
        self.global_(*func)
        self.plain(arg, "")
        self.out += pickle.TUPLE1 + pickle.REDUCE

    def new(self, cls: str) -> None:
        """An instance of DCP class ``cls`` (``BUILD`` its state after it, if it has one)."""
        self.global_(*_NEWOBJ_CLASSES[cls])
        self.out += pickle.EMPTY_TUPLE + pickle.NEWOBJ

    def begin(self, container: bytes = pickle.EMPTY_DICT) -> None:
        self.out += container + pickle.MARK

    def end(self, op: bytes = pickle.SETITEMS) -> None:
        self.out += op

    def build(self) -> None:
        self.out += pickle.BUILD

    def plain(self, value: Any, fqn: str) -> None:
        """Plain data (planner data, strings): what pickle writes of it."""
        t = type(value)
        if value is None:
            self.out += pickle.NONE
        elif t is bool:
            self.out += pickle.NEWTRUE if value else pickle.NEWFALSE
        elif t is int:
            self.integer(value)
        elif t is float:
            self.out += pickle.BINFLOAT + struct.pack(">d", value)
        elif t is str:
            self.text(value)
        elif t is tuple:
            if len(value) > 3:
                self.out += pickle.MARK
            for v in value:
                self.plain(v, fqn)
            self.out += _TUPLES[len(value)] if len(value) <= 3 else pickle.TUPLE
        elif t is list:
            self.out += pickle.EMPTY_LIST + pickle.MARK
            for v in value:
                self.plain(v, fqn)
            self.out += pickle.APPENDS
        elif t is dict:
            self.out += pickle.EMPTY_DICT + pickle.MARK
            for k, v in value.items():
                self.plain(k, fqn)
                self.plain(v, fqn)
            self.out += pickle.SETITEMS
        else:
            raise IncompatibleCheckpointError(
                f"planner data of {fqn} holds a {t.__name__}, not plain data",
                hint="Reshard by loading with DCP on the new world size instead")


_TUPLES = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)


def _U32(n: int) -> bytes:
    return struct.pack("<I", n)


def _storage_info(p: _Pickle, ref: StorageRef | None, fqn: str) -> None:
    if ref is None:
        raise IncompatibleCheckpointError(f"{fqn} has no storage entry; cannot index it")
    p.new("_StorageInfo")
    p.begin()
    p.text("relative_path")
    p.text(ref.relative_path)
    p.text("offset")
    p.integer(ref.offset)
    p.text("length")
    p.integer(ref.length)
    if ref.transforms:
        p.text("transform_descriptors")
        p.plain(list(ref.transforms), fqn)
    p.end()
    p.build()


def encode_metadata(meta: CheckpointMetadata, *, checkpoint_id: str | None = None) -> bytes:
    """The ``.metadata`` bytes: a pickle that loads as the equivalent DCP ``Metadata``.

    Args:
        meta: tensors (every chunk with its ``StorageRef``), objects, planner data, save id.
        checkpoint_id: recorded in ``storage_meta.checkpoint_id``.

    Returns:
        The pickle, loadable by ``dcp.load`` and by ``metadata.read_metadata``.

    Raises:
        IncompatibleCheckpointError: a chunk or object without storage, or non-plain planner data.

    Example:
        >>> open("out/.metadata", "wb").write(encode_metadata(meta, checkpoint_id="out"))
    """
    p = _Pickle()
    p.new("Metadata")
    p.begin()
    p.text("state_dict_metadata")
    _state_dict_metadata(p, meta)
    p.text("planner_data")
    p.begin()
    for k, v in meta.planner_data.items():
        p.plain(k, k)
        p.plain(v, k)
    p.end()
    p.text("storage_data")
    _storage_data(p, meta)
    p.text("storage_meta")
    p.new("StorageMeta")
    p.plain({"checkpoint_id": checkpoint_id, "save_id": meta.save_id or str(uuid.uuid4()),
             "load_id": None, "modules": []}, "storage_meta")
    p.build()
    p.text("version")
    p.text(meta.version or DCP_VERSION)
    p.end()
    p.build()
    return bytes(p.out + pickle.STOP)


def _state_dict_metadata(p: _Pickle, meta: CheckpointMetadata) -> None:
    p.begin()
    for fqn, t in meta.tensors.items():
        p.text(fqn)
        p.new("TensorStorageMetadata")
        p.begin()
        p.text("properties")
        p.new("TensorProperties")  # state: (dtype, layout, requires_grad, memory_format, pinned)
        p.out += pickle.MARK
        p.global_("torch", t.dtype.name)
        p.reduce(GET_LAYOUT, STRIDED)
        p.plain(False, fqn)
        p.reduce(MEM_FORMAT_ENCODING, 0)
        p.plain(False, fqn)
        p.end(pickle.TUPLE)
        p.build()
        p.text("size")
        p.size(t.shape)
        p.text("chunks")
        p.begin(pickle.EMPTY_LIST)
        for c in t.chunks:
            p.new("ChunkStorageMetadata")
            p.begin()
            p.text("offsets")
            p.size(c.offsets)
            p.text("sizes")
            p.size(c.sizes)
            p.end()
            p.build()
        p.end(pickle.APPENDS)
        p.end()
        p.build()
    for fqn in meta.objects:
        p.text(fqn)
        p.new("BytesStorageMetadata")  # no state
    p.end()


def _storage_data(p: _Pickle, meta: CheckpointMetadata) -> None:
    p.begin()
    for fqn, t in meta.tensors.items():
        for i, c in enumerate(t.chunks):
            _index(p, fqn, i, c.offsets)
            _storage_info(p, c.storage, fqn)
    for fqn, o in meta.objects.items():
        _index(p, fqn, None, None)
        _storage_info(p, o.storage, fqn)
    p.end()


def _index(p: _Pickle, fqn: str, index: int | None, offsets: tuple[int, ...] | None) -> None:
    """A ``MetadataIndex`` (a non-tensor's has no ``offset`` in its state)."""
    p.new("MetadataIndex")
    p.begin()
    p.text("fqn")
    p.text(fqn)
    p.text("index")
    p.plain(index, fqn)
    if offsets is not None:
        p.text("offset")
        p.size(offsets)
    p.end()
    p.build()

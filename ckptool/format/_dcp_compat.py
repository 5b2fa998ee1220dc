"""Writing DCP's ``.metadata`` without torch: the pickle of its private, version-specific classes.

ckptool writes DCP's ``.metadata`` without importing torch (importing it costs seconds and
~265 MB, more than reshard's whole memory budget). The file is a pickle of
``torch.distributed.checkpoint.metadata.Metadata``; this module reproduces what ``pickle.dump``
of the real objects emits: the same class names (including the private
``torch.distributed.checkpoint.filesystem._StorageInfo`` and ``_MEM_FORMAT_ENCODING``), the
same pickled state of each class (``TensorProperties`` pickles a 5-tuple, ``_StorageInfo``
drops ``None`` fields, ``MetadataIndex`` of a non-tensor has no ``offset``), ``torch.Size`` as
``Size(tuple)``, dtypes as ``torch.<name>`` globals.

Globals are emitted by name and never imported; the names are ``pickle_globals.py``'s (the
one place that spells torch's paths, also for reading). ``tests/unit/test_reshard_format.py`` loads
the result with torch and compares it with the real dataclasses, pinned to ``TESTED_TORCH``.
Reading ``.metadata`` stays in ``metadata.py`` (allow-listed unpickler).
"""

from __future__ import annotations

import copyreg
import io
import pickle
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

_MD = DCP_METADATA


class _Global:
    """A global (class, function, dtype) pickled by its name, never imported."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any) -> Any:  # pickle requires REDUCE targets to be callable
        raise TypeError(f"{self.module}.{self.name} is a name only")


class _Reduce:
    """An object whose pickle is ``func(*args)`` (torch.Size, layouts, enums)."""

    def __init__(self, func: _Global, args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return self.func, self.args


class _Instance:
    """An instance of a DCP class: NEWOBJ of the class, then BUILD with its pickled state."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return copyreg.__newobj__, (type(self),), self.state


def _stand_in(module: str, name: str) -> type[_Instance]:
    cls = type(name, (_Instance,), {})
    _NAMES[cls] = (module, name)
    return cls


_NAMES: dict[type, tuple[str, str]] = {}
_Metadata = _stand_in(_MD, "Metadata")
_TensorStorageMetadata = _stand_in(_MD, "TensorStorageMetadata")
_BytesStorageMetadata = _stand_in(_MD, "BytesStorageMetadata")
_ChunkStorageMetadata = _stand_in(_MD, "ChunkStorageMetadata")
_TensorProperties = _stand_in(_MD, "TensorProperties")
_MetadataIndex = _stand_in(_MD, "MetadataIndex")
_StorageMeta = _stand_in(_MD, "StorageMeta")
_StorageInfo = _stand_in(*STORAGE_INFO)
_SIZE = _Global(*TORCH_SIZE)


class _NamePickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    dispatch = dict(pickle._Pickler.dispatch)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, _Global):
            module, qualname = obj.module, obj.name
        elif obj in _NAMES:
            module, qualname = _NAMES[obj]
        else:
            raise pickle.PicklingError(f"{obj!r} is not plain checkpoint data")
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = save_global


def _size(dims: tuple[int, ...]) -> _Reduce:
    return _Reduce(_SIZE, (tuple(dims),))


def _storage_info(ref: StorageRef | None, fqn: str) -> _Instance:
    if ref is None:
        raise IncompatibleCheckpointError(f"{fqn} has no storage entry; cannot index it")
    state: dict[str, Any] = {"relative_path": ref.relative_path, "offset": ref.offset,
                             "length": ref.length}
    if ref.transforms:
        state["transform_descriptors"] = list(ref.transforms)
    return _StorageInfo(state)


def _plain(value: Any, fqn: str) -> Any:
    """planner_data values must be plain data (DCP's default planner stores key paths)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (tuple, list):
        return type(value)(_plain(v, fqn) for v in value)
    if type(value) is dict:
        return {_plain(k, fqn): _plain(v, fqn) for k, v in value.items()}
    raise IncompatibleCheckpointError(
        f"planner data of {fqn} holds a {type(value).__name__}, not plain data",
        hint="Reshard by loading with DCP on the new world size instead")


def encode_metadata(meta: CheckpointMetadata, *, checkpoint_id: str | None = None) -> bytes:
    """The ``.metadata`` bytes that ``pickle.dump`` of the equivalent DCP ``Metadata`` gives.

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
    layout = _Reduce(_Global(*GET_LAYOUT), (STRIDED,))
    contiguous = _Reduce(_Global(*MEM_FORMAT_ENCODING), (0,))
    dtypes: dict[str, _Global] = {}
    sdm: dict[str, _Instance] = {}
    storage: dict[_Instance, _Instance] = {}
    for fqn, t in meta.tensors.items():
        dtype = dtypes.setdefault(t.dtype.name, _Global("torch", t.dtype.name))
        props = _TensorProperties((dtype, layout, False, contiguous, False))
        chunks = [_ChunkStorageMetadata({"offsets": _size(c.offsets), "sizes": _size(c.sizes)})
                  for c in t.chunks]
        sdm[fqn] = _TensorStorageMetadata({"properties": props, "size": _size(t.shape),
                                           "chunks": chunks})
        for i, c in enumerate(t.chunks):
            key = _MetadataIndex({"fqn": fqn, "index": i, "offset": _size(c.offsets)})
            storage[key] = _storage_info(c.storage, fqn)
    for fqn, o in meta.objects.items():
        sdm[fqn] = _BytesStorageMetadata(None)
        storage[_MetadataIndex({"fqn": fqn, "index": None})] = _storage_info(o.storage, fqn)
    planner = {k: _plain(v, k) for k, v in meta.planner_data.items()}
    storage_meta = _StorageMeta({"checkpoint_id": checkpoint_id,
                                 "save_id": meta.save_id or str(uuid.uuid4()),
                                 "load_id": None, "modules": []})
    root = _Metadata({"state_dict_metadata": sdm, "planner_data": planner,
                      "storage_data": storage, "storage_meta": storage_meta,
                      "version": meta.version or DCP_VERSION})
    buf = io.BytesIO()
    _NamePickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(root)
    return buf.getvalue()

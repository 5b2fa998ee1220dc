"""Read a DCP ``.metadata`` file safely into ckptool's own frozen dataclasses.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``. torch's own
``FileSystemReader.read_metadata`` is a plain ``pickle.load``, so a hostile checkpoint runs code
through it. Here the handful of classes that legitimately occur are mapped to inert stand-ins
(``safe_pickle`` with ``pickle_globals.METADATA_GLOBALS``, the one list of the torch names a
pickle may use), then converted to the plain, validated model below. torch is never imported.

Owns: the index model (``CheckpointMetadata``, ``TensorEntry``, ``Chunk``, ``StorageRef``).
Which keys are the model, the optimizer or the rest is ``state_layout.py``'s business; bytes
inside ``.distcp`` records are ``zip_records.py``'s and ``torch_records.py``'s; checking
geometry and files is ``ops/validate.py``'s (``ops/chunk_geometry.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeInputError
from ckptool.format.dtypes import DTYPES, DType
from ckptool.format.pickle_globals import (METADATA_GLOBALS, _BytesStorageMetadata, _ChunkStorageMetadata,
                                           _DTypeToken, _Metadata, _MetadataIndex, _StorageInfo,
                                           _StorageMeta, _TensorProperties, _TensorStorageMetadata)
from ckptool.format.safe_pickle import UnsafePickleError, safe_loads
from ckptool.storage import Storage

METADATA = ".metadata"
#: Refuse to even read an index larger than this (a 10,000-tensor, 64-rank index is ~10 MB).
MAX_METADATA_BYTES = 1 << 30
#: A single tensor claiming more than this is absurd input; refused before any allocation.
MAX_TENSOR_BYTES = 1 << 48  # 256 TiB
MAX_NDIM = 64


# ---------------------------------------------------------------------------------------------
# The public model


@dataclass(frozen=True)
class StorageRef:
    """Where one item's serialized record lives: ``relative_path`` bytes [offset, offset+length)."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()
    #: The range is the chunk's row-major bytes themselves (a tensor of a safetensors file,
    #: ``safetensors_source.py``): no ``torch.save`` record around them, no CRC-32.
    raw: bool = False


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: the box ``offsets .. offsets+sizes`` of the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageRef | None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def row_blocks(self) -> list[Chunk] | None:
        """The non-empty chunks in row order when every chunk is a block of whole rows (FSDP2's
        ``Shard(0)``: contiguous in the full tensor, so copyable byte for byte), else None."""
        full = self.shape[1:]
        live = [c for c in self.chunks if c.numel]
        if any(c.offsets[1:] != (0,) * len(full) or c.sizes[1:] != full for c in live):
            return None
        return sorted(live, key=lambda c: c.offsets)


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor value (int, float, list, ...) saved as a ``torch.save`` record."""

    fqn: str
    storage: StorageRef | None


@dataclass(frozen=True)
class CheckpointMetadata:
    """The parsed index of one DCP folder.

    Attributes:
        tensors: fqn -> TensorEntry, in the saved order.
        objects: fqn -> BytesEntry for non-tensor values.
        planner_data: fqn -> the original nested-key path (tuple of str/int), as saved.
        version: DCP metadata version string, if any.
        metadata_bytes: size of the ``.metadata`` file.
    """

    tensors: dict[str, TensorEntry]
    objects: dict[str, BytesEntry]
    planner_data: dict[str, Any] = field(default_factory=dict)
    version: str | None = None
    save_id: str | None = None
    metadata_bytes: int = 0
    #: ``"dcp"`` (``.metadata`` + ``.distcp`` records) or ``"safetensors"`` (DCP's
    #: ``HuggingFaceStorageWriter`` output, read by ``safetensors_source.py``).
    storage_format: str = "dcp"

    def files(self) -> list[str]:
        """Every storage file the index references, sorted."""
        out = {c.storage.relative_path for t in self.tensors.values() for c in t.chunks if c.storage}
        out |= {o.storage.relative_path for o in self.objects.values() if o.storage}
        return sorted(out)

    @property
    def world_size(self) -> int | None:
        """Ranks that wrote the files, from DCP's ``__<rank>_<n>.distcp`` names."""
        ranks = set()
        for name in self.files():
            m = _RANK_RE.fullmatch(name)
            if m is None:
                m = _SHARD_RE.fullmatch(name)  # safetensors save_distributed: rank + 1
                if m is None:
                    return None
                ranks.add(int(m.group(1)) - 1)
                continue
            ranks.add(int(m.group(1)))
        return max(ranks) + 1 if ranks else None


_RANK_RE = re.compile(r"__(\d+)_\d+\.distcp")
_SHARD_RE = re.compile(r"(?:sharded/)?shard-(\d+)-model-\d+-of-\d+\.safetensors")

# ---------------------------------------------------------------------------------------------
# Reading


def read_metadata(storage: Storage) -> CheckpointMetadata:
    """Read and check the ``.metadata`` of one DCP folder, without importing torch.

    A folder without ``.metadata`` that DCP's ``HuggingFaceStorageWriter`` wrote (safetensors
    files, an index) is read by ``safetensors_source.read_index`` into the same model.

    Args:
        storage: the checkpoint folder.

    Returns:
        The parsed index.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` (the save never committed), or a
            safetensors save that did not finish.
        CorruptCheckpointError: unreadable, truncated, hostile (a global outside the
            allow-list) or inconsistent index.

    Example:
        >>> meta = read_metadata(Storage.open("runs/demo/step_40"))
        >>> meta.tensors["model.head.weight"].shape
    """
    where = storage.url_of(METADATA)
    if not storage.exists(METADATA):
        from ckptool.format import safetensors_source as sts  # DCP's HuggingFaceStorageWriter

        found = sts.find_layout(storage)
        if found is not None:
            return sts.read_index(storage, found)
        raise IncompleteCheckpointError(
            f"{storage.url} is incomplete: no .metadata, the save was interrupted", path=storage.url,
            hint="Resume from an earlier checkpoint ('ckptool ls' shows the latest good one)",
        )
    if storage.isdir(METADATA):
        raise CorruptCheckpointError(f"{where} is a folder, not a file", path=where)
    size = storage.size(METADATA)
    if size == 0:
        raise CorruptCheckpointError(f"{where} is empty", path=where,
                                     hint="The save did not finish; use an earlier checkpoint")
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where} is {size} bytes, too large for a DCP index", path=where)
    return parse_metadata(storage.read_bytes(METADATA), where=where)


def parse_metadata(data: bytes, *, where: str = METADATA) -> CheckpointMetadata:
    """Parse ``.metadata`` bytes (see ``read_metadata``)."""
    try:
        raw = safe_loads(data, METADATA_GLOBALS)
    except UnsafePickleError as e:
        raise UnsafeInputError(
            f"{where} refused: it references {e.module}.{e.name}, which no DCP index contains "
            "(possibly a malicious file; nothing from it was run)", path=where,
            hint="Do not load this checkpoint with torch; get it again from a trusted source",
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure to parse is a corrupt index
        raise CorruptCheckpointError(
            f"{where} is not a readable DCP index ({type(e).__name__}: {e})", path=where,
            hint="It is truncated or damaged; use an earlier checkpoint",
        ) from None
    try:
        return _convert(raw, len(data))
    except _Bad as e:
        raise CorruptCheckpointError(f"{where}: {e}", path=where,
                                     hint="The index is damaged; use an earlier checkpoint") from None


class _Bad(Exception):
    pass


def _int(v: Any, what: str, *, minimum: int = 0) -> int:
    if type(v) is not int or v < minimum:
        raise _Bad(f"{what} is {v!r}, expected an integer >= {minimum}")
    return v


def _dims(v: Any, what: str) -> tuple[int, ...]:
    if type(v) is tuple and len(v) <= MAX_NDIM and all(type(x) is int for x in v) \
            and (not v or min(v) >= 0):
        return v
    if not isinstance(v, tuple) or len(v) > MAX_NDIM:
        raise _Bad(f"{what} is {v!r}, expected a tuple of sizes")
    return tuple(_int(x, what) for x in v)


def _convert(raw: Any, nbytes: int) -> CheckpointMetadata:
    if not isinstance(raw, _Metadata):
        raise _Bad(f"top-level object is {type(raw).__name__}, not DCP Metadata")
    sdm = raw.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise _Bad("state_dict_metadata is missing")
    refs = _storage_refs(raw.get("storage_data"))
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, BytesEntry] = {}
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _Bad(f"key {fqn!r} is not a string")
        if isinstance(md, _BytesStorageMetadata):
            objects[fqn] = BytesEntry(fqn, refs.get((fqn, None)))
        elif isinstance(md, _TensorStorageMetadata):
            tensors[fqn] = _tensor(fqn, md, refs)
        else:
            raise _Bad(f"{fqn}: unknown storage metadata {type(md).__name__}")
    planner = raw.get("planner_data")
    version = raw.get("version")
    sm = raw.get("storage_meta")
    save_id = sm.get("save_id") if isinstance(sm, _StorageMeta) else None
    return CheckpointMetadata(
        tensors=tensors, objects=objects,
        planner_data=planner if isinstance(planner, dict) else {},
        version=version if isinstance(version, str) else None,
        save_id=save_id if isinstance(save_id, str) else None, metadata_bytes=nbytes,
    )


def _tensor(fqn: str, md: _TensorStorageMetadata, refs: dict) -> TensorEntry:
    props = md.get("properties")
    token = props.get("dtype") if isinstance(props, _TensorProperties) else None
    if not isinstance(token, _DTypeToken) or token.name not in DTYPES:
        name = token.name if isinstance(token, _DTypeToken) else repr(token)
        raise _Bad(f"{fqn}: dtype {name} is not a supported tensor dtype")
    dtype = DTYPES[token.name]
    shape = _dims(md.get("size"), f"{fqn} shape")
    if math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES:
        raise _Bad(f"{fqn}: shape {list(shape)} claims {math.prod(shape) * dtype.itemsize} bytes, "
                   "an absurd size")
    raw_chunks = md.get("chunks")
    if not isinstance(raw_chunks, list):
        raise _Bad(f"{fqn}: chunks is not a list")
    chunks = []
    for c in raw_chunks:
        if not isinstance(c, _ChunkStorageMetadata):
            raise _Bad(f"{fqn}: a chunk is {type(c).__name__}")
        offsets = _dims(c.get("offsets"), f"{fqn} chunk offsets")
        sizes = _dims(c.get("sizes"), f"{fqn} chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _Bad(f"{fqn}: chunk at {list(offsets)} has {len(sizes)} dims, tensor has {len(shape)}")
        chunks.append(Chunk(offsets, sizes, refs.get((fqn, offsets))))
    return TensorEntry(fqn, dtype, shape, tuple(chunks))


def _storage_refs(storage_data: Any) -> dict[tuple[str, tuple[int, ...] | None], StorageRef]:
    if not isinstance(storage_data, dict):
        raise _Bad("storage_data is missing (not written by DCP's FileSystemWriter?)")
    refs = {}
    for key, info in storage_data.items():
        if not isinstance(key, _MetadataIndex) or not isinstance(key.get("fqn"), str):
            raise _Bad(f"storage_data key {key!r} is not a MetadataIndex")
        if not isinstance(info, _StorageInfo):
            raise _Bad(f"storage_data[{key.get('fqn')}] is not a _StorageInfo")
        fqn = key.get("fqn")
        offset = key.get("offset")
        idx = None if offset is None else _dims(offset, f"{fqn} storage offset")
        path = info.get("relative_path")
        if not isinstance(path, str) or not path:
            raise _Bad(f"{fqn}: storage path {path!r} is not a file name")
        transforms = info.get("transform_descriptors") or ()
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise _Bad(f"{fqn}: bad transform descriptors {transforms!r}")
        ref = StorageRef(path, _int(info.get("offset"), f"{fqn} byte offset"),
                         _int(info.get("length"), f"{fqn} byte length"), tuple(transforms))
        if (fqn, idx) in refs:
            raise _Bad(f"{fqn}: two storage entries for the chunk at {list(idx or ())}")
        refs[(fqn, idx)] = ref
    return refs

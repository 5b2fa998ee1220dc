"""DCP's safetensors-backed checkpoints as a ckptool index, read as untrusted data (torch-free).

``torch.distributed.checkpoint.HuggingFaceStorageWriter`` (and torchtitan's final save with
``last_save_in_hf``, which uses it) writes no ``.metadata``. What it writes, by mode:

* rank 0 alone (``save_distributed=False``): ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` (written last, by ``finish``);
* ``save_distributed=True``: every rank writes ``shard-0000R-model-0000i-of-0000N.safetensors``
  (R = rank + 1), each header's ``__metadata__["DCP_SHARDING_INFO"]`` holding the chunk's
  ``saved_offsets`` in the global tensor; nothing says how many ranks there were or the
  global shape (it is the largest ``offset + size``), and no index is written;
* with ``enable_consolidation=True`` (or torchtitan's ``consolidate_safetensors_files_on_every_rank``)
  those shards go to ``sharded/`` and whole tensors to ``model-0000i-of-0000N.safetensors``
  (no ``__metadata__``) beside the ``model.safetensors.index.json``, written last.

``find_layout`` says which files make the checkpoint and whether it is committed (used by
``layout.classify``); ``read_index`` turns it into ``CheckpointMetadata``: one chunk per
tensor of a consolidated or rank-0 file, one chunk per shard of a ``save_distributed`` save.
Every ``StorageRef`` is ``raw``: the exact byte range of the tensor's row-major data in its
file, with no record around it and no checksum. Names are the saved names; ``planner_data``
records each as a top-level key (``{name: (name,)}``).

Every header is bounds-checked before its data is used (``safetensors_header.read_header``,
re-exported here); index entries are path-checked (relative, no ``..``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CkptError, IncompleteCheckpointError
from ckptool.format.metadata import MAX_NDIM, CheckpointMetadata, Chunk, StorageRef, TensorEntry
from ckptool.format.safetensors_header import (MAX_HEADER, Header, HeaderTensor, SourceError,
                                               read_header)
from ckptool.storage import Entry, Storage

__all__ = ["INDEX_NAME", "MAX_HEADER", "NO_CHECKSUM", "Found", "Header", "HeaderTensor",
           "SourceError", "SourceIncomplete", "find_layout", "read_copy", "read_header",
           "read_index"]

INDEX_NAME = "model.safetensors.index.json"
SHARDED_DIR = "sharded"
SUFFIX = ".safetensors"
MAX_INDEX_BYTES = 100_000_000
SHARDING_INFO = "DCP_SHARDING_INFO"
_SHARD_RE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")
NO_CHECKSUM = ("safetensors files carry no checksum: --deep checked the headers, bounds, "
               "coverage, the index and that every byte is readable, not the values themselves")


class SourceIncomplete(IncompleteCheckpointError):
    code = "incomplete"


# ---------------------------------------------------------------------------------------------
# Which files make the checkpoint


@dataclass(frozen=True)
class Found:
    """What a folder holds.

    Attributes:
        mode: ``"index"`` (files named by ``model.safetensors.index.json``), ``"single"`` (one
            ``.safetensors`` file, no index) or ``"sharded"`` (``save_distributed`` shards,
            merged, beside the save or in ``sharded/``).
        files: the files to read, relative to the folder.
        committed: the checkpoint is whole as far as its files can tell.
        reason: why it is not committed (a sentence), else None.
        code: the ``validate`` finding code for ``reason`` (``"incomplete"`` when the save
            did not finish, else the problem found).
        copy: the consolidated files named by the index when ``sharded/`` holds the shards
            they were made from. The shards are read (they are what DCP saved; torch 2.13's
            consolidation writes a 0-dim tensor as zeros); the copy must agree with them.
    """

    mode: str
    files: tuple[str, ...]
    committed: bool
    reason: str | None = None
    code: str | None = None
    copy: tuple[str, ...] = ()


def _failed(mode: str, files: Any, e: CkptError) -> Found:
    return Found(mode, tuple(files), False, str(e), getattr(e, "code", "bad-header"))


def find_layout(storage: Storage, entries: list[Entry] | None = None) -> Found | None:
    """Describe ``storage`` as a DCP safetensors checkpoint, or None if it holds none.

    Committed: the index parses and every file it names exists (the index is written last);
    without an index, one file whose header is well-formed, or ``save_distributed`` shards
    whose headers are all well-formed and fit their files, from ranks 1..R without a gap.
    """
    if entries is None:
        entries = storage.listdir()
    files = {e.name: e for e in entries if not e.is_dir}
    dirs = {e.name for e in entries if e.is_dir}
    if INDEX_NAME in files:
        try:
            names = sorted(set(_weight_map(storage).values()))
        except CkptError as e:
            return _failed("index", (), e)
        missing = [n for n in names if n not in files and not storage.isfile(n)]
        shards = _sharded_dir(storage, dirs)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return Found("index", tuple(names), False, f"{storage.url_of(missing[0])} is missing "
                         f"(named by {INDEX_NAME}){more}; the checkpoint cannot be loaded without "
                         "it", "missing-file")
        if shards:  # read what DCP saved; the consolidated copy is checked against it
            return Found("sharded", tuple(shards), True, copy=tuple(names))
        return Found("index", tuple(names), True)
    top = sorted(n for n in files if n.endswith(SUFFIX))
    shards = [n for n in top if _SHARD_RE.fullmatch(n)] or _sharded_dir(storage, dirs)
    if shards:
        return _shards_whole(storage, shards)
    if len(top) == 1:
        try:
            read_header(storage, top[0], size=files[top[0]].size)
        except CkptError as e:
            return _failed("single", top, e)
        return Found("single", tuple(top), True)
    if top:
        return Found("index", tuple(top), False, f"{storage.url} is incomplete: {len(top)} "
                     f".safetensors files and no {INDEX_NAME} (DCP writes the index last: the "
                     "save was interrupted)", "incomplete")
    return None


def _sharded_dir(storage: Storage, dirs: set[str]) -> list[str]:
    if SHARDED_DIR not in dirs:
        return []
    return sorted(f"{SHARDED_DIR}/{e.name}" for e in storage.listdir(SHARDED_DIR)
                  if not e.is_dir and _SHARD_RE.fullmatch(e.name))


def _shards_whole(storage: Storage, shards: list[str]) -> Found:
    held: dict[int, set[str]] = {}  # shard number (rank + 1) -> its "model-i-of-N" parts
    for rel in shards:
        m = _SHARD_RE.fullmatch(rel.rsplit("/", 1)[-1])
        assert m is not None
        held.setdefault(int(m.group(1)), set()).add(f"model-{m.group(2)}-of-{m.group(3)}")
    ranks = sorted(held)
    gap = next((r for r in range(1, ranks[-1] + 1) if r not in held), None)
    if gap is not None:
        return Found("sharded", tuple(shards), False, f"{storage.url} is incomplete: no shard of "
                     f"rank {gap - 1} (shard-{gap:05d}-*) while rank {ranks[-1] - 1} wrote one",
                     "incomplete")
    # FSDP2 ranks each write a chunk (empty ones too) of every sharded tensor, so a rank that
    # wrote some output files but not one another rank wrote lost part of the save. (Only an
    # output holding nothing but replicated tensors could legitimately skip a rank.)
    every = set().union(*held.values())
    for r in ranks:
        if held[r] != every:
            part = sorted(every - held[r])[0]
            rel = next(x for x in shards if x.endswith(f"-{part}{SUFFIX}")).rsplit("/", 1)
            name = f"{rel[0]}/" if len(rel) > 1 else ""
            return Found("sharded", tuple(shards), False, f"{storage.url_of(name)}shard-{r:05d}-"
                         f"{part}{SUFFIX} is missing: rank {r - 1} wrote {len(held[r])} of the "
                         f"{len(every)} output files the other ranks wrote, so the chunks it held "
                         "are gone", "missing-file")
    for rel in shards:
        try:
            read_header(storage, rel)
        except CkptError as e:
            return _failed("sharded", shards, e)
    return Found("sharded", tuple(shards), True)


def _weight_map(storage: Storage) -> dict[str, str]:
    where = storage.url_of(INDEX_NAME)
    size = storage.size(INDEX_NAME)
    if size > MAX_INDEX_BYTES:
        raise SourceError("bad-index", f"{where} is {size} bytes, too large for an index", path=where)
    try:
        obj = json.loads(storage.read_bytes(INDEX_NAME))
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError("bad-index", f"{where} is not valid JSON ({e}); DCP writes it last, so "
                          "the save was interrupted or the file is damaged", path=where) from None
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not wm or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise SourceError("bad-index", f"{where} has no weight_map of tensor name -> file name",
                          path=where)
    for name in set(wm.values()):
        problem = _unsafe_name(name)
        if problem:
            raise SourceError("path-outside", f"{where} names {name!r}, {problem}; refusing to "
                              "read it (possibly malicious)", path=where)
        if not storage.realpath_inside(name):
            raise SourceError("path-outside", f"{where} names {name!r}, a symlink leading out of "
                              "the checkpoint folder; refusing to read it", path=where)
    return wm


def _unsafe_name(name: str) -> str | None:
    parts = name.replace("\\", "/").split("/")
    if not name.endswith(SUFFIX):
        return "not a .safetensors file"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if ".." in parts or "\x00" in name or any(p in ("", ".") for p in parts):
        return "a path leading out of the checkpoint folder"
    return None


# ---------------------------------------------------------------------------------------------
# The index


def read_index(storage: Storage, found: Found | None = None) -> CheckpointMetadata:
    """The ckptool index of a DCP safetensors checkpoint folder.

    Raises:
        IncompleteCheckpointError: not committed (``SourceIncomplete``; the message says why).
        SourceError: a damaged header, a missing file, or index and files that disagree
            (``code`` names the problem as ``validate`` reports it).
    """
    found = found if found is not None else find_layout(storage)
    if found is None:
        raise SourceIncomplete(f"{storage.url} holds no safetensors checkpoint", path=storage.url)
    if not found.committed:
        what = found.reason or f"{storage.url} is not complete"
        if found.code == "incomplete":
            raise SourceIncomplete(what, path=storage.url, hint="Use an earlier checkpoint "
                                   "('ckptool ls' shows the latest good one)")
        raise SourceError(found.code or "bad-header", what, path=storage.url)
    headers, tensors = _collect(storage, found.files, sharded=found.mode == "sharded")
    if found.mode == "index":
        _check_weight_map(storage, tensors)
    entries = {name: _tensor_entry(storage, name, parts) for name, parts in tensors.items()}
    if found.copy:
        _check_copy(storage, entries, read_copy(storage, found))
    nbytes = sum(h.header_bytes for h in headers)
    return CheckpointMetadata(tensors=entries, objects={},
                              planner_data={name: (name,) for name in entries},
                              metadata_bytes=nbytes, storage_format="safetensors")


def read_copy(storage: Storage, found: Found) -> dict[str, tuple[str, HeaderTensor]]:
    """The consolidated copy beside ``sharded/`` (``found.copy``): name -> (file, tensor)."""
    _, tensors = _collect(storage, found.copy, sharded=False)
    _check_weight_map(storage, tensors)
    return {name: (parts[0][2], parts[0][0]) for name, parts in tensors.items()}


def _collect(storage: Storage, rels: tuple[str, ...], *, sharded: bool
             ) -> tuple[list[Header], dict[str, list[tuple[HeaderTensor, tuple[int, ...], str]]]]:
    headers = [read_header(storage, rel) for rel in rels]
    tensors: dict[str, list[tuple[HeaderTensor, tuple[int, ...], str]]] = {}
    for h in headers:
        info = _sharding_info(storage, h, required=sharded)
        for t in h.tensors.values():
            offsets = info.get(t.name) if info is not None else None
            if offsets is None:
                if sharded:
                    raise SourceError("bad-header", f"{storage.url_of(h.rel)}: tensor {t.name} "
                                      f"has no {SHARDING_INFO} entry", path=storage.url_of(h.rel))
                offsets = (0,) * len(t.shape)
            if len(offsets) != len(t.shape):
                raise SourceError("bad-header", f"{storage.url_of(h.rel)}: tensor {t.name} has "
                                  f"{len(t.shape)} dims but saved_offsets {list(offsets)}",
                                  path=storage.url_of(h.rel))
            tensors.setdefault(t.name, []).append((t, offsets, h.rel))
    return headers, tensors


def _check_copy(storage: Storage, entries: dict[str, TensorEntry],
                copy: dict[str, tuple[str, HeaderTensor]]) -> None:
    where = storage.url_of(INDEX_NAME)
    for name in sorted(set(entries) ^ set(copy)):
        side = "the consolidated files" if name in copy else f"the shards in {SHARDED_DIR}/"
        raise SourceError("copy-mismatch", f"{where}: {name} is only in {side}; the consolidated "
                          "copy and the saved shards disagree", path=where)
    for name, t in entries.items():
        rel, c = copy[name]
        if c.dtype != t.dtype or c.shape != t.shape:
            raise SourceError("copy-mismatch", f"{storage.url_of(rel)} holds {name} as {c.dtype} "
                              f"{list(c.shape)}, the saved shards as {t.dtype} {list(t.shape)}",
                              path=storage.url_of(rel))


def _sharding_info(storage: Storage, h: Header, *, required: bool) -> dict[str, tuple[int, ...]] | None:
    raw = h.metadata.get(SHARDING_INFO)
    where = storage.url_of(h.rel)
    if raw is None:
        if required:
            raise SourceError("bad-header", f"{where}: no {SHARDING_INFO} in its header, so the "
                              "shard's place in each tensor is unknown (not written by DCP?)",
                              path=where)
        return None
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise SourceError("bad-header", f"{where}: {SHARDING_INFO} is not JSON ({e})",
                          path=where) from None
    out = {}
    if not isinstance(obj, dict):
        raise SourceError("bad-header", f"{where}: {SHARDING_INFO} is not an object", path=where)
    for name, v in obj.items():
        offs = v.get("saved_offsets") if isinstance(v, dict) else None
        if (not isinstance(offs, list) or len(offs) > MAX_NDIM
                or not all(type(o) is int and o >= 0 for o in offs)):
            raise SourceError("bad-header", f"{where}: {SHARDING_INFO} of {name} has bad "
                              f"saved_offsets {offs!r}", path=where)
        out[name] = tuple(offs)
    return out


def _check_weight_map(storage: Storage, tensors: dict) -> None:
    wm = _weight_map(storage)
    where = storage.url_of(INDEX_NAME)
    for name, rel in wm.items():
        parts = tensors.get(name)
        if not parts or all(p[2] != rel for p in parts):
            raise SourceError("index-mismatch", f"{where} puts {name} in {rel}, but that file "
                              "does not hold it", path=where, hint="The index and the files disagree")
    for name, parts in tensors.items():
        if name not in wm:
            raise SourceError("index-mismatch", f"{storage.url_of(parts[0][2])} holds {name}, "
                              f"which {INDEX_NAME} does not name", path=where)
        if len(parts) > 1:
            raise SourceError("index-mismatch", f"tensor {name} is in both {parts[0][2]} and "
                              f"{parts[1][2]}", path=where)


def _tensor_entry(storage: Storage, name: str,
                  parts: list[tuple[HeaderTensor, tuple[int, ...], str]]) -> TensorEntry:
    dtype = parts[0][0].dtype
    ndim = len(parts[0][0].shape)
    for t, _, rel in parts:
        if t.dtype != dtype or len(t.shape) != ndim:
            where = storage.url_of(rel)
            raise SourceError("bad-header", f"{where}: shard of {name} is {t.dtype} with "
                              f"{len(t.shape)} dims, another shard is {dtype} with {ndim}",
                              path=where)
    # The global shape is recorded nowhere: it is the box that holds every chunk.
    shape = tuple(max(o[d] + t.shape[d] for t, o, _ in parts) for d in range(ndim))
    chunks = tuple(Chunk(offsets, t.shape, StorageRef(rel, t.start, t.nbytes, raw=True))
                   for t, offsets, rel in parts)
    return TensorEntry(name, dtype, shape, chunks)

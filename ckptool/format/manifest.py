"""The ``ckptool.json`` manifest beside a checkpoint's ``.metadata``.

It is written only after the checkpoint is committed (``.metadata`` exists), so its presence
never makes a torn save look complete. It records what a later reader cannot recover from
DCP's index alone: the step, the world size, the training config and loss, and every file's
size and checksum (xxh3-64: about 8.7x faster than sha256 here, see docs/RELIABILITY.md).

Format (JSON object, keys sorted, UTF-8):
    {"format": "ckptool-manifest", "version": 1, "step": int|null, "world_size": int|null,
     "created": float (unix time), "ckptool_version": str, "loss": float|null,
     "config": {...}, "source": {...}|null,
     "files": {"<relative path>": {"size": int, "xxh3_64": "<16 hex>"}, ...}}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ckptool._version import __version__
from ckptool.errors import CorruptCheckpointError
from ckptool.storage import BLOCK, Storage

MANIFEST = "ckptool.json"
FORMAT = "ckptool-manifest"
VERSION = 1
CHECKSUM = "xxh3_64"


@dataclass(frozen=True)
class Manifest:
    step: int | None
    world_size: int | None
    files: dict[str, dict[str, Any]]
    loss: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] | None = None
    created: float | None = None
    ckptool_version: str | None = None


def file_checksum(storage: Storage, rel: str) -> tuple[int, str]:
    """(size, xxh3-64 hex) of one file, streamed in fixed blocks."""
    import xxhash

    h = xxhash.xxh3_64()
    size = 0
    with storage.reader(rel) as r:
        while True:
            b = r.pread(size, BLOCK)
            if not b:
                break
            h.update(b)
            size += len(b)
    return size, h.hexdigest()


def checkpoint_files(storage: Storage) -> list[str]:
    """The files a manifest covers: ``.metadata`` and every ``*.distcp`` (sorted)."""
    return sorted(
        e.name for e in storage.listdir()
        if not e.is_dir and (e.name == ".metadata" or e.name.endswith(".distcp"))
    )


def build_manifest(storage: Storage, *, step: int | None, world_size: int | None,
                   loss: float | None = None, config: dict[str, Any] | None = None,
                   source: dict[str, Any] | None = None) -> Manifest:
    files = {}
    for rel in checkpoint_files(storage):
        size, digest = file_checksum(storage, rel)
        files[rel] = {"size": size, CHECKSUM: digest}
    return Manifest(step=step, world_size=world_size, files=files, loss=loss,
                    config=dict(config or {}), source=source, created=time.time(),
                    ckptool_version=__version__)


def encode(m: Manifest) -> bytes:
    obj = {
        "format": FORMAT, "version": VERSION, "step": m.step, "world_size": m.world_size,
        "created": m.created, "ckptool_version": m.ckptool_version, "loss": m.loss,
        "config": m.config, "source": m.source, "files": m.files,
    }
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write ``ckptool.json`` atomically (temp name, then rename). Call after commit only."""
    tmp = f".{MANIFEST}.tmp"
    storage.write_bytes(tmp, encode(manifest))
    storage.rename(tmp, MANIFEST)


def read_manifest(storage: Storage) -> Manifest | None:
    """The manifest of a checkpoint folder, None when absent.

    Raises:
        CorruptCheckpointError: present but not a well-formed manifest.
    """
    if not storage.exists(MANIFEST):
        return None
    where = storage.url_of(MANIFEST)
    try:
        obj = json.loads(storage.read_bytes(MANIFEST))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{where} is not valid JSON ({e})", path=where,
            hint="Delete the manifest to validate by structure only, or re-save the checkpoint",
        ) from None
    ok = (isinstance(obj, dict) and obj.get("format") == FORMAT
          and isinstance(obj.get("files"), dict)
          and all(isinstance(v, dict) and isinstance(v.get("size"), int) and v["size"] >= 0
                  for v in obj["files"].values()))
    if not ok:
        raise CorruptCheckpointError(
            f"{where} is not a ckptool manifest", path=where,
            hint="Delete it to validate by structure only",
        )
    return Manifest(step=obj.get("step"), world_size=obj.get("world_size"), files=obj["files"],
                    loss=obj.get("loss"), config=obj.get("config") or {},
                    source=obj.get("source"), created=obj.get("created"),
                    ckptool_version=obj.get("ckptool_version"))

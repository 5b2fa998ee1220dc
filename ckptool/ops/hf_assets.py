"""What an export needs besides weights to load with ``from_pretrained`` as it is.

``consolidate`` into a folder writes ``config.json``, ``generation_config.json`` and the
tokenizer files whenever it knows them: from the checkpoint's manifest (``ckptool import``
copies them into ``hf_assets/`` and records ``config["hf_config"]`` and
``config["hf_assets"]``; a ``Checkpointer`` given a Hugging Face config records
``hf_config``), or from ``--hf-assets`` (a folder, or a Hub repo id whose asset files alone
are downloaded). Assets are small files read whole; only the
allow-listed names (``hf_source.ASSET_NAMES``) are taken, from inside the folder.

Tied embeddings (``"tie_word_embeddings": true`` in the config): ``lm_head.weight`` is left
out of the export, as ``save_pretrained`` does, after checking that its bytes equal the input
embedding's; a config that says "tied" over two different tensors is an error, never a model
that loads with the wrong head.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ckptool.errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format import manifest as mf
from ckptool.format.copy_engine import fsync_file
from ckptool.format.hf_source import (ASSET_NAMES, ASSETS_DIR, HEAD_NAME, MAX_ASSET_BYTES,
                                     HFSource, input_embeddings, ties_embeddings)
from ckptool.format.manifest import Manifest
from ckptool.format.metadata import TensorEntry
from ckptool.format.reader import CheckpointReader
from ckptool.storage import Storage

HEAD = HEAD_NAME


def collect(storage: Storage, man: Manifest | None, hf_assets: str | os.PathLike[str] | None
            ) -> dict[str, bytes]:
    """Asset file name -> bytes: ``--hf-assets`` wins over the manifest's copies."""
    out: dict[str, bytes] = {}
    cfg = man.config if man is not None else {}
    files = cfg.get("hf_assets") if isinstance(cfg.get("hf_assets"), dict) else {}
    for name, rel in sorted(files.items()):
        if name not in ASSET_NAMES or rel != f"hf_assets/{name}":
            raise CorruptCheckpointError(
                f"{storage.url_of('ckptool.json')} lists asset {name!r} at {rel!r}, which is not "
                "an asset file of this checkpoint", path=storage.url,
                hint="Re-import the checkpoint, or pass --hf-assets FOLDER")
        out[name] = storage.read_bytes(rel)
    hf_config = cfg.get("hf_config")
    if isinstance(hf_config, dict) and hf_config and "config.json" not in out:
        out["config.json"] = (json.dumps(hf_config, indent=2, sort_keys=True) + "\n").encode()
    if hf_assets is not None:
        out.update(_from_folder(_assets_folder(hf_assets)))
    return out


def _assets_folder(src: str | os.PathLike[str]) -> Path:
    """A local folder as it is; a Hub repo id ``org/name[@revision]`` downloaded (assets only)."""
    from ckptool.ops.import_hf import is_repo_id

    if is_repo_id(src):
        from ckptool.ops.hub_download import download_assets

        repo_id, _, revision = os.fspath(src).partition("@")
        return download_assets(repo_id, revision or None)
    return Path(os.fspath(src)).expanduser()


def _from_folder(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        raise ConfigError(f"--hf-assets {root}: not a folder",
                          hint="Pass a Hugging Face model folder holding config.json (and the "
                               "tokenizer files), e.g. a downloaded snapshot")
    out = {}
    base = root.resolve()
    # A Hugging Face cache snapshot links its files to ../../blobs/: that is inside the model.
    blobs = base.parent.parent / "blobs" if base.parent.name == "snapshots" else None
    for name in ASSET_NAMES:
        p = root / name
        if not p.is_file():
            continue
        if p.resolve().parent not in (base, blobs):
            raise ConfigError(f"--hf-assets {root}: {name} is a link leading out of the folder")
        if p.stat().st_size > MAX_ASSET_BYTES:
            raise ConfigError(f"--hf-assets {p} is {p.stat().st_size} bytes, too large for an "
                              "asset file")
        out[name] = p.read_bytes()
    if "config.json" not in out:
        raise ConfigError(f"--hf-assets {root} holds no config.json",
                          hint="Pass the folder of the model this checkpoint was trained from")
    return out


def config_of(assets: dict[str, bytes]) -> dict[str, Any]:
    """The parsed ``config.json`` among the assets ({} when absent)."""
    raw = assets.get("config.json")
    if raw is None:
        return {}
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"config.json is not valid JSON ({e})") from None
    return cfg if isinstance(cfg, dict) else {}


def untie(ck: CheckpointReader, selected: list[tuple[TensorEntry, str]],
          config: dict[str, Any]) -> tuple[list[tuple[TensorEntry, str]], str | None]:
    """Leave ``lm_head.weight`` out when the config ties it to an equal input embedding.

    Returns the tensors to export and the tied partner's name (None when nothing was left out).

    Raises:
        IncompatibleCheckpointError: the config says tied but the head differs from the
            embedding (the export would load a wrong head).
    """
    if not ties_embeddings(config):
        return selected, None
    head = next((t for t, name in selected if name == HEAD), None)
    if head is None:
        return selected, None
    by_name = {name: t for t, name in selected}
    partners = [(by_name[n], n) for n in input_embeddings(by_name) if n != HEAD
                and by_name[n].shape == head.shape and by_name[n].dtype == head.dtype]
    for t, name in partners:
        if _equal(ck, head, t):
            return [(t2, n) for t2, n in selected if n != HEAD], name
    raise IncompatibleCheckpointError(
        f"{ck.storage.url}: config.json says tie_word_embeddings but {HEAD} differs from "
        f"{', '.join(n for _, n in partners) or 'every input embedding'}; from_pretrained would "
        "load a wrong head", hint="Set tie_word_embeddings to false in the config (--hf-assets), "
                                  "or export weights only to a .safetensors file")


def _equal(ck: CheckpointReader, a: TensorEntry, b: TensorEntry) -> bool:
    """Same bytes, chunk by chunk (both saved with the same chunk geometry, as FSDP2 does)."""
    ca = sorted((c for c in a.chunks if c.numel), key=lambda c: c.offsets)
    cb = sorted((c for c in b.chunks if c.numel), key=lambda c: c.offsets)
    if [(c.offsets, c.sizes) for c in ca] != [(c.offsets, c.sizes) for c in cb]:
        return False
    return all(ck.read_chunk(a, x) == ck.read_chunk(b, y) for x, y in zip(ca, cb))


def copy_assets(source: HFSource, tmp: Path) -> dict[str, tuple[int, str]]:
    """Copy ``ckptool import``'s source's asset files into ``tmp/hf_assets/`` (fsynced); their
    (size, xxh3-64) by relative path."""
    if not source.assets:
        return {}
    (tmp / ASSETS_DIR).mkdir()
    out = {}
    for name, path in sorted(source.assets.items()):
        rel = f"{ASSETS_DIR}/{name}"
        shutil.copyfile(path, tmp / rel, follow_symlinks=True)
        fsync_file(tmp / rel)
        out[rel] = mf.file_checksum(Storage.open(tmp), rel)
    return out

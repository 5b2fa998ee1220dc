"""``--hf-model SRC`` resolved: which files a Hugging Face model source has, checked, on every rank.

Owns the ``Source`` record (label, ``config.json``, folder, the checked safetensors index, the
asset files that travel with the checkpoints) and turning SRC -- a model folder, a Hub repo id
``org/name[@rev]`` (downloaded by rank 0 only into the shared Hub cache) or a lone
``config.json`` -- into it. Building the model from it is ``hf_model.py``'s; reading the weights
``hf_weights.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptool.errors import ConfigError
from ckptool.format.hf_source import INDEX_NAME, MAX_ASSET_BYTES, HFSource, open_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")


@dataclass(frozen=True)
class Source:
    """A resolved ``--hf-model``: where its files are and what travels with the checkpoints.

    Attributes:
        label: what was given (a repo id as ``org/name@sha``).
        config_file: the ``config.json`` to read.
        folder: the local folder holding it (and the tokenizer files), or None for a lone file.
        weights: the checked safetensors index, None for a random init.
        assets: asset file name -> bytes (config, generation config, tokenizer files).
    """

    label: str
    config_file: str
    folder: str | None
    weights: HFSource | None
    assets: dict[str, bytes]

    @property
    def has_tokenizer(self) -> bool:
        return self.folder is not None and any(n in self.assets for n in TOKENIZER_FILES)

    def config_dict(self) -> dict[str, Any]:
        try:
            data = json.loads(self.assets["config.json"])
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--hf-model {self.label}: config.json is missing or not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--hf-model {self.label}: config.json is not a JSON object")
        return data


def resolve(src: str) -> Source:
    """Check ``src`` and read its headers and assets (called on every rank; a Hub repo is
    downloaded by rank 0 only, into the shared Hub cache, and the others read that copy).

    Raises:
        ConfigError: nothing at ``src``.
        CheckpointNotFoundError, IncompatibleCheckpointError, CorruptCheckpointError: as
            ``ckptool import`` (pickle weights refused, hostile headers).
        HubError: the download failed.
    """
    from ckptool.ops.import_hf import is_repo_id

    if is_repo_id(src):
        return _from_hub(src)
    p = Path(src).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".json":
            raise ConfigError(f"--hf-model {src}: give a model folder, a Hub repo id or a config.json file")
        return Source(src, str(p), None, None, {"config.json": _small_file(p)})
    if not p.is_dir():
        raise ConfigError(f"--hf-model {src}: no such folder or file, and not a Hub repo id org/name")
    names = {e.name for e in p.iterdir()}
    has_weights = INDEX_NAME in names or any(n.endswith((".safetensors", ".bin", ".pt", ".pth")) for n in names)
    weights = open_source(p) if has_weights else None  # pickles are refused there, never read
    if "config.json" not in names:
        raise ConfigError(f"--hf-model {src} holds no config.json",
                          hint="Give a folder written by save_pretrained (config.json and safetensors)")
    assets = _read_assets(weights.assets) if weights is not None else _folder_assets(p)
    return Source(src, str(p / "config.json"), str(p), weights, assets)


def _from_hub(src: str) -> Source:
    from ckptool.errors import CkptError
    from ckptool.ops.hub_download import download

    repo_id, _, revision = src.partition("@")
    got, problem = None, None
    if this_rank() == 0:
        try:
            root, files, sha = download(repo_id, revision or None)
            got = (str(root), files, sha)
        except CkptError as e:
            problem = (type(e), str(e))
    got, problem = from_rank0((got, problem))
    if problem is not None:
        raise problem[0](problem[1])
    root, files, sha = got
    weights = open_source(root, files=files)
    if "config.json" not in weights.assets:
        raise ConfigError(f"--hf-model {src}: the repo holds no config.json")
    return Source(f"{repo_id}@{sha}", weights.assets["config.json"], root, weights, _read_assets(weights.assets))


def _small_file(p: Path) -> bytes:
    if p.stat().st_size > MAX_ASSET_BYTES:
        raise ConfigError(f"--hf-model {p} is {p.stat().st_size} bytes, too large for a config file")
    return p.read_bytes()


def _read_assets(paths: dict[str, str]) -> dict[str, bytes]:
    return {name: _small_file(Path(path)) for name, path in sorted(paths.items())}


def _folder_assets(p: Path) -> dict[str, bytes]:
    from ckptool.ops.hf_assets import _from_folder  # the --hf-assets reader: allow-list, no links out

    return _from_folder(p)


def this_rank() -> int:
    """This process's rank, 0 without a process group."""
    return dist.get_rank() if dist.is_initialized() else 0


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

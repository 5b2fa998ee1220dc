"""Reading a Hugging Face model folder of safetensors as untrusted data (torch-free).

Owns what ``ckptool import`` trusts about its input: which files make up the model
(``model.safetensors``, or the shards named by ``model.safetensors.index.json``, or one
``.safetensors`` file), where every tensor's bytes sit, and which asset files
(``config.json``, ``generation_config.json``, tokenizer files) travel along. Every header is
bounds-checked before a byte of data is used (by ``safetensors_source.read_header``: header
length inside the file, a JSON object of known dtypes, ``end - begin == prod(shape) *
itemsize``, offsets inside the file, no two tensors overlapping). Index entries are
path-checked (relative, no ``..``, nothing that leaves the folder through a symlink). PyTorch
pickle weights (``*.bin``, ``*.pt``) are refused, never unpickled. Moving the bytes is ``ops/import_hf.py``'s business.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from ckptool.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from ckptool.format.dtypes import DType

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Largest index file read (as safetensors' own limit on a header: 100 MB).
MAX_HEADER = 100_000_000
#: Asset files copied into the checkpoint (``hf_assets/``) so an export loads as it is.
ASSET_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "vocab.json",
               "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
               "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
MAX_ASSET_BYTES = 256 << 20
#: Where a checkpoint keeps its Hugging Face asset files (as ``ckptool import`` writes them).
ASSETS_DIR = "hf_assets"

#: The output head that ``tie_word_embeddings`` ties to the input embedding.
HEAD_NAME = "lm_head.weight"
#: Input embeddings of the common architectures, most specific first.
KNOWN_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "transformer.wte.weight", "model.decoder.embed_tokens.weight")
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                       "embed_in.weight", "tok_embeddings.weight")


def ties_embeddings(config: dict[str, Any]) -> bool:
    """The config ties the head to the input embedding (top level, or a VLM's text config)."""
    tie = config.get("tie_word_embeddings")
    if tie is None and isinstance(config.get("text_config"), dict):
        tie = config["text_config"].get("tie_word_embeddings")
    return tie is True


def input_embeddings(names: Iterable[str]) -> list[str]:
    """Names that may be the tied head's input embedding: the known ones first, then others
    with an embedding's suffix. A name only; callers check shapes, bytes or uniqueness."""
    names = list(names)
    known = [n for n in KNOWN_EMBEDDINGS if n in names]
    return known + [n for n in names if n.endswith(_EMBEDDING_SUFFIXES) and n not in known]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source: ``nbytes`` at absolute ``offset`` of file ``path``."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    path: str
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class HFSource:
    """A checked source model.

    Attributes:
        root: the folder (or file) it was read from.
        tensors: name -> ``SourceTensor``, in file then offset order (the read order).
        files: the safetensors files used, absolute paths.
        assets: asset name -> absolute path of the files to carry along.
        config: the parsed ``config.json`` ({} when absent).
    """

    root: str
    tensors: dict[str, SourceTensor]
    files: tuple[str, ...]
    assets: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def open_source(src: str | os.PathLike[str], *, files: dict[str, str] | None = None) -> HFSource:
    """Check and describe a local HF model folder or a single ``.safetensors`` file.

    Args:
        src: the folder or file.
        files: for a Hub download: name -> local path of every file fetched (cache entries are
            symlinks into the cache, so names are resolved through this map, not the folder).

    Returns:
        The ``HFSource``.

    Raises:
        CheckpointNotFoundError: nothing at ``src``, or no safetensors weights in it.
        IncompatibleCheckpointError: only pickle weights (``.bin``): refused, never unpickled.
        CorruptCheckpointError: a hostile or damaged header, index or config.

    Example:
        >>> s = open_source("models/llama-tiny")
        >>> s.tensors["model.norm.weight"].shape
        (16,)
    """
    p = Path(os.fspath(src))
    if files is None:
        if p.is_file():
            return _open_file(p)
        if not p.is_dir():
            raise CheckpointNotFoundError(f"{p} does not exist", path=str(p),
                                          hint="Give a Hugging Face model folder, a .safetensors "
                                               "file, or a Hub repo id org/name[@revision]")
        return _open_folder(p, {e.name for e in p.iterdir()}, None)
    return _open_folder(p, set(files), files)


def _open_file(p: Path) -> HFSource:
    if p.suffix.lower() in _PICKLE_SUFFIXES:
        raise _pickle_refusal(str(p), p.name)
    if p.suffix.lower() != ".safetensors":
        raise IncompatibleCheckpointError(f"{p} is not a .safetensors file", path=str(p),
                                          hint="Give a Hugging Face model folder or a .safetensors file")
    return HFSource(str(p), read_tensors(p), (str(p.resolve()),))


def _open_folder(root: Path, present: set[str], files: dict[str, str] | None) -> HFSource:
    if INDEX_NAME in present:
        names = _index_files(root, files)
    elif SINGLE_NAME in present:
        names = [SINGLE_NAME]
    else:
        names = sorted(n for n in present if n.endswith(".safetensors"))
        if len(names) != 1:
            if not names:
                refuse_pickles(str(root), sorted(present))
            raise CheckpointNotFoundError(
                f"{root} holds no model.safetensors and no {INDEX_NAME}"
                + (f" but {len(names)} .safetensors files" if names else ""), path=str(root),
                hint="Give a Hugging Face model folder saved with save_pretrained")
    tensors: dict[str, SourceTensor] = {}
    paths = []
    for name in names:
        path = _inside(root, files, name)
        paths.append(str(path))
        for t in read_tensors(path).values():
            if t.name in tensors:
                raise CorruptCheckpointError(f"{root}: tensor {t.name} is in both "
                                             f"{Path(tensors[t.name].path).name} and {name}",
                                             path=str(root), hint="The index or shards are damaged")
            tensors[t.name] = t
    if INDEX_NAME in present:
        _check_weight_map(root, files, tensors)
    assets = {n: str(_inside(root, files, n)) for n in ASSET_NAMES if n in present}
    return HFSource(str(root), tensors, tuple(paths), assets, _config(assets))


def refuse_pickles(where: str, names: list[str]) -> None:
    """Raise the pickle refusal if ``names`` hold PyTorch pickle weights (``*.bin``, ...)."""
    pickles = [n for n in names if n.lower().endswith(_PICKLE_SUFFIXES)]
    if pickles:
        raise _pickle_refusal(where, pickles[0])


def _pickle_refusal(where: str, name: str) -> IncompatibleCheckpointError:
    return IncompatibleCheckpointError(
        f"{where}: {name} is a PyTorch pickle; ckptool never unpickles weights (loading a pickle "
        "can run arbitrary code)", path=where,
        hint="Use a safetensors copy of the model (save_pretrained(..., safe_serialization=True) "
             "or the Hub's safetensors conversion)")


def _index(root: Path, files: dict[str, str] | None) -> dict[str, Any]:
    path = _inside(root, files, INDEX_NAME)
    if os.path.getsize(path) > MAX_HEADER:
        raise CorruptCheckpointError(f"{path} is implausibly large", path=str(path))
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})", path=str(path)) from None
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not wm or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError(f"{path} has no weight_map of tensor name -> file name",
                                     path=str(path))
    return wm


def _index_files(root: Path, files: dict[str, str] | None) -> list[str]:
    wm = _index(root, files)
    names = sorted(set(wm.values()))
    for name in names:
        _check_name(root, name)
        if not name.endswith(".safetensors"):
            if name.lower().endswith(_PICKLE_SUFFIXES):
                raise _pickle_refusal(str(root), name)
            raise CorruptCheckpointError(f"{root}/{INDEX_NAME} names {name!r}, not a "
                                         ".safetensors file", path=str(root))
    return names


def _check_weight_map(root: Path, files: dict[str, str] | None, tensors: dict[str, SourceTensor]) -> None:
    wm = _index(root, files)
    for name, fname in wm.items():
        t = tensors.get(name)
        if t is None or Path(t.path) != _inside(root, files, fname):
            raise CorruptCheckpointError(
                f"{root}/{INDEX_NAME} puts {name} in {fname}, but that file does not hold it",
                path=str(root), hint="The index and the shards disagree; re-download the model")
    extra = sorted(set(tensors) - set(wm))
    if extra:
        raise CorruptCheckpointError(f"{root}: {extra[0]} is in a shard but not in {INDEX_NAME}",
                                     path=str(root), hint="The index and the shards disagree")


def _check_name(root: Path, name: str) -> None:
    parts = name.replace("\\", "/").split("/")
    if (not name or name.startswith(("/", "\\")) or ".." in parts or ":" in name
            or any(p in ("", ".") for p in parts) or "\0" in name):
        raise CorruptCheckpointError(f"{root}/{INDEX_NAME} names an unsafe path {name!r}",
                                     path=str(root), hint="Refusing to read outside the model folder")


def _inside(root: Path, files: dict[str, str] | None, name: str) -> Path:
    """The real path of ``name`` in the source, refusing anything that leaves the folder.

    ``files`` (a Hub download) maps names to the paths the client returned: cache entries,
    symlinks into the cache's blob store, fetched by ckptool itself. A local folder has none,
    and there every name must resolve to a regular file inside ``root``.
    """
    _check_name(root, name)
    if files is not None:
        if name not in files:
            raise CheckpointNotFoundError(f"{root}: {name} was not downloaded", path=str(root),
                                          hint="The repo's index names a file it does not hold")
        return Path(files[name]).resolve()
    path = root / name
    if not path.exists():
        raise CheckpointNotFoundError(f"{root}: {name} is missing", path=str(root),
                                      hint="The download or copy is incomplete")
    real = path.resolve()
    if root.resolve() not in real.parents:
        raise CorruptCheckpointError(f"{root}: {name} leads outside the folder (to {real})",
                                     path=str(root), hint="Refusing to follow it")
    if not real.is_file():
        raise CorruptCheckpointError(f"{root}: {name} is not a regular file", path=str(root))
    return real


def _config(assets: dict[str, str]) -> dict[str, Any]:
    for path in assets.values():
        if os.path.getsize(path) > MAX_ASSET_BYTES:
            raise CorruptCheckpointError(f"{path} is over {MAX_ASSET_BYTES >> 20} MiB, too large for "
                                         "an asset file", path=path)
    if "config.json" not in assets:
        return {}
    path = assets["config.json"]
    try:
        obj = json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})", path=path) from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object", path=path)
    return obj


# ---------------------------------------------------------------------------------------------
# One safetensors file


def read_tensors(path: str | os.PathLike[str]) -> dict[str, SourceTensor]:
    """Every tensor of one ``.safetensors`` file, after checking its header against the file
    (``safetensors_source.read_header``: the one safetensors header reader).

    Args:
        path: the file.

    Returns:
        name -> ``SourceTensor`` in data-offset order.

    Raises:
        CorruptCheckpointError: any header inconsistency (one line naming the file and tensor).

    Example:
        >>> read_tensors("model.safetensors")["lm_head.weight"].dtype.name
        'bfloat16'
    """
    from ckptool.format.safetensors_source import read_header
    from ckptool.storage import Storage

    p = Path(os.fspath(path))
    header = read_header(Storage.open(p.parent), p.name)
    return {t.name: SourceTensor(t.name, t.dtype, t.shape, str(p), t.start)
            for t in header.tensors.values()}

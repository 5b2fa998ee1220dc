"""Publish model weights to the Hugging Face Hub: check them, describe them, send them.

Owns: what PATH is (one ``.safetensors`` file, a folder of HF-style shards with its index, or a
DCP checkpoint, which ``consolidate`` exports into a temporary folder first), and the staging
folder (links to the user's files, the export, ``README.md`` and ``config.json``). The checks
of the staged files before anything is sent are ``weight_checks.py``'s, the calls to
``huggingface_hub`` (``whoami``, ``create_repo``, ``create_branch``, ``upload_folder``)
``hub_upload.py``'s, the card text ``model_card.py``'s and the export ``consolidate``'s.

Resuming: ``upload_folder`` hashes every file and asks the Hub which objects it already holds
(git-lfs batch API, or Xet deduplication), so re-running the same command after an
interruption sends only what is missing. The temporary folder is removed on success and on
failure. The token comes from ``token``, ``HF_TOKEN`` or ``hf auth login``'s file; it is never
put in a result, a message or a log line. huggingface_hub is imported lazily; torch never is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool._version import __version__
from ckptool.errors import CheckpointNotFoundError, ConfigError, NoCheckpointError
from ckptool.format.hf_source import ASSET_NAMES
from ckptool.format.safetensors_writer import INDEX_NAME, SINGLE_NAME
from ckptool.format.text_enum import TextEnum
from ckptool.ops.hub_upload import (
    NOT_LOGGED_IN,
    RESUME_HINT,
    HubSession,
    login,
    send_folder,
)
from ckptool.ops.hub_upload import hub_error as _hub_error  # noqa: F401  (tests import it here)
from ckptool.ops.model_card import MODEL_TYPE, CardFacts, model_card, model_config_json
from ckptool.ops.weight_checks import (
    Weights,
    check_weights,
    not_sent,
    read_index,
    shown,
)
from ckptool.storage import is_url

Progress = Callable[[int, int], None]
__all__ = ["NOT_LOGGED_IN", "RESUME_HINT", "SourceKind", "UploadFile", "UploadResult", "upload"]
#: Files of a shards folder sent as they are (they win over the generated ones).
PASS_THROUGH = ("README.md", *ASSET_NAMES)  # config, generation config, tokenizer files


class SourceKind(TextEnum):
    """What PATH was: one safetensors file, a folder of HF-style shards, or a DCP checkpoint."""

    SAFETENSORS = "safetensors"
    SHARDS = "shards"
    DCP = "dcp"


@dataclass(frozen=True)
class UploadFile:
    """One file of the commit: its path in the repo and its size in bytes."""

    path_in_repo: str
    size: int


@dataclass(frozen=True)
class UploadResult:
    """What ``upload`` sent (or, with ``dry_run``, would send).

    Attributes:
        repo_id: ``namespace/name`` (the namespace filled in by the Hub when it was left out).
        source: the file, folder or checkpoint read.
        kind: ``"safetensors"``, ``"shards"`` or ``"dcp"`` (consolidated on the way).
        files: every file of the commit, weights first.
        bytes: their total size.
        tensors, dtype: the tensors in the weight files and their dtypes.
        step, world_size, loss: provenance, None when unknown.
        dry_run: nothing was sent.
        revision: the branch written to (None: the default branch).
        repo_url, commit_url, pr_url: the Hub's answers (None in a dry run).
        user: who the token belongs to (None in a dry run).
        seconds: wall time.
    """

    repo_id: str
    source: str
    kind: SourceKind
    files: tuple[UploadFile, ...]
    bytes: int
    tensors: int
    dtype: str | None
    step: int | None
    world_size: int | None
    loss: float | None
    dry_run: bool
    revision: str | None
    repo_url: str | None
    commit_url: str | None
    pr_url: str | None
    user: str | None
    seconds: float


@dataclass(frozen=True)
class _Source:
    kind: SourceKind
    path: str
    name: str
    step: int | None = None
    world_size: int | None = None
    loss: float | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] | None = None
    hf_model_type: str | None = None
    base_model: str | None = None


@dataclass(frozen=True)
class _Export:
    """``consolidate``'s options, for a DCP source only."""

    dtype: str | None = None
    max_shard_size: int | None = None
    model_key: str | None = None
    keep_wrappers: bool = False


def upload(path: str | os.PathLike[str], repo_id: str, *, private: bool = False,
           revision: str | None = None, path_in_repo: str | None = None,
           commit_message: str | None = None, create_pr: bool = False, dtype: str | None = None,
           max_shard_size: int | None = None, model_key: str | None = None,
           keep_wrappers: bool = False, token: str | None = None, dry_run: bool = False,
           progress: Progress | None = None) -> UploadResult:
    """Upload model weights with a model card to a Hugging Face Hub model repo.

    Peak memory is that of ``consolidate`` for a DCP source (a fixed buffer), else a header.

    Args:
        path: a ``.safetensors`` file, a folder of ``model.safetensors`` or shards with their
            index (its ``README.md``/``config.json`` are sent and win over the generated ones),
            or a DCP checkpoint / run folder (consolidated to a temporary folder first).
        repo_id: ``namespace/name``; created if missing (``name`` alone: your namespace).
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to commit to, created from the default branch if missing.
        path_in_repo: folder in the repo for all files (default: the root).
        commit_message: default ``"Upload <checkpoint> (step N) with ckptool X"``.
        create_pr: open a pull request against the default branch instead of committing.
        dtype, max_shard_size, model_key, keep_wrappers: consolidate options (DCP only).
        token: a Hub token; default ``HF_TOKEN`` or the one saved by ``hf auth login``.
        dry_run: check and stage everything, send nothing (no token needed).
        progress: ``progress(bytes_done, bytes_total)`` while consolidating.

    Returns:
        An ``UploadResult`` with the commit URL.

    Raises:
        HubError: not logged in, the Hub refused (401/403/404) or could not be reached.
        CorruptCheckpointError: a weight file or the index fails its check; nothing was sent.
        ConfigError: a bad option; CheckpointNotFoundError: nothing to upload at ``path``.

    Example:
        >>> upload("runs/demo/step_40", "alice/tiny-gpt", dtype="bfloat16").commit_url
    """
    t0 = time.perf_counter()
    repo_id, subfolder = _check_target(repo_id, path_in_repo, revision, create_pr=create_pr)
    export = _Export(dtype, max_shard_size, model_key, keep_wrappers)
    src = _open_source(path, export)
    hub = None if dry_run else login(token)
    with tempfile.TemporaryDirectory(prefix="ckptool-upload-") as tmp:
        stage = Path(tmp) / "stage"
        src, weights, files = _fill_stage(src, stage, export, repo_id, subfolder, progress)
        sent = {} if hub is None else send_folder(
            hub, repo_id, stage, private=private, revision=revision, subfolder=subfolder,
            message=commit_message or _default_message(src), create_pr=create_pr)
    return _result(src, weights, files, sent, repo_id=repo_id, revision=revision, hub=hub,
                   seconds=time.perf_counter() - t0)


def _result(src: _Source, weights: Weights, files: tuple[UploadFile, ...],
            sent: dict[str, str | None], *, repo_id: str, revision: str | None,
            hub: HubSession | None, seconds: float) -> UploadResult:
    return UploadResult(
        repo_id=sent.get("repo_id") or repo_id, source=src.path, kind=src.kind, files=files,
        bytes=sum(f.size for f in files), tensors=weights.tensors,
        dtype=", ".join(weights.dtypes) or None, step=src.step, world_size=src.world_size,
        loss=src.loss, dry_run=hub is None, revision=revision, repo_url=sent.get("repo_url"),
        commit_url=sent.get("commit_url"), pr_url=sent.get("pr_url"),
        user=hub.user if hub is not None else None, seconds=seconds)


# ---------------------------------------------------------------------------------------------
# The source and the staging folder


def _open_source(path: str | os.PathLike[str], export: _Export) -> _Source:
    s = os.fspath(path)
    p = Path(s).expanduser().absolute()
    local = not is_url(s)
    if local and p.is_file():
        if p.suffix != ".safetensors":
            raise ConfigError(f"{p} is not a .safetensors file",
                              hint="Pass a .safetensors file, a folder of shards with its "
                                   "index, or a DCP checkpoint folder")
        src = _Source(SourceKind.SAFETENSORS, str(p), p.name)
    elif local and any((p / n).is_file() for n in (INDEX_NAME, SINGLE_NAME)):
        src = _Source(SourceKind.SHARDS, str(p), p.name)
    else:
        return _open_checkpoint(s)
    if export != _Export():
        raise ConfigError(f"--dtype, --max-shard-size, --model-key and --keep-wrappers apply "
                          f"to DCP checkpoints; {p} is "
                          "safetensors already", hint="Re-export it with 'ckptool consolidate "
                                                      "CKPT OUT --dtype ...' or drop the options")
    return src


def _open_checkpoint(path: str) -> _Source:
    from ckptool.format.checkpoint_dirs import resolve_checkpoint
    from ckptool.format.manifest import read_manifest

    try:
        ckpt = resolve_checkpoint(path)
    except CheckpointNotFoundError as e:
        if not isinstance(e, NoCheckpointError):
            raise
        raise CheckpointNotFoundError(
            f"{e.path} holds nothing to upload (no {SINGLE_NAME}, no {INDEX_NAME}, no DCP "
            ".metadata)", path=e.path, hint="Pass a .safetensors file, a folder of shards with "
                                            "its index, or a DCP checkpoint such as runs/demo/step_100"
        ) from None
    m = read_manifest(ckpt.storage)
    config = dict(m.config) if m is not None else {}
    model_config = config.get("model_config")
    if isinstance(model_config, dict) and not _is_builtin(model_config):
        model_config = None  # e.g. a transformers config: config.json comes from hf_config
    source = m.source if m is not None and isinstance(m.source, dict) else {}
    label = source.get("path") if source.get("operation") == "import" else None
    base = label.split("@", 1)[0] if isinstance(label, str) and _looks_like_repo(label) else None
    return _Source(SourceKind.DCP, ckpt.url, ckpt.name, base_model=base,
                   step=m.step if m is not None and m.step is not None else ckpt.step,
                   world_size=m.world_size if m is not None else None,
                   loss=m.loss if m is not None else None, train_config=config,
                   model_config=model_config if isinstance(model_config, dict) else None)


def _fill_stage(src: _Source, stage: Path, export: _Export, repo_id: str, subfolder: str,
                progress: Progress | None) -> tuple[_Source, Weights, tuple[UploadFile, ...]]:
    """Stage the weights, check them, add ``config.json`` and the card when missing, list."""
    _stage(src, stage, export, progress)
    weights = check_weights(stage)
    src = _with_file_provenance(src, stage, weights)
    _write_card(stage, src, weights, repo_id, subfolder)
    return src, weights, _listing(stage, weights.files, subfolder)


def _stage(src: _Source, stage: Path, export: _Export, progress: Progress | None) -> None:
    """Fill ``stage`` (absent) with the weights: an export, or links to the user's files."""
    if src.kind is SourceKind.DCP:
        from ckptool.ops.consolidate import DEFAULT_MAX_SHARD, consolidate

        consolidate(src.path, stage, dtype=export.dtype,
                    max_shard_size=export.max_shard_size or DEFAULT_MAX_SHARD,
                    model_key=export.model_key, keep_wrappers=export.keep_wrappers,
                    progress=progress)
        return
    stage.mkdir()
    if src.kind is SourceKind.SAFETENSORS:
        os.symlink(src.path, stage / SINGLE_NAME)
        return
    folder = Path(src.path)
    if (folder / INDEX_NAME).is_file():
        names = [INDEX_NAME, *sorted(set(read_index(folder / INDEX_NAME)[0].values()))]
    else:
        names = [SINGLE_NAME]
    names += [n for n in PASS_THROUGH if (folder / n).is_file()]
    for name in names:
        if not (folder / name).is_file():
            raise not_sent(shown(folder / INDEX_NAME), f"it names {name}, which does not exist")
        os.symlink(folder / name, stage / name)


def _with_file_provenance(src: _Source, stage: Path, weights: Weights) -> _Source:
    """Fill what the source did not say from the safetensors header and a ckptool config.json."""
    meta, model_config = weights.metadata, src.model_config
    config = stage / "config.json"
    hf_model_type = None
    if config.is_file():
        with contextlib.suppress(ValueError):
            obj = json.loads(config.read_bytes())
            kind = obj.get("model_type") if isinstance(obj, dict) else None
            if kind == MODEL_TYPE and model_config is None:
                model_config = obj
            elif isinstance(kind, str) and kind != MODEL_TYPE:
                hf_model_type = kind
    name = src.name if src.kind is SourceKind.DCP else meta.get("source_checkpoint") or src.name
    step = src.step if src.step is not None else _int(meta.get("source_step"))
    world_size = src.world_size if src.world_size is not None \
        else _int(meta.get("source_world_size"))
    return dataclasses.replace(src, name=name, step=step, world_size=world_size,
                               model_config=model_config, hf_model_type=hf_model_type)


def _is_builtin(model_config: dict[str, Any]) -> bool:
    """The manifest's ``model_config`` describes ckptool's built-in model."""
    try:
        model_config_json(model_config)
    except (ConfigError, TypeError, ValueError):
        return False
    return True


def _looks_like_repo(label: str) -> bool:
    from ckptool.ops.import_hf import is_repo_id

    return is_repo_id(label)


def _int(text: str | None) -> int | None:
    return int(text) if isinstance(text, str) and text.isdigit() else None


def _write_card(stage: Path, src: _Source, weights: Weights, repo_id: str, subfolder: str) -> None:
    if src.model_config and not (stage / "config.json").exists():
        (stage / "config.json").write_bytes(model_config_json(src.model_config))
    if (stage / "README.md").exists():
        return
    facts = CardFacts(
        repo_id=repo_id, weight_files=weights.files, sharded=(stage / INDEX_NAME).exists(),
        tensors=weights.tensors, nbytes=weights.nbytes, dtype=", ".join(weights.dtypes) or None,
        step=src.step, loss=src.loss, world_size=src.world_size, source=src.name,
        train_config=src.train_config, model_config=src.model_config, subfolder=subfolder,
        hf_model_type=src.hf_model_type, base_model=src.base_model)
    (stage / "README.md").write_text(model_card(facts), encoding="utf-8")


def _listing(stage: Path, weight_files: tuple[str, ...], subfolder: str) -> tuple[UploadFile, ...]:
    names = sorted(p.name for p in stage.iterdir())
    names.sort(key=lambda n: (n not in weight_files, n != INDEX_NAME))
    prefix = f"{subfolder}/" if subfolder else ""
    return tuple(UploadFile(prefix + n, (stage / n).stat().st_size) for n in names)


def _default_message(src: _Source) -> str:
    step = f" (step {src.step})" if src.step is not None else ""
    return f"Upload {src.name}{step} with ckptool {__version__}"


def _check_target(repo_id: str, path_in_repo: str | None, revision: str | None, *,
                  create_pr: bool) -> tuple[str, str]:
    """The checked repo id and folder in it; refuse a pull request against another branch."""
    checked = _check_repo_id(repo_id), _clean_subfolder(path_in_repo)
    if create_pr and revision not in (None, "main"):
        raise ConfigError(f"--create-pr opens a pull request against main, not {revision!r}; "
                          "drop --revision or --create-pr")
    return checked


def _check_repo_id(repo_id: str) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConfigError(f"{repo_id!r} is not a valid repo id",
                          hint="Use NAMESPACE/NAME with letters, digits, '-', '_' and '.', "
                               "e.g. alice/tiny-gpt") from None
    return repo_id


def _clean_subfolder(path_in_repo: str | None) -> str:
    sub = (path_in_repo or "").strip("/")
    if sub and any(part in ("", ".", "..") for part in sub.split("/")):
        raise ConfigError(f"--path-in-repo {path_in_repo!r} must be a plain relative folder",
                          hint="Use e.g. 'step_300' or 'exports/bf16'")
    return sub

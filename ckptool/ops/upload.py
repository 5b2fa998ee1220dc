"""Publish model weights to the Hugging Face Hub: check them, describe them, send them.

Owns: what PATH is (one ``.safetensors`` file, a folder of HF-style shards with its index, or a
DCP checkpoint, which ``consolidate`` exports into a temporary folder first), the checks made
before anything is sent (every safetensors header parses and covers its file exactly; the
index names files that exist, the tensors they hold and their total size), the staging folder
(links to the user's files, the export, ``README.md`` and ``config.json``), and the calls to
``huggingface_hub``: ``whoami``, ``create_repo(exist_ok=True)``, ``create_branch`` and
``upload_folder``. The card text is ``model_card.py``'s; the export is ``consolidate``'s.

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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool._version import __version__
from ckptool.errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError, HubError,
                            NoCheckpointError)
from ckptool.format.safetensors_writer import INDEX_NAME, SINGLE_NAME
from ckptool.format.hf_source import ASSET_NAMES
from ckptool.ops.model_card import MODEL_TYPE, CardFacts, model_card, model_config_json
from ckptool.storage import is_url

Progress = Callable[[int, int], None]
NOT_LOGGED_IN = "Not logged in. Run 'hf auth login' or pass --token / set HF_TOKEN"
RESUME_HINT = ("Re-run the same command to resume: files the Hub already has are not sent "
               "again")
#: Files of a shards folder sent as they are (they win over the generated ones).
PASS_THROUGH = ("README.md", *ASSET_NAMES)  # config, generation config, tokenizer files


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
    kind: str
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
    kind: str
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
class _Weights:
    """What the checked weight files hold."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    dtypes: tuple[str, ...]
    metadata: dict[str, str]


def upload(path: str | os.PathLike[str], repo_id: str, *, private: bool = False,
           revision: str | None = None, path_in_repo: str | None = None,
           commit_message: str | None = None, create_pr: bool = False, dtype: str | None = None,
           max_shard_size: int | None = None, model_key: str | None = None,
           keep_wrappers: bool = False, token: str | None = None, dry_run: bool = False,
           progress: Progress | None = None) -> UploadResult:
    """Upload model weights with a model card to a Hugging Face Hub model repo.

    Peak memory is that of ``consolidate`` for a DCP source (a fixed buffer), else a header.

    Args:
        path: a ``.safetensors`` file (sent as ``model.safetensors``), a folder holding
            ``model.safetensors`` or shards with ``model.safetensors.index.json`` (its
            ``README.md``/``config.json`` are sent too and win over the generated ones), or a
            DCP checkpoint / run folder (consolidated to a temporary folder first).
        repo_id: ``namespace/name``; created if missing (``name`` alone: your namespace).
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to commit to, created from the default branch if missing.
        path_in_repo: folder in the repo for all files (default: the root).
        commit_message: default ``"Upload <checkpoint> (step N) with ckptool X"``.
        create_pr: open a pull request against the default branch instead of committing.
        dtype, max_shard_size, model_key, keep_wrappers: consolidate options, for a DCP
            source only.
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
        >>> r = upload("runs/demo/step_40", "alice/tiny-gpt", dtype="bfloat16")
        >>> r.commit_url
    """
    t0 = time.perf_counter()
    repo_id, subfolder = _check_repo_id(repo_id), _clean_subfolder(path_in_repo)
    if create_pr and revision not in (None, "main"):
        raise ConfigError(f"--create-pr opens a pull request against main, not {revision!r}; "
                          "drop --revision or --create-pr")
    src = _open_source(path, dtype=dtype, max_shard_size=max_shard_size,
                       naming=model_key is not None or keep_wrappers)
    tok = _token(token, required=not dry_run)
    api = None if dry_run else _api(tok)
    user = _whoami(api, tok) if api is not None else None
    with tempfile.TemporaryDirectory(prefix="ckptool-upload-") as tmp:
        stage = Path(tmp) / "stage"
        _stage(src, stage, dtype=dtype, max_shard_size=max_shard_size, model_key=model_key,
               keep_wrappers=keep_wrappers, progress=progress)
        weights = _check_weights(stage)
        src = _with_file_provenance(src, stage, weights)
        _write_card(stage, src, weights, repo_id, subfolder)
        files = _listing(stage, weights.files, subfolder)
        sent: dict[str, str | None] = {}
        if api is not None:
            message = commit_message or _default_message(src)
            sent = _send(api, tok, repo_id, stage, private=private, revision=revision,
                         subfolder=subfolder, message=message, create_pr=create_pr)
    return UploadResult(
        repo_id=sent.get("repo_id") or repo_id, source=src.path, kind=src.kind, files=files,
        bytes=sum(f.size for f in files), tensors=weights.tensors,
        dtype=", ".join(weights.dtypes) or None, step=src.step, world_size=src.world_size,
        loss=src.loss, dry_run=dry_run, revision=revision, repo_url=sent.get("repo_url"),
        commit_url=sent.get("commit_url"), pr_url=sent.get("pr_url"), user=user,
        seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Checks of the files (no tensor is loaded)


def _check_weights(folder: str | os.PathLike[str]) -> _Weights:
    """Check every ``*.safetensors`` file in ``folder`` and its index, reading headers only.

    Args:
        folder: holds ``model.safetensors``, or shards and ``model.safetensors.index.json``.

    Returns:
        The weight files (sorted), tensor count, data bytes and dtypes.

    Raises:
        CorruptCheckpointError: a header does not parse or does not cover its file exactly,
            or the index names a missing file or tensor, or its ``total_size`` is wrong.
    """
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise _bad(_shown(folder), "there are no .safetensors files to send")
    checked = {p.name: _check_file(p) for p in shards}
    held = {name: tensors for name, (tensors, _) in checked.items()}
    index = folder / INDEX_NAME
    if index.exists():
        _check_index(index, held)
    elif len(shards) != 1:
        raise CorruptCheckpointError(
            f"{_shown(folder)} holds {len(shards)} .safetensors files and no {INDEX_NAME}; "
            "nothing was sent", hint="Export with 'ckptool consolidate CKPT FOLDER' to get an index")
    sizes = {name: n for tensors in held.values() for name, (_, n) in tensors.items()}
    dtypes = {dt for tensors in held.values() for dt, _ in tensors.values()}
    meta = checked[shards[0].name][1]
    return _Weights(tuple(held), len(sizes), sum(sizes.values()), tuple(sorted(dtypes)), meta)


def _check_file(path: Path) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """(name -> (dtype, data bytes), ``__metadata__``) of a file whose tensors tile its data.

    The header is checked by the one safetensors reader (``safetensors_source.read_header``:
    bounds, dtypes, sizes, overlaps); here, also that the tensors leave no gap or tail."""
    from ckptool.format.safetensors_source import SourceError, read_header
    from ckptool.storage import Storage

    where = _shown(path)
    try:
        header = read_header(Storage.open(path.parent), path.name)
    except SourceError as e:
        raise _bad(where, f"not a valid safetensors file: {e.what}") from None
    out, end = {}, header.header_bytes
    for t in header.tensors.values():  # data order
        if t.start != end:
            raise _bad(where, f"tensor {t.name} starts at byte {t.start}, expected {end} "
                              "(a gap in the data)")
        out[t.name], end = (t.dtype.name, t.nbytes), t.start + t.nbytes
    if end != header.size:
        raise _bad(where, f"the tensors end at byte {end} but the file has {header.size} bytes "
                          "(truncated or with trailing data)")
    return out, dict(header.metadata)


def _check_index(index: Path, held: dict[str, dict[str, tuple[str, int]]]) -> None:
    where = _shown(index)
    weight_map, total = _read_index(index)
    for name, file in weight_map.items():
        if file not in held:
            raise _bad(where, f"its weight_map puts {name} in {file}, which does not exist")
        if name not in held[file]:
            raise _bad(where, f"its weight_map puts {name} in {file}, which does not hold it")
    for file, tensors in held.items():
        extra = sorted(set(tensors) - {n for n, f in weight_map.items() if f == file})
        if extra:
            raise _bad(where, f"{file} holds {extra[0]}, which its weight_map does not list")
    nbytes = sum(n for tensors in held.values() for _, n in tensors.values())
    if total != nbytes:
        raise _bad(where, f"metadata.total_size is {total} but the shards hold {nbytes} bytes of "
                          "tensors")


def _read_index(index: Path) -> tuple[dict[str, str], Any]:
    try:
        obj = json.loads(index.read_bytes())
        weight_map = obj["weight_map"]
        ok = isinstance(weight_map, dict) and bool(weight_map) and all(
            isinstance(f, str) and f == os.path.basename(f) and f.endswith(".safetensors")
            for f in weight_map.values())
        total = (obj.get("metadata") or {}).get("total_size")
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise _bad(_shown(index), "not a safetensors index (a JSON object whose weight_map maps "
                                  "tensor names to .safetensors files in the same folder)")
    return weight_map, total


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {what}; nothing was sent", path=where,
        hint="Re-export it with 'ckptool consolidate', or upload the DCP checkpoint directly")


def _shown(path: Path) -> str:
    """The user's own path for a link in the staging folder."""
    return os.path.realpath(path)


# ---------------------------------------------------------------------------------------------
# The source and the staging folder


def _open_source(path: str | os.PathLike[str], *, dtype: str | None,
                 max_shard_size: int | None, naming: bool = False) -> _Source:
    s = os.fspath(path)
    p = Path(s).expanduser().absolute()
    local = not is_url(s)
    if local and p.is_file():
        if p.suffix != ".safetensors":
            raise ConfigError(f"{p} is not a .safetensors file",
                              hint="Pass a .safetensors file, a folder of shards with its "
                                   "index, or a DCP checkpoint folder")
        src = _Source("safetensors", str(p), p.name)
    elif local and any((p / n).is_file() for n in (INDEX_NAME, SINGLE_NAME)):
        src = _Source("shards", str(p), p.name)
    else:
        return _open_checkpoint(s)
    if dtype is not None or max_shard_size is not None or naming:
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
    return _Source("dcp", ckpt.url, ckpt.name, base_model=base,
                   step=m.step if m is not None and m.step is not None else ckpt.step,
                   world_size=m.world_size if m is not None else None,
                   loss=m.loss if m is not None else None, train_config=config,
                   model_config=model_config if isinstance(model_config, dict) else None)


def _stage(src: _Source, stage: Path, *, dtype: str | None, max_shard_size: int | None,
           model_key: str | None, keep_wrappers: bool, progress: Progress | None) -> None:
    """Fill ``stage`` (absent) with the weights: an export, or links to the user's files."""
    if src.kind == "dcp":
        from ckptool.ops.consolidate import DEFAULT_MAX_SHARD, consolidate

        consolidate(src.path, stage, dtype=dtype, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD,
                    model_key=model_key, keep_wrappers=keep_wrappers, progress=progress)
        return
    stage.mkdir()
    if src.kind == "safetensors":
        os.symlink(src.path, stage / SINGLE_NAME)
        return
    folder = Path(src.path)
    if (folder / INDEX_NAME).is_file():
        names = [INDEX_NAME, *sorted(set(_read_index(folder / INDEX_NAME)[0].values()))]
    else:
        names = [SINGLE_NAME]
    names += [n for n in PASS_THROUGH if (folder / n).is_file()]
    for name in names:
        if not (folder / name).is_file():
            raise _bad(_shown(folder / INDEX_NAME), f"it names {name}, which does not exist")
        os.symlink(folder / name, stage / name)


def _with_file_provenance(src: _Source, stage: Path, weights: _Weights) -> _Source:
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
    name = src.name if src.kind == "dcp" else meta.get("source_checkpoint") or src.name
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


def _write_card(stage: Path, src: _Source, weights: _Weights, repo_id: str, subfolder: str) -> None:
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


# ---------------------------------------------------------------------------------------------
# The Hub


def _token(token: str | None, *, required: bool) -> str | None:
    from huggingface_hub import get_token

    found = token or get_token()
    if found is None and required:
        raise HubError(NOT_LOGGED_IN)
    return found


def _api(token: str | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(token=token, library_name="ckptool", library_version=__version__)


def _whoami(api: Any, token: str | None) -> str | None:
    with _hub_errors(api, token, "checking the token"):
        return api.whoami().get("name")


def _send(api: Any, token: str | None, repo_id: str, stage: Path, *, private: bool,
          revision: str | None, subfolder: str, message: str, create_pr: bool) -> dict[str, str | None]:
    with _hub_errors(api, token, f"creating {repo_id}", repo_id):
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
    repo_id = url.repo_id
    if revision not in (None, "main") and not create_pr:
        with _hub_errors(api, token, f"creating branch {revision!r} of {repo_id}", repo_id):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    with _hub_errors(api, token, f"uploading to {repo_id}", repo_id):
        info = api.upload_folder(repo_id=repo_id, folder_path=stage, path_in_repo=subfolder or None,
                                 commit_message=message, revision=revision, create_pr=create_pr)
    return {"repo_id": repo_id, "repo_url": str(url), "commit_url": info.commit_url,
            "pr_url": info.pr_url}


@contextlib.contextmanager
def _hub_errors(api: Any, token: str | None, doing: str, repo_id: str | None = None) -> Iterator[None]:
    """Turn the Hub's HTTP and network errors into one-line ``HubError``s without the token."""
    try:
        yield
    except Exception as e:
        err = _hub_error(e, doing, api.endpoint, repo_id)
        if err is None:
            raise
        if token:
            err = HubError(str(err).replace(token, "<token>"))
        raise err from e  # the cause shows with CKPTOOL_DEBUG=1; the CLI prints one line


def _hub_error(e: BaseException, doing: str, endpoint: str, repo_id: str | None) -> HubError | None:
    from huggingface_hub.utils import HfHubHTTPError

    where = f"the Hub at {endpoint}"
    for cause in _chain(e):
        if isinstance(cause, HfHubHTTPError) and getattr(cause, "response", None) is not None:
            return _http_error(cause, doing, where, repo_id)
        if isinstance(cause, _network_errors()):
            reason = " ".join(str(cause).split())[:160] or type(cause).__name__
            return HubError(f"cannot reach {where} while {doing} ({reason})",
                            hint=f"Check the network and HF_ENDPOINT. {RESUME_HINT}")
    if isinstance(e, ValueError) and "Invalid metadata in README.md" in str(e):
        return HubError(f"{where} refused the model card's metadata while {doing}: {e}")
    return None


def _http_error(e: Any, doing: str, where: str, repo_id: str | None) -> HubError:
    status = e.response.status_code
    said = " ".join(str(getattr(e, "server_message", "") or "").split())[:160].rstrip(".!")
    said = f": {said}" if said else ""
    if status == 401:
        return HubError(f"{where} did not accept the token (401) while {doing}",
                        hint="Run 'hf auth login' again, or pass a valid --token / HF_TOKEN")
    if status == 403:
        return HubError(f"{where} refused access to {repo_id or 'the repo'} (403) while {doing}"
                        f"{said}", hint="Check the namespace, and that the token has write "
                                        "access to it ('hf auth whoami' shows who you are)")
    if status == 404:
        return HubError(f"{repo_id or 'repository'} not found at {where} (404) while {doing}{said}",
                        hint="Check REPO_ID (namespace/name) and that the token can see it")
    return HubError(f"{where} answered {status} while {doing}{said}", hint=RESUME_HINT)


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of whichever HTTP client huggingface_hub uses (already imported)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        mod = sys.modules.get(module)
        types += [getattr(mod, n) for n in names if mod is not None and hasattr(mod, n)]
    return tuple(types)

"""Fetch a model's safetensors, index and asset files from the Hugging Face Hub (for import).

Owns what is downloaded and the mapping of Hub errors to one-line ``HubError``s. Only the
files ``import`` uses are fetched -- ``model.safetensors`` or the shards the index names, the
index, ``config.json``, ``generation_config.json`` and tokenizer files -- never ``*.bin``
pickles. All come from one commit (the revision is resolved to its sha first) into the usual
Hub cache (``HF_HOME``), so a second import is offline. ``huggingface_hub`` is imported lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptool.errors import CheckpointNotFoundError, CorruptCheckpointError, HubError
from ckptool.format.hf_source import ASSET_NAMES, INDEX_NAME, MAX_HEADER, SINGLE_NAME, refuse_pickles


def download(repo_id: str, revision: str | None = None) -> tuple[Path, dict[str, str], str]:
    """Download what ``import`` needs of Hub model ``repo_id`` at ``revision`` (default main).

    Args:
        repo_id: ``namespace/name``.
        revision: a branch, tag or commit sha.

    Returns:
        (snapshot folder, file name -> local path, commit sha).

    Raises:
        HubError: the repo or revision does not exist, access was refused, or the Hub could
            not be reached.
        CheckpointNotFoundError: the repo holds no safetensors weights.
        IncompatibleCheckpointError: it holds only pickle weights (``.bin``).

    Example:
        >>> root, files, sha = download("org/llama-tiny", "main")
    """
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    where = f"{repo_id}@{revision or 'main'}"
    with _errors(api.endpoint, where):
        info = api.model_info(repo_id, revision=revision)
        sha = info.sha or revision or "main"
        names = {s.rfilename for s in info.siblings or []}
        top = {n for n in names if "/" not in n}
        fetch = lambda name: hf_hub_download(repo_id, name, revision=sha)  # noqa: E731
        files: dict[str, str] = {}
        if INDEX_NAME in top:
            files[INDEX_NAME] = fetch(INDEX_NAME)
            wanted = sorted(_shards(files[INDEX_NAME], where) & names)
        elif SINGLE_NAME in top:
            wanted = [SINGLE_NAME]
        else:
            refuse_pickles(where, sorted(top))
            raise CheckpointNotFoundError(f"{where} holds no {SINGLE_NAME} and no {INDEX_NAME}",
                                          path=where, hint="Import a repo with safetensors weights")
        for name in wanted + sorted(top & set(ASSET_NAMES)):
            files[name] = fetch(name)
    root = Path(files[INDEX_NAME if INDEX_NAME in files else SINGLE_NAME]).parent
    return root, files, sha


def download_assets(repo_id: str, revision: str | None = None) -> Path:
    """Download only the asset files (config, generation config, tokenizer) of a Hub model,
    for ``consolidate --hf-assets org/name[@revision]``; no weights.

    Returns:
        The snapshot folder holding them.

    Raises:
        HubError: as ``download``; CheckpointNotFoundError: the repo has no ``config.json``.
    """
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    where = f"{repo_id}@{revision or 'main'}"
    with _errors(api.endpoint, where):
        info = api.model_info(repo_id, revision=revision)
        sha = info.sha or revision or "main"
        top = {s.rfilename for s in info.siblings or [] if "/" not in s.rfilename}
        if "config.json" not in top:
            raise CheckpointNotFoundError(f"{where} has no config.json", path=where,
                                          hint="Pass the repo of the model this checkpoint was "
                                               "trained from")
        paths = [hf_hub_download(repo_id, name, revision=sha)
                 for name in sorted(top & set(ASSET_NAMES))]
    return Path(paths[0]).parent


def _shards(index_path: str, where: str) -> set[str]:
    if os.path.getsize(index_path) > MAX_HEADER:
        raise CorruptCheckpointError(f"{where}: {INDEX_NAME} is implausibly large", path=where)
    try:
        wm = json.loads(Path(index_path).read_bytes()).get("weight_map")
        return {v for v in wm.values() if isinstance(v, str)}
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: {INDEX_NAME} has no weight_map ({e})",
                                     path=where) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import httpx

        types.append(httpx.TransportError)
    except ImportError:  # pragma: no cover - older clients use requests
        pass
    try:
        import requests

        types.append(requests.exceptions.ConnectionError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


class _errors:  # noqa: N801 - used like contextlib.contextmanager
    """Map the client's errors to one-line ``HubError``s (ckptool's own errors pass through)."""

    def __init__(self, endpoint: str, where: str) -> None:
        self.endpoint, self.where = endpoint, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: object, e: BaseException | None, tb: object) -> bool:
        if e is None or not isinstance(e, Exception):
            return False
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        at = f"the Hub at {self.endpoint}"
        if isinstance(e, GatedRepoError):
            err = HubError(f"{self.where} is gated on {at}", hint="Accept its terms on the Hub "
                           "and log in ('hf auth login') or set HF_TOKEN")
        elif isinstance(e, RepositoryNotFoundError):
            err = HubError(f"{self.where}: no such model repo on {at} (or it is private), and no "
                           "local folder of that name", hint="Check the path or repo id, or log "
                           "in ('hf auth login') for a private repo")
        elif isinstance(e, RevisionNotFoundError):
            err = HubError(f"{self.where}: no such revision on {at}",
                           hint="Check the branch, tag or commit after '@'")
        elif isinstance(e, HfHubHTTPError):
            status = e.response.status_code if getattr(e, "response", None) is not None else "?"
            err = HubError(f"{at} answered {status} while downloading {self.where}",
                           hint="Try again later")
        elif isinstance(e, (LocalEntryNotFoundError, *_network_errors())):
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            err = HubError(f"cannot download {self.where} from {at} ({reason})",
                           hint="Check the network and HF_ENDPOINT, or give a local folder")
        else:
            return False
        raise err from e

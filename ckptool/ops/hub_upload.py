"""The Hugging Face Hub calls of ``upload``, and their errors turned into one-line ``HubError``s.

Owns: finding the token (``token``, ``HF_TOKEN`` or ``hf auth login``'s file), the ``HfApi``
client, ``whoami``, ``create_repo(exist_ok=True)``, ``create_branch``, ``upload_folder``, and the
mapping of HTTP statuses and network errors to messages that never show the token. What is sent
(the staging folder) is ``upload.py``'s. huggingface_hub is imported lazily.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool._version import __version__
from ckptool.errors import HubError

NOT_LOGGED_IN = "Not logged in. Run 'hf auth login' or pass --token / set HF_TOKEN"
RESUME_HINT = ("Re-run the same command to resume: files the Hub already has are not sent "
               "again")


@dataclass(frozen=True)
class HubSession:
    """A checked token and the client made with it (the token never leaves this object)."""

    api: Any
    token: str | None
    user: str | None


def login(token: str | None) -> HubSession:
    """The session of ``token`` (default ``HF_TOKEN`` or ``hf auth login``'s), checked by ``whoami``.

    Raises:
        HubError: no token, or the Hub refused it or could not be reached.
    """
    from huggingface_hub import HfApi, get_token

    found = token or get_token()
    if found is None:
        raise HubError(NOT_LOGGED_IN)
    api = HfApi(token=found, library_name="ckptool", library_version=__version__)
    with _hub_errors(api, found, "checking the token"):
        user = api.whoami().get("name")
    return HubSession(api, found, user)


def send_folder(hub: HubSession, repo_id: str, stage: Path, *, private: bool, revision: str | None,
                subfolder: str, message: str, create_pr: bool) -> dict[str, str | None]:
    """Create the repo (and branch) if missing and commit ``stage``; the Hub's URLs by name."""
    api, token = hub.api, hub.token
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
        err = hub_error(e, doing, api.endpoint, repo_id)
        if err is None:
            raise
        if token:
            err = HubError(str(err).replace(token, "<token>"))
        raise err from e  # the cause shows with CKPTOOL_DEBUG=1; the CLI prints one line


def hub_error(e: BaseException, doing: str, endpoint: str, repo_id: str | None) -> HubError | None:
    """The one-line error for an HTTP or network failure anywhere in ``e``'s causes, else None."""
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

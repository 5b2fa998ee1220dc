"""A local stand-in for the Hugging Face Hub, for testing ``ckptool upload`` with the real client.

``HubServer`` is a ``ThreadingHTTPServer`` on 127.0.0.1 (port 0) in a daemon thread. It serves
the endpoints that ``huggingface_hub`` 2.x calls for ``whoami``, ``create_repo``,
``create_branch`` and ``upload_folder`` on the LFS path (``HF_HUB_DISABLE_XET=1``; the Xet path
needs the real Hub's storage):

    GET  /api/agent-harnesses                              the client's (best-effort) user-agent
                                                           registry, fetched once a day
    GET  /api/whoami-v2                                    who the bearer token belongs to
    POST /api/repos/create                                 {"name", "organization", "visibility"}
    GET  /api/models/NS/NAME[/revision/REV]                repo info (used by create_repo on 403
                                                           and for a commit that changes nothing)
    GET  /api/models/NS/NAME/refs                          branches (create_branch on 403)
    POST /api/models/NS/NAME/branch/BRANCH                 create a branch from main
    POST /api/validate-yaml                                the README.md metadata block
    POST /api/models/NS/NAME/preupload/REV                 upload mode (lfs / regular) + remote oid
    POST /NS/NAME.git/info/lfs/objects/batch               git-lfs batch: upload hrefs point back
                                                           here; objects already stored get none
    PUT  /lfs-upload/OID                                   the object's bytes (sha256 checked)
    POST /NS/NAME.git/info/lfs/objects/verify              after each upload
    POST /api/models/NS/NAME/commit/REV                    NDJSON: header, file, lfsFile, deleted*

and, for ``hf_hub_download`` (``ckptool import`` of a repo id), with REV a branch or the
commit sha of a branch head:

    HEAD /NS/NAME/resolve/REV/PATH                         X-Repo-Commit, ETag (sha256 of an
                                                           LFS file, git blob sha1 otherwise),
                                                           Content-Length
    GET  /NS/NAME/resolve/REV/PATH                         the same headers and the bytes

``put_files`` stores files on a branch directly (a new head commit), for download tests.

Everything received is kept (``repos``, ``lfs``, ``requests``, ``puts``) so tests can compare
bytes. Failures of LFS uploads are injected with ``fail_put``. Any other path answers 404
and is recorded in ``unknown``, so a client version that calls something new shows up in tests.
The server shuts itself down after ``max_seconds`` even if a test forgets to stop it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".distcp")
LFS_THRESHOLD = 10 * 2**20


@dataclass
class Repo:
    owner: str
    private: bool
    branches: dict[str, dict[str, tuple[str, Any]]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict[str, Any]] = field(default_factory=list)
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """A fake Hub. Use as a context manager; ``url`` is the value for ``HF_ENDPOINT``.

    Attributes:
        tokens: token -> user name; ``orgs``: user -> organisations they may write to.
        repos: repo id -> ``Repo`` (files per branch: path -> ("lfs", oid) | ("regular", bytes)).
        lfs: oid -> bytes of every LFS object received.
        requests: ("METHOD", path) of every request, in arrival order.
        puts: (oid, outcome) of every LFS PUT: "ok", "500", "drop" or "bad-sha".
        unknown: requests to paths this server does not implement.
        fail_put: oid -> [mode, times]: answer the next ``times`` PUTs of that object with
            ``mode`` ("500" or "drop"); ``times`` None means every time.
    """

    def __init__(self, *, tokens: dict[str, str] | None = None, max_seconds: float = 120) -> None:
        self.tokens = tokens if tokens is not None else {"hf_test_token_0123456789": "alice"}
        self.orgs: dict[str, set[str]] = {}
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.puts: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        self.fail_put: dict[str, list[Any]] = {}
        self.lock = threading.Lock()
        self._max_seconds = max_seconds
        self._httpd: ThreadingHTTPServer | None = None
        self._timer: threading.Timer | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> HubServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        self._timer = threading.Timer(self._max_seconds, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if self._timer is not None:
            self._timer.cancel()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # -- helpers for tests ----------------------------------------------------------------------
    def create(self, repo_id: str, *, owner: str = "alice", private: bool = False) -> Repo:
        with self.lock:
            return self.repos.setdefault(repo_id, Repo(owner, private))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Path -> bytes of every file on a branch (LFS pointers resolved)."""
        branch = self.repos[repo_id].branches[revision]
        return {p: (self.lfs[v] if kind == "lfs" else v) for p, (kind, v) in branch.items()}

    def put_files(self, repo_id: str, files: dict[str, bytes], *, revision: str = "main",
                  owner: str = "alice") -> str:
        """Commit ``files`` (path -> bytes) onto a branch directly; returns the new head sha.
        ``.safetensors`` (and other LFS-suffixed) files are stored as LFS objects."""
        repo = self.create(repo_id, owner=owner)
        with self.lock:
            branch = repo.branches.setdefault(revision, {})
            for path, data in files.items():
                if path.endswith(LFS_SUFFIXES):
                    oid = hashlib.sha256(data).hexdigest()
                    self.lfs[oid] = data
                    branch[path] = ("lfs", oid)
                else:
                    branch[path] = ("regular", data)
            oid = hashlib.sha1(f"{repo_id}{revision}{len(repo.commits)}".encode()).hexdigest()
            repo.heads[revision] = oid
            repo.commits.append({"oid": oid, "revision": revision, "summary": "put_files",
                                 "operations": [("file", p) for p in files]})
        return oid

    def put_count(self, oid: str, outcome: str | None = None) -> int:
        return sum(1 for o, out in self.puts if o == oid and (outcome is None or out == outcome))

    def user_of(self, auth: str | None) -> str | None:
        if not auth or not auth.startswith("Bearer "):
            return None
        return self.tokens.get(auth[len("Bearer "):])

    def may_write(self, user: str | None, repo_id: str) -> bool:
        ns = repo_id.split("/")[0]
        return user is not None and (ns == user or ns in self.orgs.get(user, set()))


class _Reply(Exception):
    """Raised by a route to answer with an error status."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_ROUTES = [
    ("GET", r"/api/agent-harnesses", "agent_harnesses"),
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"/api/models/{_REPO}/refs", "refs"),
    ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("POST", rf"/api/models/{_REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/verify", "lfs_verify"),
    ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs_put"),
    ("HEAD", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("GET", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # a stuck client cannot hold a server thread for long

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    # -- plumbing -------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        self.query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self.hub.lock:
            self.hub.requests.append((method, parts.path))
        for m, pattern, name in _ROUTES:
            match = re.fullmatch(pattern, parts.path) if m == method else None
            if match:
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                try:
                    getattr(self, name)(**args)
                except _Reply as r:
                    self._error(r)
                return
        self._body()
        with self.hub.lock:
            self.hub.unknown.append((method, parts.path))
        self._error(_Reply(404, f"not implemented by the test server: {method} {parts.path}"))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                out += self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    return bytes(out)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json_body(self) -> Any:
        return json.loads(self._body() or b"{}")

    def _send(self, status: int, obj: Any, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, r: _Reply) -> None:
        headers = {"X-Error-Message": r.message}
        if r.code:
            headers["X-Error-Code"] = r.code
        if r.status >= 500:
            headers["Retry-After"] = "0"  # keeps the client's retries short in tests
        self._send(r.status, {"error": r.message, **r.extra}, headers)

    def _user(self, *, required: bool = True) -> str | None:
        user = self.hub.user_of(self.headers.get("Authorization"))
        if user is None and required:
            raise _Reply(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_id: str, *, write: bool) -> Repo:
        """The repo, as the Hub shows it: missing or private-and-not-yours reads as 404."""
        user = self._user(required=write)
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self.hub.may_write(user, repo_id)):
            raise _Reply(404, "Repository not found", "RepoNotFound")
        if write and not self.hub.may_write(user, repo_id):
            raise _Reply(403, f"You don't have write access to {repo_id}")
        return repo

    def _branch(self, repo: Repo, rev: str) -> dict[str, tuple[str, Any]]:
        rev = next((b for b, h in repo.heads.items() if h == rev and b in repo.branches), rev)
        if rev not in repo.branches:
            raise _Reply(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.branches[rev]

    # -- Hub API ----------------------------------------------------------------------------------
    def agent_harnesses(self) -> None:
        self._send(200, {"standardEnvVars": [], "harnesses": {}})

    def whoami(self) -> None:
        user = self._user()
        self._send(200, {"type": "user", "name": user, "fullname": user.title(),
                         "orgs": [{"name": o} for o in sorted(self.hub.orgs.get(user, ()))],
                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def create_repo(self) -> None:
        body = self._json_body()
        user = self._user()
        repo_id = f"{body.get('organization') or user}/{body['name']}"
        if not self.hub.may_write(user, repo_id):
            raise _Reply(403, f"You don't have the rights to create a model under the namespace "
                         f"{repo_id.split('/')[0]!r}")
        with self.hub.lock:
            if repo_id in self.hub.repos:
                # The Hub's 409 carries the url: create_repo(exist_ok=True) returns it.
                raise _Reply(409, "You already created this model repo",
                             url=f"{self.hub.url}/{repo_id}")
            self.hub.repos[repo_id] = Repo(user, body.get("visibility") == "private")
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def repo_info(self, repo: str, rev: str = "main") -> None:
        r = self._repo(repo, write=False)
        branch = self._branch(r, rev)
        sha = r.heads.get(rev) or rev  # a branch name, or already a head's sha
        self._send(200, {"id": repo, "modelId": repo, "author": r.owner, "sha": sha,
                         "private": r.private, "siblings": [
                             {"rfilename": p} for p in sorted(branch)]})

    def resolve(self, repo: str, rev: str, path: str) -> None:
        r = self._repo(repo, write=False)
        branch = self._branch(r, rev)
        if path not in branch:
            raise _Reply(404, f"{path} does not exist at {rev}", "EntryNotFound")
        kind, value = branch[path]
        data = self.hub.lfs[value] if kind == "lfs" else value
        etag = value if kind == "lfs" else git_blob_sha1(value)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", r.heads.get(rev) or rev)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def refs(self, repo: str) -> None:
        r = self._repo(repo, write=False)
        self._send(200, {"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": h}
                                      for b, h in r.heads.items() if not b.startswith("refs/")],
                         "tags": [], "converts": []})

    def create_branch(self, repo: str, rev: str) -> None:
        self._json_body()
        r = self._repo(repo, write=True)
        with self.hub.lock:
            if rev in r.branches:
                raise _Reply(409, f"Reference refs/heads/{rev} already exists")
            r.branches[rev] = dict(r.branches["main"])
            r.heads[rev] = r.heads["main"]
        self._send(200, {})

    def validate_yaml(self) -> None:
        content = self._json_body().get("content", "")
        m = re.match(r"\A---\n(.*?)\n---\n", content, re.S)
        errors = []
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
            if not isinstance(meta, dict):
                errors.append({"message": "metadata is not a mapping"})
        except yaml.YAMLError as e:
            errors.append({"message": f"invalid YAML: {e}"})
        self._send(400 if errors else 200, {"errors": errors, "warnings": []})

    def preupload(self, repo: str, rev: str) -> None:
        files = self._json_body()["files"]
        r = self._repo(repo, write=True)
        branch = self._branch(r, "main" if self.query.get("create_pr") else rev)
        out = []
        for f in files:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_THRESHOLD
            entry = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                     "shouldIgnore": False}
            if f["path"] in branch:
                kind, value = branch[f["path"]]
                entry["oid"] = value if kind == "lfs" else git_blob_sha1(value)
            out.append(entry)
        self._send(200, {"files": out, "commitOid": r.heads["main"]})

    def commit(self, repo: str, rev: str) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        r = self._repo(repo, write=True)
        with self.hub.lock:
            if self.query.get("create_pr"):
                rev = f"refs/pr/{sum(b.startswith('refs/pr/') for b in r.branches) + 1}"
                r.branches[rev] = dict(r.branches["main"])
                r.heads[rev] = r.heads["main"]
            branch = dict(self._branch(r, rev))
            for item in lines[1:]:
                self._apply(branch, item["key"], item["value"])
            oid = hashlib.sha1(f"{repo}{rev}{len(r.commits)}".encode()).hexdigest()
            r.branches[rev], r.heads[rev] = branch, oid
            r.commits.append({"oid": oid, "revision": rev, "summary": lines[0]["value"]["summary"],
                              "operations": [(i["key"], i["value"]["path"]) for i in lines[1:]]})
        pr = f"{self.hub.url}/{repo}/discussions/{rev.rsplit('/', 1)[-1]}" \
            if rev.startswith("refs/pr/") else None
        self._send(200, {"success": True, "commitOid": oid, "pullRequestUrl": pr,
                         "commitUrl": f"{self.hub.url}/{repo}/commit/{oid}"})

    def _apply(self, branch: dict[str, tuple[str, Any]], key: str, value: dict[str, Any]) -> None:
        path = value["path"]
        if key == "file":
            branch[path] = ("regular", base64.b64decode(value["content"]))
        elif key == "lfsFile":
            if value["oid"] not in self.hub.lfs:
                raise _Reply(422, f"LFS object {value['oid']} for {path} was never uploaded")
            branch[path] = ("lfs", value["oid"])
        elif key == "deletedFile":
            branch.pop(path, None)
        elif key == "deletedFolder":
            for p in [p for p in branch if p.startswith(path.rstrip("/") + "/")]:
                del branch[p]
        else:
            raise _Reply(400, f"unknown commit operation {key!r}")

    # -- git-lfs ------------------------------------------------------------------------------------
    def lfs_batch(self, repo: str) -> None:
        body = self._json_body()
        self._repo(repo, write=True)
        objects = []
        for o in body["objects"]:
            stored = self.hub.lfs.get(o["oid"])
            entry = {"oid": o["oid"], "size": o["size"]}
            if stored is None or len(stored) != o["size"]:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{o['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/{repo}.git/info/lfs/objects/verify"},
                }
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects},
                   content_type="application/vnd.git-lfs+json")

    def lfs_put(self, oid: str) -> None:
        with self.hub.lock:
            rule = self.hub.fail_put.get(oid)
            mode = rule[0] if rule and (rule[1] is None or rule[1] > 0) else None
            if mode and rule[1] is not None:
                rule[1] -= 1
        if mode == "drop":
            self.rfile.read(max(1, int(self.headers.get("Content-Length") or 2) // 2))
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            self.hub.puts.append((oid, "drop"))
            return
        data = self._body()
        if mode == "500":
            self.hub.puts.append((oid, "500"))
            raise _Reply(500, "Internal Error - We're working hard to fix this as soon as possible!")
        if hashlib.sha256(data).hexdigest() != oid:
            self.hub.puts.append((oid, "bad-sha"))
            raise _Reply(400, "content does not match its sha256")
        with self.hub.lock:
            self.hub.lfs[oid] = data
            self.hub.puts.append((oid, "ok"))
        self._send(200, {})

    def lfs_verify(self, repo: str) -> None:
        body = self._json_body()
        self._repo(repo, write=True)
        stored = self.hub.lfs.get(body["oid"])
        if stored is None or len(stored) != body["size"]:
            raise _Reply(404, f"object {body['oid']} not found")
        self._send(200, {})

"""A fake Hugging Face Hub: the few endpoints ``HfFileSystem`` and ranged downloads use.

Serves model repos held in memory (``add_commit``), each commit a mapping path -> bytes, with
branches/tags pointing at commits:

* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}``: repo info with ``sha``;
* ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``?recursive=true`` lists below too);
* ``POST /api/models/{repo}/paths-info/{rev}`` (form field ``paths``, repeated);
* ``GET|HEAD /{repo}/resolve/{rev}/{path}``: the file, ``Range`` honoured (206, 416), headers
  ``X-Repo-Commit``, ``ETag``, ``Content-Length``, ``Accept-Ranges``.

Errors are 404 with ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound``. Requests,
faults and ``ignore_range`` work as in :class:`~tests.support.servers.range_server.RangeServer`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, unquote

from tests.support.servers.range_server import Error, RangeServer, Resource

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_API = re.compile(rf"^/api/models/{_REPO}(?:/(?P<op>revision|tree|paths-info)/(?P<rest>.+))?$")
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rest>.+)$")


def _json(value: object) -> Resource:
    return Resource(json.dumps(value).encode(), content_type="application/json")


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class FakeHub(RangeServer):
    """In-memory model repos behind the Hub's HTTP API, on 127.0.0.1."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict]] = {}
        super().__init__()

    def add_commit(
        self, repo_id: str, files: Mapping[str, bytes | Path], *, refs: tuple[str, ...] = ("main",)
    ) -> str:
        """A new commit of ``files`` (bytes, or a local file/directory to copy) in ``repo_id``; its sha."""
        content: dict[str, bytes] = {}
        for name, value in files.items():
            if isinstance(value, Path) and value.is_dir():
                for file in sorted(p for p in value.rglob("*") if p.is_file()):
                    content[f"{name}/{file.relative_to(value)}".lstrip("/")] = file.read_bytes()
            else:
                content[name] = value.read_bytes() if isinstance(value, Path) else value
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        sha = hashlib.sha1(f"{repo_id}:{len(repo['commits'])}:{sorted(content)}".encode()).hexdigest()
        repo["commits"][sha] = content
        for ref in refs:
            repo["refs"][ref] = sha
        return sha

    # -- helpers ---------------------------------------------------------------------------------

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | Error:
        repo = self.repos.get(repo_id)
        if repo is None:
            return Error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
        sha = repo["refs"].get(revision, revision)
        if sha not in repo["commits"]:
            return Error(404, f"Invalid rev id: {revision}", {"X-Error-Code": "RevisionNotFound"})
        return sha, repo["commits"][sha]

    @staticmethod
    def _entries(files: Mapping[str, bytes], folder: str, recursive: bool) -> list[dict]:
        prefix = f"{folder}/" if folder else ""
        out: dict[str, dict] = {}
        for name, data in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts)):
                sub = prefix + "/".join(parts[:depth])
                if depth == 1 or recursive:
                    out.setdefault(sub, {"type": "directory", "oid": _oid(sub.encode()), "size": 0, "path": sub})
            if len(parts) == 1 or recursive:
                out[name] = {"type": "file", "oid": _oid(data), "size": len(data), "path": name}
        return list(out.values())

    @staticmethod
    def _split_revision(rest: str) -> tuple[str, str]:
        """``rev[/path]`` with a revision that may be ``refs/pr/N`` or percent-encoded."""
        rest = unquote(rest)
        m = re.match(r"^(refs/(?:pr|convert)/[^/]+)(?:/(.*))?$", rest)
        if m:
            return m.group(1), m.group(2) or ""
        revision, _, path = rest.partition("/")
        return revision, path

    # -- routes ----------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: str, body: bytes) -> Resource | Error:
        m = _API.match(path)
        if m:
            return self._api(method, m.group("repo"), m.group("op"), m.group("rest"), query, body)
        m = _RESOLVE.match(path)
        if m and method in ("GET", "HEAD"):
            revision, file = self._split_revision(m.group("rest"))
            found = self._commit(m.group("repo"), revision)
            if isinstance(found, Error):
                return found
            sha, files = found
            if file not in files:
                return Error(404, "Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
            data = files[file]
            return Resource(data, {"X-Repo-Commit": sha, "ETag": f'"{_oid(data)}"'})
        return Error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})

    def _api(self, method: str, repo_id: str, op: str | None, rest: str | None, query: str, body: bytes):
        revision, sub = self._split_revision(rest) if rest else ("main", "")
        found = self._commit(repo_id, revision)
        if isinstance(found, Error):
            return found
        sha, files = found
        if op in (None, "revision") and method == "GET":
            return _json({
                "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                "siblings": [{"rfilename": name} for name in sorted(files)],
            })
        if op == "tree" and method == "GET":
            recursive = parse_qs(query).get("recursive", ["false"])[0].lower() == "true"
            sub = sub.strip("/")
            if sub and sub in files:
                return Error(404, "not a directory", {"X-Error-Code": "EntryNotFound"})
            if sub and not any(name.startswith(f"{sub}/") for name in files):
                return Error(404, "Entry not found", {"X-Error-Code": "EntryNotFound"})
            return _json(self._entries(files, sub, recursive))
        if op == "paths-info" and method == "POST":
            form = parse_qs(body.decode())
            wanted = form.get("paths", [])
            if not wanted and body.startswith(b"{"):
                wanted = json.loads(body).get("paths", [])
            out = []
            for name in wanted:
                name = name.strip("/")
                if name in files:
                    out.append({"type": "file", "oid": _oid(files[name]), "size": len(files[name]), "path": name})
                elif any(f.startswith(f"{name}/") for f in files):
                    out.append({"type": "directory", "oid": _oid(name.encode()), "size": 0, "path": name})
            return _json(out)
        return Error(405, "method not allowed")

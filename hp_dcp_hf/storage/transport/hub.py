"""Checkpoints in Hugging Face Hub repos: ``hf://[datasets/|spaces/]org/repo[@rev][/subdir]`` or a
bare ``org/repo[@rev]``.

Metadata goes through ``HfFileSystem`` (options: ``endpoint``, ``token``, ``revision``, others to
``HfFileSystem``); the revision is resolved to its commit when the checkpoint is located, so the
root every rank reads from (broadcast by rank 0 with the headers) names the commit, never a branch
that could move. Data reads are ranged ``GET``\\ s of ``{endpoint}/{repo}/resolve/{commit}/{file}``
through the same :class:`~hp_dcp_hf.storage.transport.http_client.HttpClient` as plain HTTP(S), so
ranks other than the one reading the headers send no metadata request at all. A file's version is
its commit, which every ranged answer carries back as ``X-Repo-Commit``.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.transport.backend import (
    Backend,
    FileVersion,
    FirstAnswer,
    RangeFile,
    RetryPolicy,
    UnreachableError,
)
from hp_dcp_hf.storage.transport.http_client import (
    HttpClient,
    HttpRangeFile,
    http_error_is_transient,
    unanswered,
)
from hp_dcp_hf.storage.transport.options import check_storage_options

T = TypeVar("T")

_HUB_PINNED = re.compile(
    r"^(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/@]+/[^/@]+)@(?P<sha>[0-9a-f]{40})(?:/(?P<path>.*))?$"
)
_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}


def _hub_error_is_transient(error: BaseException) -> bool:
    """A failure of the Hub's own client (httpx) or of ours (requests) worth a new try."""
    response = getattr(error, "response", None)
    code = getattr(response, "status_code", None)
    if code is not None:
        return code in (408, 425, 429) or (500 <= code < 600 and code not in (501, 505))
    transport = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            transport.append(__import__(module).TransportError)
    return isinstance(error, tuple(transport)) or http_error_is_transient(error)


_no_answer = unanswered(_hub_error_is_transient)
"""``error`` is a transport failure of the Hub's client, with no HTTP answer behind it."""


class HubBackend(Backend):
    """Checkpoints in Hugging Face Hub repos, pinned to a commit when located.

    Options: ``endpoint`` (default ``HF_ENDPOINT`` or huggingface.co), ``token`` (default: the
    saved login; ``False`` sends none), ``revision`` (instead of ``@rev`` in the path), and any
    other ``HfFileSystem`` argument.
    """

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        fs: AbstractFileSystem | None = None,
        *,
        revision: str | None = None,
        hint: str = "",
        **options: Any,
    ) -> None:
        from huggingface_hub import HfFileSystem

        if fs is None:
            check_storage_options(None, options, "hub")
        self.fs = fs if fs is not None else HfFileSystem(**options)
        self.revision = revision
        self.hint = hint
        self.retry = retry or RetryPolicy()
        self.first_answer = FirstAnswer(
            _no_answer, self.fs.endpoint, "check the endpoint (storage option endpoint= or HF_ENDPOINT)"
        )
        self._client: HttpClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HubBackend({self.fs.endpoint})"

    def url(self, path: str) -> str:
        """``hf://`` and the path, as ``hf://org/repo@rev/file`` is passed (a bare ``org/repo`` too)."""
        return f"hf://{path}"

    # metadata (the rank that reads headers) -------------------------------------------------

    def _check_online(self, path: str) -> None:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise CheckpointNotFoundError(
                f"HF_HUB_OFFLINE is set, so Hub checkpoints cannot be read; unset it, or pass a local copy{self.hint}",
                file=self.url(path),
            )

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        self._check_online(path)
        try:
            return self.first_answer.run(
                self.retry, fn, what=what, file=self.url(path), is_transient=_hub_error_is_transient
            )
        except UnreachableError as e:
            raise UnreachableError(f"the Hub could not be reached at {self.fs.endpoint}: {e.reason}", file=e.file) from e
        except StorageReadError as e:
            if not _no_answer(e.__cause__):
                raise
            reason = f"the Hub could not be reached at {self.fs.endpoint}: {e.reason}"
            raise UnreachableError(reason, file=e.file) from e
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"not found on the Hub ({self.fs.endpoint}): {e}{self.hint}", file=self.url(path)
            ) from e
        except HPDCPHFError:
            raise
        except Exception as e:
            code = getattr(getattr(e, "response", None), "status_code", None)
            if code in (404, 410) or isinstance(e, ValueError) or type(e).__name__ in (
                "RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"
            ):
                raise CheckpointNotFoundError(
                    f"not found on the Hub ({self.fs.endpoint}): {e}{self.hint}", file=self.url(path)
                ) from e
            raise StorageReadError(f"{what} failed: {type(e).__name__}: {e}", file=self.url(path)) from e

    def locate(self, path: str) -> tuple[str, str | None]:
        from huggingface_hub import HfApi

        resolved = self._call("resolve", path, lambda: self.fs.resolve_path(path, revision=self.revision))
        if not hasattr(resolved, "repo_id"):
            raise CheckpointNotFoundError(
                "Hub buckets are not checkpoint repos; use hf://org/repo", file=self.url(path)
            )
        api = HfApi(endpoint=self.fs.endpoint, token=self.fs.token)
        info = self._call(
            "resolve revision",
            path,
            lambda: api.repo_info(resolved.repo_id, repo_type=resolved.repo_type, revision=resolved.revision),
        )
        if not info.sha:
            raise StorageReadError(
                f"the Hub gave no commit for revision {resolved.revision!r}", file=self.url(path)
            )
        prefix = {"dataset": "datasets/", "space": "spaces/"}.get(resolved.repo_type, "")
        pinned = f"{prefix}{resolved.repo_id}@{info.sha}"
        sub = resolved.path_in_repo.strip("/")
        if not sub:
            return pinned, None
        full = f"{pinned}/{sub}"
        kind = self._kind(full)
        if kind == "file":
            parent, _, name = full.rpartition("/")
            return parent, name
        if kind == "directory":
            return full, None
        raise CheckpointNotFoundError(
            f"no such file or directory in {resolved.repo_id}@{resolved.revision} ({info.sha})",
            file=self.url(path),
        )

    def _kind(self, path: str) -> str | None:
        def info() -> str | None:
            try:
                return self.fs.info(path)["type"]
            except FileNotFoundError:
                return None

        return self._call("info", path, info)

    def isfile(self, path: str) -> bool:
        return self._kind(path) == "file"

    def isdir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    def size(self, path: str) -> int:
        def size() -> int:
            info = self.fs.info(path)
            if info["type"] != "file":
                raise FileNotFoundError(f"{path} is a directory")
            return int(info["size"])

        self._check_online(path)
        try:
            return self.retry.run(
                size, what="size", file=self.url(path), is_transient=_hub_error_is_transient
            )
        except FileNotFoundError:
            raise
        except HPDCPHFError:
            raise
        except Exception as e:
            raise StorageReadError(f"size failed: {type(e).__name__}: {e}", file=self.url(path)) from e

    def stat(self, path: str) -> FileVersion:
        """The size, and the commit of the pinned root as the version (the Hub sends it back as
        ``X-Repo-Commit``)."""
        m = _HUB_PINNED.match(path)
        return FileVersion(self.size(path), m.group("sha") if m else None)

    def list_files(self, root: str) -> list[str]:
        entries = self._call("list", root, lambda: self.fs.ls(root, detail=True))
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    # data (every rank, no I/O until read) -----------------------------------------------------

    def resolve_url(self, path: str) -> str:
        """The ``resolve`` URL of a file under a pinned root."""
        from huggingface_hub import hf_hub_url

        m = _HUB_PINNED.match(path)
        if m is None or not m.group("path"):
            raise CheckpointNotFoundError(
                "not a file of a Hub commit (org/repo@<40-hex sha>/file); locate() pins the root first",
                file=self.url(path),
            )
        return hf_hub_url(
            m.group("repo"),
            m.group("path"),
            repo_type=_REPO_TYPES.get(m.group("type") or ""),
            revision=m.group("sha"),
            endpoint=self.fs.endpoint,
        )

    def _http(self) -> HttpClient:
        with self._lock:
            if self._client is None:
                from huggingface_hub.utils import build_hf_headers

                headers = build_hf_headers(token=self.fs.token)
                headers.pop("user-agent", None)
                headers.pop("User-Agent", None)
                self._client = HttpClient(self.retry, headers)
            return self._client

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        self._check_online(path)
        return HttpRangeFile(file, self.resolve_url(path), self._http(), expected, tag_header="X-Repo-Commit")

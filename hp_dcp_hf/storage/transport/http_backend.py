"""Checkpoints behind plain ``http(s)://`` URLs: a web server that honours ``Range``.

A directory URL must serve ``model.safetensors.index.json`` (a web server cannot be listed), or
the URL names one ``.safetensors`` file. Metadata is one ``HEAD`` per file per load (its size and
``ETag``), data reads are ranged ``GET``\\ s through the shared
:class:`~hp_dcp_hf.storage.transport.http_client.HttpClient`. Options: ``headers``, ``verify``,
``cert``, ``proxies`` (as ``requests`` takes them).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlsplit

from hp_dcp_hf.errors import CheckpointNotFoundError
from hp_dcp_hf.storage.transport.backend import Backend, FileVersion, RangeFile, RetryPolicy
from hp_dcp_hf.storage.transport.http_client import HttpClient, HttpRangeFile
from hp_dcp_hf.storage.transport.options import check_storage_options

INDEX_FILE = "model.safetensors.index.json"  # catalog.INDEX_FILE; the catalog is a layer above transport
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".json")

class HttpBackend(Backend):
    """Checkpoints behind ``http(s)://`` URLs: the index names the files, reads are ranged GETs."""

    def __init__(self, retry: RetryPolicy | None = None, **options: Any) -> None:
        check_storage_options(None, options, "http")  # filesystem() checked them naming the URL; here for direct use
        session_options = {k: options[k] for k in ("verify", "cert", "proxies") if k in options}
        self.client = HttpClient(retry or RetryPolicy(), options.get("headers"), session_options)
        # url -> size and ETag (None: absent), since the last locate()
        self._probed: dict[str, FileVersion | None] = {}

    def _probe(self, url: str) -> FileVersion | None:
        """One HEAD per file per load: ``exists``, ``size`` and ``stat`` of a file ask the server once."""
        if url not in self._probed:
            self._probed[url] = self.client.probe_version(url, url)
        return self._probed[url]

    def __repr__(self) -> str:
        return "HttpBackend()"

    def join(self, root: str, file: str) -> str:
        return f"{root.rstrip('/')}/{quote(file, safe='/')}"

    def locate(self, path: str) -> tuple[str, str | None]:
        self._probed.clear()  # a new load: sizes are asked again
        parts = urlsplit(path)
        if parts.query or parts.fragment:
            raise CheckpointNotFoundError(
                "http(s) checkpoint URLs cannot carry a query or fragment (file URLs are built from the "
                "directory URL and the index's file names)",
                file=path,
            )
        url = path.rstrip("/")
        name = parts.path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(_FILE_SUFFIXES):
            return url.rsplit("/", 1)[0], name
        return url, None  # a directory: the catalog reads its index (there is no listing)

    def isfile(self, path: str) -> bool:
        return self._probe(path) is not None

    def isdir(self, path: str) -> bool:
        return not path.rstrip("/").endswith(_FILE_SUFFIXES)

    def size(self, path: str) -> int:
        return self.stat(path).size

    def stat(self, path: str) -> FileVersion:
        version = self._probe(path)
        if version is None:
            raise FileNotFoundError(path)
        return version

    def list_files(self, root: str) -> list[str]:
        if self.isfile(self.join(root, INDEX_FILE)):
            return [INDEX_FILE]
        raise CheckpointNotFoundError(
            f"no {INDEX_FILE} here: an http(s) directory cannot be listed, so it must serve its index "
            "(or pass the URL of a single .safetensors file)",
            file=self.join(root, INDEX_FILE),
        )

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        return HttpRangeFile(file, path, self.client, expected)

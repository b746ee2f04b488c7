"""A real S3 API server for tests: moto's ``ThreadedMotoServer`` on 127.0.0.1, with its recorder.

``MotoS3`` starts the server in this process (a thread; stop it with :meth:`MotoS3.stop`), creates
buckets and uploads directories through boto3, and reads back moto's request recording
(``/moto-api/recorder/...``): every request with its method, path, ``Range`` and ``User-Agent``.
The recording goes to a file of our choosing, never the working directory. Every request also
passes :attr:`MotoS3.in_flight` (how many are answered at once, and the most since its reset) and
waits :attr:`MotoS3.latency_s` first when it carries a ``Range`` (a store's round trip).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.support.servers.range_server import InFlight

CREDENTIALS = {"key": "testing", "secret": "testing"}
REGION = "us-east-1"
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: str
    range: str | None
    user_agent: str

    @property
    def nbytes(self) -> int | None:
        """Bytes a ``bytes=a-b`` range asks for (``None`` for other requests)."""
        m = _RANGE.match(self.range or "")
        return int(m.group(2)) - int(m.group(1)) + 1 if m else None


BUCKET = "checkpoints"
"""The bucket of the ``moto`` fixture (``tests/conftest.py``)."""


class MotoS3:
    """moto's S3 server on a free port of 127.0.0.1, recording to ``recording_file``."""

    def __init__(self, recording_file: str | Path) -> None:
        os.environ["MOTO_RECORDER_FILEPATH"] = str(recording_file)
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        import moto.moto_api
        from moto.server import ThreadedMotoServer

        moto.moto_api.recorder._location = str(recording_file)  # in case moto was imported before
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.in_flight = InFlight()
        self.latency_s = 0.0
        wsgi = self._server._server  # werkzeug's server: wrap its app to count and delay requests
        wsgi.app = self._observed(wsgi.app)
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self._client = None

    def stop(self) -> None:
        self._server.stop()

    def _observed(self, app: Any) -> Any:
        def observed(environ: dict[str, Any], start_response: Any) -> Any:
            with self.in_flight:
                if environ.get("HTTP_RANGE") and self.latency_s:
                    time.sleep(self.latency_s)
                return app(environ, start_response)

        return observed

    def storage_options(self, **config: Any) -> dict[str, Any]:
        """s3fs options for this server; ``config`` goes to botocore's ``Config`` (``config_kwargs``)."""
        return {
            **CREDENTIALS,
            "client_kwargs": {"endpoint_url": self.url, "region_name": REGION},
            "config_kwargs": dict(config),
        }

    @property
    def client(self):
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.url,
                aws_access_key_id=CREDENTIALS["key"],
                aws_secret_access_key=CREDENTIALS["secret"],
                region_name=REGION,
            )
        return self._client

    def create_bucket(self, bucket: str) -> None:
        self.client.create_bucket(Bucket=bucket)

    def upload_dir(self, local: str | Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file under ``local`` to ``s3://bucket/prefix/...``; the keys written."""
        keys = []
        for file in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            key = f"{prefix.strip('/')}/{file.relative_to(local)}"
            self.client.put_object(Bucket=bucket, Key=key, Body=file.read_bytes())
            keys.append(key)
        return keys

    def _api(self, action: str) -> bytes:
        request = urllib.request.Request(f"{self.url}/moto-api/recorder/{action}", method="POST" if action != "download-recording" else "GET")
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def start_recording(self) -> None:
        self._api("reset-recording")
        self._api("start-recording")

    def stop_recording(self) -> None:
        self._api("stop-recording")

    def recording(self) -> list[RecordedRequest]:
        """Every request recorded since :meth:`start_recording`."""
        out = []
        for entry in _entries(self._api("download-recording").decode()):
            headers = {k.lower(): v for k, v in entry.get("headers", {}).items()}
            url = urlsplit(entry["url"])
            out.append(
                RecordedRequest(
                    entry["method"], unquote(url.path), url.query, headers.get("range"), headers.get("user-agent", "")
                )
            )
        return out


def objects(moto, prefix: str) -> dict[str, bytes]:
    listed = moto.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"].removeprefix(prefix + "/"): moto.client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
            for o in listed}


def pending_uploads(moto) -> list[str]:
    return [u["Key"] for u in moto.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


def _entries(text: str) -> list[dict[str, Any]]:
    """The JSON objects of moto's recording, one after the other. Its recorder appends an entry and
    its newline in two writes, unlocked, from each request's thread: the entries of concurrent
    requests may share a line (a save's parts beside a load's GETs did)."""
    decoder, entries, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return entries
        entry, at = decoder.raw_decode(text, at)
        entries.append(entry)

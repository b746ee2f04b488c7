"""Storage failures fast and typed: a misspelled option is refused before any request, naming the
valid keys; a store that never answers (a server that accepts and stays silent, a closed port)
fails on its first request without retries, naming the endpoint; missing AWS credentials fail on
the first request naming what to set. Real servers on 127.0.0.1 (moto, a silent server, the
range server); the assertions are on what was configured and what the servers saw (connections,
requests), the wall-clock bounds only guard against hangs."""

from __future__ import annotations

import time

import huggingface_hub
import pytest
import torch

from hp_dcp_hf import HFStorageReader
from hp_dcp_hf.errors import ArgumentError, StorageReadError
from hp_dcp_hf.storage.transport.backend import RetryPolicy, UnreachableError
from hp_dcp_hf.storage.transport.location import check_options, filesystem
from tests.support.servers.s3 import CREDENTIALS, REGION, MotoS3
from tests.support.servers.silent import SilentServer, closed_port_url

HANG_GUARD_S = 15.0
"""Far above what any of these should take: a failure here is a hang, not slowness."""

FIRST_ANSWER_S = 0.5
"""The first-answer timeout these tests configure (the default is 5 s)."""


@pytest.fixture(scope="module")
def s3(tmp_path_factory, tiny_checkpoints):
    server = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    try:
        server.create_bucket("hp-errors")
        server.upload_dir(tiny_checkpoints("llama", torch.bfloat16).path, "hp-errors", "llama")
        yield server
    finally:
        server.stop()


@pytest.fixture
def silent():
    with SilentServer() as server:
        yield server


def _s3_options(endpoint: str, **extra) -> dict:
    return {**CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}, **extra}


# -- misspelled options -----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "options", "message"), [
    ("s3://b/ckpt", {"client_kwargs": {"endpoint": "http://x"}},
     r"unknown storage option 'client_kwargs.endpoint' for s3:// \(s3fs S3FileSystem\) \(did you mean "
     r"'client_kwargs.endpoint_url' for 'client_kwargs.endpoint'\?\); valid client_kwargs keys: .*endpoint_url"),
    ("s3://b/ckpt", {"endpoint_ur": "http://x"}, r"'endpoint_ur' .*did you mean 'endpoint_url'.*valid: .*anon"),
    ("s3://b/ckpt", {"config_kwargs": {"read_timout": 3}}, r"'config_kwargs.read_timeout' for 'config_kwargs.read_timout'"),
    ("s3://b/ckpt", {"profile": "p", "session_vars": {}}, None),  # botocore session arguments: valid
    ("https://example.invalid/ckpt", {"header": {"A": "b"}}, r"'header' for http\(s\).*'headers'"),
    ("hf://org/repo", {"endpont": "http://x"}, r"'endpont' for Hugging Face Hub.*did you mean 'endpoint'"),
    ("/tmp/somewhere", {"key": "k"}, r"unknown storage option 'key' for local files; valid: auto_mkdir"),
])
def test_a_misspelled_option_is_refused_naming_the_valid_ones(path, options, message) -> None:
    if message is None:
        check_options(path, options)
        return
    with pytest.raises(ArgumentError, match=message) as info:
        check_options(path, options)
    assert info.value.file == path
    with pytest.raises(ArgumentError, match=message):  # the reader refuses it the same way
        filesystem(path, options)


def test_a_misspelled_option_sends_no_request(s3) -> None:
    options = _s3_options(s3.url)
    options["client_kwargs"]["endpoint"] = options["client_kwargs"].pop("endpoint_url")
    s3.start_recording()
    with pytest.raises(ArgumentError, match="'client_kwargs.endpoint_url'"):
        HFStorageReader("s3://hp-errors/llama", storage_options=options).read_metadata()
    s3.stop_recording()
    assert s3.recording() == []


# -- stores that never answer -----------------------------------------------------------------------


def test_s3_metadata_has_one_retry_layer_and_short_first_timeouts() -> None:
    policy = RetryPolicy(first_answer_timeout_s=FIRST_ANSWER_S)
    backend, _ = filesystem("s3://b/ckpt", _s3_options("http://127.0.0.1:1"), retry=policy)
    fs = backend.fs
    assert fs.retries == 1  # s3fs's own loop: one try
    assert fs.config_kwargs["retries"]["total_max_attempts"] == 1  # botocore's: one attempt
    assert (fs.connect_timeout, fs.read_timeout) == (FIRST_ANSWER_S, FIRST_ANSWER_S)
    given = filesystem("s3://b/ckpt", _s3_options("http://127.0.0.1:1", config_kwargs={"retries": {"max_attempts": 3}}),
                       retry=policy)[0].fs
    assert given.config_kwargs["retries"] == {"max_attempts": 3}  # the user's setting wins


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_silent_endpoint_fails_on_its_first_request_without_retries(silent, store) -> None:
    retry = {"first_answer_timeout_s": FIRST_ANSWER_S, "backoff_s": 0.01}
    if store == "s3":
        reader = HFStorageReader("s3://hp-errors/llama", storage_options=_s3_options(silent.url), retry=retry)
        hint = "client_kwargs.endpoint_url"
    else:
        reader = HFStorageReader(f"{silent.url}/llama", retry=retry)
        hint = "check the URL"
    start = time.monotonic()
    with pytest.raises(UnreachableError) as info:
        reader.read_metadata()
    assert time.monotonic() - start < HANG_GUARD_S
    reason = info.value.reason
    assert "no answer from" in reason and "not retried as it never answered" in reason and hint in reason, reason
    assert "timed out" in reason.lower() or "timeout" in reason.lower(), reason
    if store == "s3":
        assert silent.url in reason
    assert silent.accepted == 1  # one request, no retry (the policy's 5 attempts are for stores that answered)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_closed_port_fails_on_its_first_request(store) -> None:
    url = closed_port_url()
    if store == "s3":
        reader = HFStorageReader("s3://hp-errors/llama", storage_options=_s3_options(url), retry={"backoff_s": 5})
    else:
        reader = HFStorageReader(f"{url}/llama", retry={"backoff_s": 5})
    start = time.monotonic()
    with pytest.raises(UnreachableError, match="not retried as it never answered") as info:
        reader.read_metadata()
    # A retry would first sleep the 2.5-5 s backoff configured: nothing slept.
    assert time.monotonic() - start < 2.5
    assert url.removeprefix("http://") in info.value.reason


def test_a_store_that_answers_503_is_retried_as_before(tiny_checkpoints) -> None:
    """The first-answer rule leaves failures with an answer alone: two 503s, then the answer."""
    from tests.support.servers.range_server import StaticRangeServer

    root = tiny_checkpoints("llama", torch.bfloat16).path
    with StaticRangeServer(root.parent) as server:
        server.add_fault("status", 2, status=503)
        backend, path = filesystem(f"{server.url}/{root.name}", retry={"backoff_s": 0.01, "max_backoff_s": 0.02})
        assert backend.isfile(backend.join(path, "config.json"))
        assert [r.status for r in server.requests(faults=True)] == [503, 503, 200]


# -- missing credentials ----------------------------------------------------------------------------


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


def test_missing_credentials_fail_on_the_first_request_naming_what_to_set(s3, no_aws_credentials, monkeypatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata
    options = {"client_kwargs": {"endpoint_url": s3.url, "region_name": REGION}}
    s3.start_recording()
    start = time.monotonic()
    with pytest.raises(StorageReadError) as info:
        HFStorageReader("s3://hp-errors/llama", storage_options=options).read_metadata()
    assert time.monotonic() - start < HANG_GUARD_S
    s3.stop_recording()
    reason = info.value.reason
    assert reason.startswith(f"no AWS credentials for {s3.url} (Unable to locate credentials"), reason
    for what in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "key=", "secret=", "anon=true"):
        assert what in reason
    assert "\n" not in str(info.value)
    assert s3.recording() == []  # refused before sending: nothing unsigned went out


def test_a_silent_instance_metadata_service_is_probed_briefly(s3, silent, no_aws_credentials, monkeypatch) -> None:
    """Where the instance-metadata address accepts and never answers, the credentials lookup gives
    up after botocore's one short probe (1 s, one attempt), not after retries of it."""
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", silent.url + "/")
    options = {"client_kwargs": {"endpoint_url": s3.url, "region_name": REGION}}
    start = time.monotonic()
    with pytest.raises(StorageReadError, match="no AWS credentials .*AWS_ACCESS_KEY_ID"):
        HFStorageReader("s3://hp-errors/llama", storage_options=options).read_metadata()
    assert time.monotonic() - start < HANG_GUARD_S
    # s3fs's client and the data client each ask once (token, then the role): no request retried
    assert 1 <= silent.accepted <= 4, silent.accepted


def test_the_hub_offline_check_still_comes_first(monkeypatch) -> None:
    """Options are checked before the Hub's own offline refusal, and a valid one passes on to it."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ArgumentError, match="'tokn'"):
        HFStorageReader("hf://org/repo", tokn="x").read_metadata()

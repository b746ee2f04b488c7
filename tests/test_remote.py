"""Remote checkpoints in one process, against real servers on 127.0.0.1 (no client library mocked).

* HTTP: ``tests.support.servers.StaticRangeServer`` (honours Range, logs requests, injects faults);
* Hub: ``tests.support.servers.FakeHub`` behind ``HfFileSystem(endpoint=...)``;
* S3: moto's server with its request recorder.

Loads go through ``load_hf_checkpoint`` and must equal ``from_pretrained`` of the local copy; the
server logs prove what was fetched: exact ranges only, retries where a failure is transient,
one request where it is not, and a clear error within bounded time when failures never stop.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import huggingface_hub
import pytest
import requests
import torch
from huggingface_hub import HfFileSystem
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import CheckpointFormatError, CheckpointNotFoundError, StorageReadError
from hp_dcp_hf.storage.format.catalog import INDEX_FILE
from hp_dcp_hf.storage.transport.backend import RetryPolicy
from hp_dcp_hf.storage.transport.http_backend import HttpBackend
from hp_dcp_hf.storage.transport.hub import HubBackend
from hp_dcp_hf.storage.transport.location import FsspecBackend, filesystem, locate
from hp_dcp_hf.storage.transport.s3 import S3Backend, client_settings
from tests.support.models import model_class, tiny_config
from tests.support.servers.fake_hub import FakeHub
from tests.support.servers.range_server import LoggedRequest, StaticRangeServer, _Into
from tests.support.servers.s3 import MotoS3

MODEL = "mixtral"
FAST = {"attempts": 4, "backoff_s": 0.01, "max_backoff_s": 0.05, "deadline_s": 10.0}
"""A retry policy for tests: same logic, waits of milliseconds."""


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    """The sharded tiny mixtral (bf16, 9 files + index)."""
    return tiny_checkpoints(MODEL, torch.bfloat16)


@pytest.fixture(scope="module")
def ckpt_b(tiny_checkpoints):
    """Another sharded tiny mixtral with different weights (seed 1)."""
    return tiny_checkpoints(MODEL, torch.bfloat16, seed=1)


@pytest.fixture(scope="module")
def single_file(tiny_checkpoints):
    return tiny_checkpoints(MODEL, torch.bfloat16, max_shard_size=None)


@pytest.fixture(scope="module")
def http_root(tmp_path_factory, ckpt, single_file) -> Path:
    root = tmp_path_factory.mktemp("http")
    shutil.copytree(ckpt.path, root / "ckpt")
    shutil.copytree(single_file.path, root / "single")
    (root / "noindex").mkdir()
    shutil.copy(single_file.path / "model.safetensors", root / "noindex" / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def http_server(http_root):
    with StaticRangeServer(http_root) as server:
        yield server


@pytest.fixture
def http(http_server):
    http_server.reset()
    yield http_server
    http_server.reset()


@pytest.fixture(scope="module")
def hub_server(ckpt, ckpt_b):
    with FakeHub() as hub:
        hub.shas = {
            "a": hub.add_commit("org/mix", {"": ckpt.path}, refs=("main", "v1")),
            "sub": hub.add_commit("org/sub", {"weights": ckpt.path, "README.md": b"hello"}),
        }
        yield hub


@pytest.fixture
def hub(hub_server, monkeypatch):
    """The fake Hub, with HF_HUB_OFFLINE lifted (conftest sets it) for this test only."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    hub_server.reset()
    yield hub_server
    hub_server.reset()


@pytest.fixture(scope="module")
def s3(tmp_path_factory, ckpt):
    server = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    try:
        server.create_bucket("hp-single")
        server.upload_dir(ckpt.path, "hp-single", "tiny/mixtral")
        yield server
    finally:
        server.stop()


# -- helpers ---------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    model = model_class(MODEL)(tiny_config(MODEL)).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    return model


def _load(path: str, **reader_options) -> tuple[dict[str, torch.Tensor], HFStorageReader, HFMappingPlanner]:
    model = _model()
    reader = HFStorageReader(path, **{"coalesce_gap": 0, **reader_options})
    planner = HFMappingPlanner(model)
    report = load_hf_checkpoint(model, path, reader=reader, planner=planner)
    assert not report.missing_keys and not report.unexpected_keys
    return model.state_dict(), reader, planner


def _assert_equal(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert state.keys() == reference.keys()
    bad = [key for key in state if not torch.equal(state[key], reference[key])]
    assert not bad, bad[:3]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (the test model is NaN, which ``torch.equal`` never finds equal)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _data(log: list[LoggedRequest]) -> list[LoggedRequest]:
    """Requests for tensor data: ranges that start past the 8-byte length prefix of a .safetensors."""
    return [r for r in log if r.path.endswith(".safetensors") and r.span and r.span[0] > 8]


def _starts_past_header(method: str, path: str, range_: str | None) -> bool:
    return path.endswith(".safetensors") and bool(range_) and int(range_.split("=")[1].split("-")[0] or 0) > 8


# -- the servers themselves ------------------------------------------------------------------------


def test_range_server_answers_ranges_like_a_real_server(http) -> None:
    url = f"{http.url}/ckpt/{INDEX_FILE}"
    body = requests.get(url, timeout=5).content
    size = len(body)
    cases = {
        "bytes=2-9": (206, body[2:10], f"bytes 2-9/{size}"),
        f"bytes={size - 3}-": (206, body[-3:], f"bytes {size - 3}-{size - 1}/{size}"),
        "bytes=-4": (206, body[-4:], f"bytes {size - 4}-{size - 1}/{size}"),
        f"bytes=5-{size + 100}": (206, body[5:], f"bytes 5-{size - 1}/{size}"),
        f"bytes={size}-": (416, b"", f"bytes */{size}"),
    }
    for header, (status, content, content_range) in cases.items():
        r = requests.get(url, headers={"Range": header}, timeout=5)
        assert (r.status_code, r.content, r.headers.get("Content-Range")) == (status, content, content_range), header
    head = requests.head(url, timeout=5)
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == size and not head.content
    assert requests.get(f"{http.url}/ckpt/nope", timeout=5).status_code == 404
    http.ignore_range = True
    r = requests.get(url, headers={"Range": "bytes=2-9"}, timeout=5)
    assert (r.status_code, r.content) == (200, body)
    assert [(x.method, x.range, x.status) for x in http.requests()][:2] == [("GET", None, 200), ("GET", "bytes=2-9", 206)]


# -- choosing a backend ----------------------------------------------------------------------------


def test_filesystem_picks_the_backend(tmp_path, monkeypatch) -> None:
    backend, path = filesystem("s3://bucket/prefix/", {"anon": True})
    assert isinstance(backend, FsspecBackend) and type(backend.fs).__name__ == "S3FileSystem"
    assert path == "bucket/prefix" and backend.retry == RetryPolicy()
    backend, path = filesystem("https://example.com/ckpt/", {"headers": {"X-A": "1"}}, retry={"attempts": 2})
    assert isinstance(backend, HttpBackend) and backend.client.retry.attempts == 2
    assert backend.client.headers == {"X-A": "1"}
    backend, path = filesystem("hf://org/repo@v1/sub", {"endpoint": "http://127.0.0.1:9"})
    assert isinstance(backend, HubBackend) and isinstance(backend.fs, HfFileSystem)
    assert path == "org/repo@v1/sub" and backend.fs.endpoint == "http://127.0.0.1:9"
    backend, path = filesystem("org/repo@refs/pr/1")
    assert isinstance(backend, HubBackend) and path == "org/repo@refs/pr/1"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "repo").mkdir(parents=True)  # an existing local path wins over a repo id
    backend, path = filesystem("org/repo")
    assert isinstance(backend, FsspecBackend) and backend.local and backend.retry is None
    backend, _ = filesystem("memory://x")
    assert isinstance(backend, FsspecBackend) and not backend.local
    with pytest.raises(ValueError, match="client_kwargs"):
        filesystem("http://127.0.0.1:9/x", {"client_kwargs": {}})
    with pytest.raises(ValueError, match="attemps"):
        RetryPolicy.of({"attemps": 3})
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


# -- HTTP ------------------------------------------------------------------------------------------


def test_http_load_reads_exact_ranges(http, ckpt) -> None:
    state, reader, planner = _load(f"{http.url}/ckpt")
    _assert_equal(state, ckpt.reference())
    stats = reader.stats.total()
    gets = http.requests("GET")
    assert all(r.status == 206 and r.span and r.body_bytes == r.span[1] - r.span[0] for r in gets)
    assert sum(r.body_bytes for r in gets) == stats.bytes_read + stats.header_bytes
    assert len(gets) == stats.requests + stats.header_requests
    assert stats.bytes_read == stats.bytes_needed == planner.stats.bytes_needed
    files = {p.name: p.stat().st_size for p in ckpt.path.glob("*.safetensors")}
    # One HEAD per file (the index, then each shard: exists + size share it), nothing else.
    heads = http.requests("HEAD")
    assert sorted(Path(r.path).name for r in heads) == sorted([INDEX_FILE, *files])
    assert all("hp-dcp-hf/" in r.user_agent for r in http.requests())
    print(f"\nhttp load: {len(gets)} GETs ({stats.requests} data, {stats.header_requests} header), "
          f"{len(heads)} HEADs, {stats.bytes_read} data bytes + {stats.header_bytes} header bytes "
          f"of {sum(files.values())} in the files")


@pytest.mark.parametrize("gap", [None, 0], ids=["default", "exact"])
def test_remote_default_gap_trades_a_few_bytes_for_requests(http, ckpt, gap) -> None:
    """A column box (one range per row): by default a remote store reads it in one request, the
    holes between rows fetched and dropped (a request costs a round trip); ``coalesce_gap=0`` makes
    one request per row. The server's log agrees with the reader's counters either way."""
    reader = HFStorageReader(f"{http.url}/ckpt", coalesce_gap=gap)
    reader.read_metadata()
    key = next(k for k, e in sorted(reader.entries.items()) if len(e.shape) == 2 and e.shape[0] > 4)
    rows, cols = reader.entries[key].shape
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("dest", [0, 0]), torch.Size([0, 0]),
                    MetadataIndex(key, [0, 0]), torch.Size([0, 1]), torch.Size([rows, cols // 2]))
    dest = torch.empty(rows, cols // 2, dtype=reader.entries[key].dtype)
    http.reset()
    reader.read_data(LoadPlan([item]), _Into({"dest": dest})).wait()
    stored = load_file(str(ckpt.path / reader.entries[key].file))[key]
    assert torch.equal(dest, stored[:, 1 : 1 + cols // 2])
    stats = reader.stats.total()
    gets = http.requests("GET")
    assert len(gets) == stats.requests and sum(r.body_bytes for r in gets) == stats.bytes_read
    assert stats.ranges == rows and stats.bytes_needed == dest.numel() * dest.element_size()
    if gap is None:
        assert stats.requests == 1 and stats.bytes_read == (rows - 1) * cols * dest.element_size() + stats.bytes_needed // rows
    else:
        assert stats.requests == rows and stats.bytes_read == stats.bytes_needed


def test_http_single_file_url(http, single_file) -> None:
    state, reader, _ = _load(f"{http.url}/single/model.safetensors")
    _assert_equal(state, single_file.reference())
    assert reader.resolved_root == f"{http.url}/single"


def test_http_directory_needs_its_index(http) -> None:
    with pytest.raises(CheckpointNotFoundError, match="cannot be listed") as info:
        HFStorageReader(f"{http.url}/noindex").read_metadata()
    assert info.value.file == f"{http.url}/noindex/{INDEX_FILE}"
    with pytest.raises(CheckpointNotFoundError, match="query"):
        HFStorageReader(f"{http.url}/ckpt?sig=1").read_metadata()
    with pytest.raises(CheckpointFormatError, match="not a .safetensors"):
        HFStorageReader(f"{http.url}/ckpt/config.json").read_metadata()


def test_http_server_ignoring_range_is_an_error(http, ckpt) -> None:
    http.ignore_range = True
    reader = HFStorageReader(f"{http.url}/ckpt", retry=FAST)
    with pytest.raises(StorageReadError, match="ignored the Range header") as info:
        reader.read_metadata()
    assert info.value.file.endswith(".safetensors")
    # The index read asks for the whole file, so a 200 is that range; a header read is not, and a
    # file whose header read got a 200 is never asked again (no retry of a permanent failure).
    gets = http.requests("GET")
    assert gets[0].path.endswith(INDEX_FILE) and all(r.status == 200 for r in gets)
    headers = [r.path for r in gets[1:]]
    assert headers and len(headers) == len(set(headers)) and all(r.range == "bytes=0-7" for r in gets[1:])
    # In the middle of a file (the data phase): reported at once, never retried.
    http.reset()
    location, _ = locate(*filesystem(f"{http.url}/ckpt", retry=FAST))
    http.ignore_range = True
    with location.open("model-00001-of-00009.safetensors") as handle, pytest.raises(
        StorageReadError, match="ignored the Range header"
    ):
        handle.read(100, 200)
    assert len(http.requests("GET")) == 1


def test_http_transient_failures_are_retried_and_resumed(http, ckpt) -> None:
    retries = [
        http.add_fault("status", 2, status=503),
        http.add_fault("status", 1, status=429),
        http.add_fault("reset", 2, match=_starts_past_header),
        http.add_fault("truncate", 3, match=_starts_past_header),
    ]
    state, reader, _ = _load(f"{http.url}/ckpt", retry={**FAST, "attempts": 10})
    _assert_equal(state, ckpt.reference())
    assert [f.hits for f in retries] == [2, 1, 2, 3]
    log = http.requests(faults=True)
    truncated = [r for r in log if r.fault == "truncate"]
    for cut in truncated:  # the retry asks only for the bytes after those that arrived
        start, end = cut.span
        resumed = start + cut.body_bytes
        assert any(r.path == cut.path and r.span == (resumed, end) for r in log), cut
    served = http.requests("GET")
    stats = reader.stats.total()
    assert sum(r.body_bytes for r in served) + sum(r.body_bytes for r in truncated) == (
        stats.bytes_read + stats.header_bytes
    )


def test_http_persistent_failure_gives_up_in_bounded_time(http) -> None:
    http.add_fault("status", None, status=503, match=_starts_past_header)
    location, _ = locate(*filesystem(f"{http.url}/ckpt", retry=FAST))
    start = time.monotonic()
    with location.open("model-00001-of-00009.safetensors") as handle, pytest.raises(
        StorageReadError, match=r"failed 4 time\(s\).*giving up.*HTTP 503"
    ) as info:
        handle.read(100, 200)
    assert time.monotonic() - start < 5
    assert info.value.file == "model-00001-of-00009.safetensors"
    assert len([r for r in http.requests(faults=True) if r.fault]) == 4
    assert info.value.transferred == 0  # no byte came: a reader writing in place changed nothing


def test_http_read_given_up_part_way_says_how_many_bytes_it_wrote(http) -> None:
    """Every answer cut short: the read resumes after the bytes that came until the policy gives
    up, and its error counts them (``transferred``): its buffers were written that far."""
    http.add_fault("truncate", None, match=_starts_past_header)
    location, _ = locate(*filesystem(f"{http.url}/ckpt", retry=FAST))
    buffer = bytearray(4096)
    with location.open("model-00001-of-00009.safetensors") as handle, pytest.raises(StorageReadError) as info:
        handle.read_into(100, [buffer])
    cut = [r for r in http.requests(faults=True) if r.fault == "truncate"]
    assert len(cut) == 4 and info.value.transferred == sum(r.body_bytes for r in cut) > 0


def test_http_stalled_server_times_out(http) -> None:
    http.add_fault("stall", None, delay_s=1.5, match=_starts_past_header)
    policy = {**FAST, "attempts": 2, "read_timeout_s": 0.2, "connect_timeout_s": 0.2}
    location, _ = locate(*filesystem(f"{http.url}/ckpt", retry=policy))
    start = time.monotonic()
    with location.open("model-00001-of-00009.safetensors") as handle, pytest.raises(
        StorageReadError, match="giving up.*(?i:timed out|timeout)"
    ):
        handle.read(100, 200)
    assert time.monotonic() - start < 1.5


def test_http_data_gone_after_its_header_names_the_keys_and_touches_nothing(http) -> None:
    """A file that answers 404 to its data ranges once its header was read (deleted meanwhile):
    CheckpointNotFoundError naming the file and the keys it held, and no byte was written
    (``touched_keys`` empty, the model as it was)."""
    http.add_fault("status", None, status=404, match=_starts_past_header)
    model = _model()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(CheckpointNotFoundError, match="404") as info:
        load_hf_checkpoint(model, f"{http.url}/ckpt", retry=FAST, coalesce_gap=0)
    error = info.value
    weight_map = requests.get(f"{http.url}/ckpt/{INDEX_FILE}", timeout=5).json()["weight_map"]
    assert error.key and {weight_map[key] for key in error.key.split(", ")} == {error.file}, error  # its own keys
    assert error.touched_keys == ()
    changed = [key for key, value in model.state_dict().items() if not _same_bits(value, before[key])]
    assert not changed, changed


def test_http_permanent_errors_are_not_retried(http) -> None:
    location, _ = locate(*filesystem(f"{http.url}/ckpt", retry=FAST))
    with location.open("missing.safetensors") as handle, pytest.raises(CheckpointNotFoundError, match="404"):
        handle.read(0, 8)
    http.add_fault("status", None, status=403)
    with location.open(INDEX_FILE) as handle, pytest.raises(StorageReadError, match="access denied"):
        handle.read(0, 8)
    assert [r.status for r in http.requests(faults=True)] == [404, 403]
    http.reset()
    with location.open(INDEX_FILE) as handle, pytest.raises(StorageReadError, match="changed since"):
        handle.read(10**6, 10**6 + 8)  # past the end: 416


# -- Hugging Face Hub ------------------------------------------------------------------------------


def test_hub_load_by_url_revision_and_bare_id(hub, ckpt) -> None:
    options = {"endpoint": hub.url, "token": False}
    sha = hub.shas["a"]
    for path in ("hf://org/mix", "hf://org/mix@v1", f"org/mix@{sha}", "org/mix"):
        hub.reset()
        state, reader, _ = _load(path, **options)
        _assert_equal(state, ckpt.reference())
        assert reader.resolved_root == f"org/mix@{sha}"
        resolves = [r for r in hub.requests() if "/resolve/" in r.path]
        assert resolves and all(r.path.startswith(f"/org/mix/resolve/{sha}/") for r in resolves)
        assert all(r.method == "GET" and r.status == 206 for r in resolves)
        stats = reader.stats.total()
        assert sum(r.body_bytes for r in resolves) == stats.bytes_read + stats.header_bytes
    api = [r.path for r in hub.requests() if r.path.startswith("/api/")]
    print(f"\nhub load: {len(resolves)} ranged GETs, {len(api)} API requests: {api}")


def test_hub_subfolder_and_revision_option(hub, ckpt) -> None:
    state, reader, _ = _load("hf://org/sub/weights", endpoint=hub.url, token=False)
    _assert_equal(state, ckpt.reference())
    assert reader.resolved_root == f"org/sub@{hub.shas['sub']}/weights"
    state, reader, _ = _load("hf://org/mix", endpoint=hub.url, token=False, revision="v1")
    _assert_equal(state, ckpt.reference())


def test_hub_missing_repo_revision_or_file(hub, ckpt) -> None:
    options = {"endpoint": hub.url, "token": False}
    for path, message in [
        ("hf://org/nope", "repository not found"),
        ("hf://org/mix@nobranch", "revision not found"),
        ("hf://org/mix/nodir", "no such file or directory"),
        ("hf://org/sub", "no .safetensors"),
    ]:
        with pytest.raises(CheckpointNotFoundError, match=message):
            HFStorageReader(path, **options).read_metadata()
    index = json.loads((ckpt.path / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00042-of-00009.safetensors"
    hub.add_commit("org/broken", {"": ckpt.path, INDEX_FILE: json.dumps(index).encode()})
    with pytest.raises(CheckpointNotFoundError) as info:
        HFStorageReader("org/broken", **options).read_metadata()
    assert info.value.file == "model-00042-of-00009.safetensors"
    location, _ = locate(*filesystem("hf://org/mix", options))
    with location.open("gone.safetensors") as handle, pytest.raises(CheckpointNotFoundError, match="EntryNotFound"):
        handle.read(0, 8)


def test_hub_root_is_pinned_to_the_commit(hub, ckpt, ckpt_b) -> None:
    """A branch that moves after the checkpoint is located does not change what is read."""
    options = {"endpoint": hub.url, "token": False}
    hub.add_commit("org/moving", {"": ckpt.path})
    location, _ = locate(*filesystem("hf://org/moving", options))
    hub.add_commit("org/moving", {"": ckpt_b.path})  # main moves on
    old = (ckpt.path / "model-00001-of-00009.safetensors").read_bytes()
    new = (ckpt_b.path / "model-00001-of-00009.safetensors").read_bytes()
    assert len(old) == len(new) and old[-64:] != new[-64:]  # same layout, other weights
    with location.open("model-00001-of-00009.safetensors") as handle:
        assert handle.read(len(old) - 64, len(old)) == old[-64:]
    state, _, _ = _load("hf://org/moving", **options)  # a new load sees the new commit
    _assert_equal(state, ckpt_b.reference())


def test_hub_api_failures_are_retried(hub, ckpt) -> None:
    fault = hub.add_fault("status", 2, status=502, match=lambda method, path, range_: path.startswith("/api/"))
    state, _, _ = _load("hf://org/mix", endpoint=hub.url, token=False, retry=FAST)
    _assert_equal(state, ckpt.reference())
    assert fault.hits == 2


def test_hub_offline_mode_is_a_clear_error(hub, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointNotFoundError, match="HF_HUB_OFFLINE"):
        HFStorageReader("hf://org/mix", endpoint=hub.url, token=False).read_metadata()
    # A relative path that does not exist reads as a repo id: the error says so.
    with pytest.raises(CheckpointNotFoundError, match="HF_HUB_OFFLINE.*no local path.*Hub repo id"):
        HFStorageReader("checkpoints/mixtral", endpoint=hub.url, token=False).read_metadata()
    assert not hub.requests(faults=True)


# -- S3 --------------------------------------------------------------------------------------------


def test_s3_load_reads_exact_ranges(s3, ckpt) -> None:
    options = s3.storage_options()
    s3.start_recording()
    state, reader, planner = _load("s3://hp-single/tiny/mixtral", storage_options=options)
    s3.stop_recording()
    _assert_equal(state, ckpt.reference())
    stats = reader.stats.total()
    log = s3.recording()
    objects = [r for r in log if r.method == "GET" and not r.query]
    assert objects and all(r.nbytes is not None for r in objects)  # every object GET is ranged
    assert sum(r.nbytes for r in objects) == stats.bytes_read + stats.header_bytes
    assert len(objects) == stats.requests + stats.header_requests
    assert stats.bytes_read == planner.stats.bytes_needed
    print(f"\ns3 load: {len(log)} requests: {len(objects)} ranged GETs, "
          f"{sorted({(r.method, bool(r.query)) for r in log})}")


def test_s3_missing_prefix_or_bucket(s3) -> None:
    options = s3.storage_options()
    with pytest.raises(CheckpointNotFoundError):
        HFStorageReader("s3://hp-single/nothing/here", storage_options=options).read_metadata()
    with pytest.raises(CheckpointNotFoundError):
        HFStorageReader("s3://hp-no-such-bucket/x", storage_options=options).read_metadata()


# -- concurrency and GET sizes ---------------------------------------------------------------------

LATENCY_S = 0.02
"""A store's round trip, injected by the server before it answers each data range."""


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("store", ["http", "s3"])
def test_requests_of_one_batch_are_in_flight_at_once(request, ckpt, store, threads) -> None:
    """A column box is one range per row; with ``coalesce_gap=0`` each is a request, all in one
    batch. With a 20 ms round trip, the server sees exactly ``num_threads`` of them at once (it used
    to see one: a batch's requests went one after the other)."""
    server = request.getfixturevalue(store)
    if store == "http":
        path, options = f"{server.url}/ckpt", {}
    else:
        path, options = "s3://hp-single/tiny/mixtral", {"storage_options": server.storage_options()}
    reader = HFStorageReader(path, coalesce_gap=0, num_threads=threads, **options)
    reader.read_metadata()
    key = max((k for k, e in reader.entries.items() if len(e.shape) == 2), key=lambda k: reader.entries[k].shape[0])
    entry = reader.entries[key]
    rows, cols = 8 * threads, entry.shape[1] // 2
    assert entry.shape[0] >= rows
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("dest", [0, 0]), torch.Size([0, 0]),
                    MetadataIndex(key, [0, 0]), torch.Size([0, 1]), torch.Size([rows, cols]))
    assert len(reader.plan_requests([item])) == rows  # one batch (a few KiB), one request per row
    dest = torch.empty(rows, cols, dtype=entry.dtype)
    if store == "http":
        server.add_fault("stall", None, delay_s=LATENCY_S, match=_starts_past_header)
    else:
        server.latency_s = LATENCY_S
    server.in_flight.reset()
    try:
        reader.read_data(LoadPlan([item]), _Into({"dest": dest})).wait()
    finally:
        server.latency_s = 0.0
    assert server.in_flight.max == threads
    assert reader.stats.total().requests == rows
    assert torch.equal(dest, load_file(str(ckpt.path / entry.file))[key][:rows, 1 : 1 + cols])


def test_remote_get_size_does_not_shrink_with_more_threads(http, http_root) -> None:
    """A 40 MiB tensor is five 8 MiB GETs with 8 threads and with 32 (the 64 MiB staging budget
    used to be split per thread: 2 MiB GETs, four times as many); local files keep the per-thread
    share (a read there costs no round trip)."""
    (http_root / "big").mkdir(exist_ok=True)
    save_file({"w": torch.zeros(1280, 8192)}, http_root / "big" / "model.safetensors")
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("w", [0, 0]), torch.Size([0, 0]),
                    MetadataIndex("w", [0, 0]), torch.Size([0, 0]), torch.Size([1280, 8192]))
    sizes = {}
    for where, threads in (("http", 8), ("http", 32), ("local", 32)):
        root = f"{http.url}/big" if where == "http" else str(http_root / "big")
        reader = HFStorageReader(f"{root}/model.safetensors", num_threads=threads)
        reader.read_metadata()
        sizes[where, threads] = [request.nbytes for _, request in reader.plan_requests([item])]
    assert sizes["http", 8] == sizes["http", 32] == [8 * 2**20] * 5
    assert sizes["local", 32] == [2 * 2**20] * 20


# -- S3 data reads: settings, faults ---------------------------------------------------------------


def _s3_fs(endpoint: str, **options):
    import s3fs

    return s3fs.S3FileSystem(
        key="testing", secret="testing", skip_instance_cache=True,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"}, **options,
    )


def test_s3_client_takes_s3fs_options_and_sizes_its_pool() -> None:
    policy = RetryPolicy(connect_timeout_s=3, read_timeout_s=7)
    settings = client_settings(_s3_fs("http://127.0.0.1:1", token="t", profile=None), policy, 32)
    assert settings["client"] == {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                                  "aws_session_token": "t", "endpoint_url": "http://127.0.0.1:1",
                                  "region_name": "us-east-1", "use_ssl": True}
    assert settings["config"] == {"connect_timeout": 3, "read_timeout": 7, "retries": {"total_max_attempts": 1},
                                  "max_pool_connections": 32}
    given = client_settings(_s3_fs("http://x", config_kwargs={"max_pool_connections": 64, "read_timeout": 1}),
                            policy, 8)["config"]
    assert given["max_pool_connections"] == 64 and given["read_timeout"] == 1
    anon = client_settings(_s3_fs("http://x", anon=True), policy, None)
    assert anon["anon"] and "aws_access_key_id" not in anon["client"] and anon["client"]["endpoint_url"] == "http://x"
    backend = S3Backend(_s3_fs("http://127.0.0.1:1"), policy, concurrency=32)
    client, _ = backend.client()
    assert client.meta.config.max_pool_connections == 32 and client.meta.endpoint_url == "http://127.0.0.1:1"
    assert S3Backend(_s3_fs("http://127.0.0.1:1"), policy, concurrency=32).client()[0] is client  # shared


def _s3_handle(http, file: str, retry: dict):
    """An S3 object ``ckpt/<file>`` whose GETs the range server answers (path-style GetObject is
    ``GET /bucket/key`` with ``Range``), so its faults reach our S3 data path."""
    fs = _s3_fs(http.url, config_kwargs={"s3": {"addressing_style": "path"}})
    return S3Backend(fs, RetryPolicy(**retry), concurrency=2).open(f"ckpt/{file}", file)


def test_s3_cut_bodies_and_5xx_are_retried_and_resumed(http, ckpt) -> None:
    file = "model-00001-of-00009.safetensors"
    data = (ckpt.path / file).read_bytes()
    faults = [
        http.add_fault("status", 2, status=503),
        http.add_fault("reset", 1, match=_starts_past_header),
        http.add_fault("truncate", 2, match=_starts_past_header),
    ]
    with _s3_handle(http, file, {**FAST, "attempts": 6}) as handle:
        assert handle.read(100, len(data)) == data[100:]
    assert [f.hits for f in faults] == [2, 1, 2]
    log = http.requests(faults=True)
    for cut in (r for r in log if r.fault == "truncate"):  # resumed after the bytes that arrived
        assert any(r.span == (cut.span[0] + cut.body_bytes, len(data)) for r in log), cut
    assert len(log) == 6  # 5 faults + 1 answer: botocore itself retries nothing


def test_s3_persistent_failure_is_a_typed_error_naming_the_file(http) -> None:
    file = "model-00001-of-00009.safetensors"
    http.add_fault("status", None, status=503)
    with _s3_handle(http, file, FAST) as handle, pytest.raises(
        StorageReadError, match=r"failed 4 time\(s\).*giving up.*503"
    ) as info:
        handle.read(100, 200)
    assert info.value.file == file
    assert len(http.requests(faults=True)) == FAST["attempts"]
    http.reset()
    with _s3_handle(http, "nothing.safetensors", FAST) as handle, pytest.raises(CheckpointNotFoundError) as info:
        handle.read(100, 200)
    assert info.value.file == "nothing.safetensors" and len(http.requests()) == 1



def test_s3_bodies_read_to_the_end_give_their_connection_back(http, ckpt) -> None:
    """Bodies are read from the socket under botocore, not through urllib3's reads, which alone hand
    a connection back: one read after another reuses one connection, none opened per request."""
    file = "model-00001-of-00009.safetensors"
    data = (ckpt.path / file).read_bytes()
    with _s3_handle(http, file, FAST) as handle:
        client, _ = handle._backend.client()
        pools = client._endpoint.http_session._manager.pools
        before = sum(pool.num_connections for pool in pools._container.values())
        for start in range(100, 1100, 100):
            assert handle.read(start, start + 100) == data[start : start + 100]
        opened = sum(pool.num_connections for pool in pools._container.values()) - before
    assert len(http.requests()) == 10 and opened <= 1

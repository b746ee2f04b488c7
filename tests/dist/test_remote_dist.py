"""Remote checkpoints on 2 and 4 gloo ranks, against real servers run by this (parent) process.

A tiny sharded mixtral (bf16, 9 files + index) is served by moto (S3), a Range-honouring HTTP
server and a fake Hub. Ranks load it with ``load_hf_checkpoint(model, url, cooperate="never", ...)`` (reading directly) under TP (every
parameter ``Shard(0)``) and EP (stacked experts ``Shard(0)``, the rest replicated); every
parameter must equal ``from_pretrained`` of the local copy.

Server logs (moto's recorder; the test servers' own logs) are split per case by path and per rank
by User-Agent (``rank/N``), and prove: every rank fetched exactly the bytes its plan needs, in
ranged GETs only; only rank 0 asked for metadata (listing, HEAD, Hub API, index, headers); every
rank read the one Hub commit rank 0 resolved, even though the branch moved during the load.
Faults: transient ones (503, resets, cut bodies) are survived; persistent ones make every rank
raise the same clear error within bounded time.

Cases are batched: one spawn of 2 ranks and one of 4 (spawning costs seconds per rank).
"""

from __future__ import annotations

import re
import shutil
import time
from urllib.parse import unquote

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import StorageReadError
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.layouts import apply_layout
from tests.support.models import model_class, tiny_config
from tests.support.servers.fake_hub import FakeHub
from tests.support.servers.range_server import StaticRangeServer
from tests.support.servers.s3 import MotoS3

MODEL = "mixtral"
BUCKET = "hp-dist"
FAST = {"attempts": 3, "backoff_s": 0.02, "max_backoff_s": 0.1, "deadline_s": 10.0}
FLAKY = {**FAST, "attempts": 12}


# -- what runs on every rank -----------------------------------------------------------------------


def _apply_ep(model: nn.Module, world: int) -> None:
    """Expert parallel on a 1-D mesh: stacked experts (3-D) ``Shard(0)``, the rest replicated."""
    mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)] if param.ndim == 3 else [Replicate()]
            dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=False))
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(float("nan"))


def _model(world: int, layout: str) -> nn.Module:
    torch.manual_seed(1)
    model = model_class(MODEL)(tiny_config(MODEL)).to(torch.bfloat16)
    if layout == "ep":
        _apply_ep(model, world)
    else:
        apply_layout(model, layout, world)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _options(rank: int, case: dict) -> dict:
    # Direct reads: each rank's own bytes are checked here; span ownership (the remote default)
    # in test_cooperation_dist.
    options = {"cooperate": "never", **case.get("options", {})}
    if case["backend"] == "s3":  # label this rank's requests in moto's recording
        options["storage_options"] = {**options["storage_options"], "config_kwargs": {"user_agent_extra": f"rank/{rank}"}}
    return options


def _run_case(rank: int, world: int, case: dict, references: dict) -> dict:
    model = _model(world, case["layout"])
    reader = HFStorageReader(case["path"], coalesce_gap=0, **_options(rank, case))
    planner = HFMappingPlanner(model)
    start = time.monotonic()
    try:
        if case.get("metadata_only"):
            reader.read_metadata()  # a collective: rank 0 reads, every rank gets the result or error
        else:
            load_hf_checkpoint(model, case["path"], reader=reader, planner=planner)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - start}
    elapsed = time.monotonic() - start
    reference = references[case["reference"]]
    state = model.state_dict()
    total = reader.stats.total()
    return {
        "bad": sorted(k for k, v in state.items() if not torch.equal(_full(v), reference[k])),
        "bytes_read": total.bytes_read,
        "bytes_needed": total.bytes_needed,
        "plan_bytes": planner.stats.bytes_needed,
        "requests": total.requests,
        "header_bytes": total.header_bytes,
        "header_requests": total.header_requests,
        "root": reader.resolved_root,
        "elapsed": elapsed,
    }


def _run_cases(rank: int, world: int, cases: list[dict], references: dict) -> dict:
    import huggingface_hub

    # conftest's HF_HUB_OFFLINE=1 reaches spawned ranks through the environment: lift it here, and
    # label this rank's Hub API requests.
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    huggingface_hub.constants.HF_HUB_USER_AGENT_ORIGIN = f"rank/{rank}"
    return {case["name"]: _run_case(rank, world, case, references) for case in cases}


# -- servers (in this process) ---------------------------------------------------------------------


def _data_range(method: str, path: str, range_: str | None) -> bool:
    """A tensor-data read: a range of a .safetensors file starting past its 8-byte length prefix."""
    return path.endswith(".safetensors") and bool(range_) and int(range_.split("=")[1].split("-")[0] or 0) > 8


def _under(prefix: str):
    return lambda method, path, range_: path.startswith(prefix)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_checkpoints):
    a = tiny_checkpoints(MODEL, torch.bfloat16)
    b = tiny_checkpoints(MODEL, torch.bfloat16, seed=1)
    root = tmp_path_factory.mktemp("remote_dist")
    for name in ("ok", "flaky", "broken", "broken-data", "norange"):
        shutil.copytree(a.path, root / "http" / name)
    moto = MotoS3(root / "moto-recording.jsonl")
    http = StaticRangeServer(root / "http")
    hub = FakeHub()
    try:
        moto.create_bucket(BUCKET)
        for prefix in ("tp2", "ep2", "tp4", "ep4"):
            moto.upload_dir(a.path, BUCKET, f"mixtral/{prefix}")
        http.ignore_range = lambda path: path.startswith("/norange/")
        shas = {"a": hub.add_commit("org/mix", {"": a.path}, refs=("main", "v1"))}
        shas["b"] = hub.add_commit("org/mix", {"": b.path}, refs=())  # main moves here during the load

        def move_main(method: str, path: str, range_: str | None) -> None:
            # Right after rank 0 resolved "main" (its first listing), main moves on: ranks that
            # resolved it again would read other weights.
            if path.startswith("/api/models/org/mix/tree/"):
                hub.repos["org/mix"]["refs"]["main"] = shas["b"]

        hub.on_request = move_main
        references = {"a": a.reference(), "b": b.reference()}
        yield {"moto": moto, "http": http, "hub": hub, "shas": shas, "references": references}
    finally:
        hub.stop()
        http.stop()
        moto.stop()


def _cases(world: int, servers: dict) -> list[dict]:
    s3 = {"storage_options": servers["moto"].storage_options()}
    hub = {"endpoint": servers["hub"].url, "token": False}
    http = servers["http"].url
    cases = [
        {"name": f"s3-tp{world}", "backend": "s3", "path": f"s3://{BUCKET}/mixtral/tp{world}", "layout": "shard0",
         "options": s3, "reference": "a"},
        {"name": f"s3-ep{world}", "backend": "s3", "path": f"s3://{BUCKET}/mixtral/ep{world}", "layout": "ep",
         "options": s3, "reference": "a"},
    ]
    if world == 4:
        return cases
    return cases + [
        {"name": "http-tp", "backend": "http", "path": f"{http}/ok", "layout": "shard0", "reference": "a"},
        {"name": "http-flaky", "backend": "http", "path": f"{http}/flaky", "layout": "ep", "reference": "a",
         "options": {"retry": FLAKY}},
        {"name": "http-norange", "backend": "http", "path": f"{http}/norange", "layout": "shard0", "reference": "a",
         "options": {"retry": FAST}, "metadata_only": True},
        {"name": "http-broken", "backend": "http", "path": f"{http}/broken", "layout": "shard0", "reference": "a",
         "options": {"retry": FAST}, "metadata_only": True},
        {"name": "http-broken-data", "backend": "http", "path": f"{http}/broken-data", "layout": "shard0",
         "reference": "a", "options": {"retry": FAST}},
        {"name": "hub-main", "backend": "hub", "path": "hf://org/mix", "layout": "shard0", "reference": "a",
         "options": hub},
        {"name": "hub-v1-ep", "backend": "hub", "path": "hf://org/mix@v1", "layout": "ep", "reference": "a",
         "options": hub},
        {"name": "hub-main-again", "backend": "hub", "path": "org/mix", "layout": "shard0", "reference": "b",
         "options": hub},
    ]


@pytest.fixture(scope="module")
def run_world(servers):
    """``run_world(world)``: the cases of ``world`` ranks, run once per module, and the server logs."""
    done: dict[int, dict] = {}

    def run(world: int) -> dict:
        if world not in done:
            done[world] = _run_world(world, servers)
        return done[world]

    return run


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, run_world):
    return run_world(request.param)


@pytest.fixture(scope="module")
def results2(run_world):
    """The 2-rank run, which alone has the HTTP and Hub cases."""
    return run_world(2)


def _run_world(world: int, servers: dict) -> dict:
    http, hub, moto = servers["http"], servers["hub"], servers["moto"]
    http.reset()
    http.ignore_range = lambda path: path.startswith("/norange/")
    faults = {
        "503": http.add_fault("status", 3, status=503, match=_under("/flaky/")),
        "reset": http.add_fault("reset", 2, match=lambda m, p, r: p.startswith("/flaky/") and _data_range(m, p, r)),
        "truncate": http.add_fault("truncate", 3, match=lambda m, p, r: p.startswith("/flaky/") and _data_range(m, p, r)),
        "broken": http.add_fault("status", None, status=503, match=_under("/broken/")),
        "broken-data": http.add_fault(
            "status", None, status=503, match=lambda m, p, r: p.startswith("/broken-data/") and _data_range(m, p, r)
        ),
    }
    moto.start_recording()
    cases = _cases(world, servers)
    start = time.monotonic()
    per_rank = run_ranks(world, _run_cases, cases, servers["references"], timeout=300)
    elapsed = time.monotonic() - start
    moto.stop_recording()
    return {
        "world": world,
        "cases": {c["name"]: c for c in cases},
        "per_rank": per_rank,
        "elapsed": elapsed,
        "s3_log": moto.recording(),
        "http_log": http.requests(faults=True),
        "hub_log": hub.requests(faults=True),
        "faults": {name: fault.hits for name, fault in faults.items()},
        "shas": servers["shas"],
    }


def _rank_of(user_agent: str) -> int | None:
    """The rank a request came from: ``rank/N`` in its User-Agent (ours, botocore's, the Hub's)."""
    m = re.search(r"\brank/(\d+)", user_agent)
    return int(m.group(1)) if m else None


def _loaded(results: dict) -> list[str]:
    return [name for name, r in results["per_rank"][0].items() if "error" not in r]


# -- tests -----------------------------------------------------------------------------------------


def test_every_parameter_equals_from_pretrained(results) -> None:
    expected = {"s3-tp", "s3-ep"} if results["world"] == 4 else {
        "s3-tp", "s3-ep", "http-tp", "http-flaky", "hub-main", "hub-v1-ep", "hub-main-again"}
    assert {n.rstrip("24") for n in _loaded(results)} == expected
    for rank, r in enumerate(results["per_rank"]):
        for name in _loaded(results):
            assert r[name]["bad"] == [], (rank, name)
    print(f"\nworld {results['world']}: {len(results['cases'])} cases in {results['elapsed']:.1f} s "
          f"(spawn included); per case on rank 0: "
          + ", ".join(f"{n} {r.get('elapsed', 0):.2f}s" for n, r in results["per_rank"][0].items()))


def test_each_rank_reads_exactly_its_bytes_and_only_rank0_reads_metadata(results) -> None:
    for name in _loaded(results):
        for rank, r in enumerate(results["per_rank"]):
            case = r[name]
            assert case["bytes_read"] == case["bytes_needed"] == case["plan_bytes"] > 0, (name, rank, case)
            if rank:
                assert case["header_requests"] == case["header_bytes"] == 0, (name, rank)
            else:
                assert case["header_requests"] > 0, name


def test_s3_server_saw_only_ranged_gets_for_needed_bytes(results) -> None:
    world = results["world"]
    figures = []
    for name in (f"s3-tp{world}", f"s3-ep{world}"):
        key_prefix = results["cases"][name]["path"].removeprefix(f"s3://{BUCKET}/")  # mixtral/tpN
        log = [
            r for r in results["s3_log"]
            if r.path.startswith(f"/{BUCKET}/{key_prefix}") or f"prefix={key_prefix}" in unquote(r.query)
        ]
        by_rank = {rank: [r for r in log if _rank_of(r.user_agent) == rank] for rank in range(world)}
        assert sum(map(len, by_rank.values())) == len(log)  # every request is labelled with its rank
        for rank, requests in by_rank.items():
            stats = results["per_rank"][rank][name]
            gets = [r for r in requests if r.method == "GET" and not r.query]
            assert all(r.nbytes is not None for r in gets), (name, rank)  # object GETs are all ranged
            assert sum(r.nbytes for r in gets) == stats["bytes_read"] + stats["header_bytes"], (name, rank)
            assert len(gets) == stats["requests"] + stats["header_requests"], (name, rank)
            if rank:  # no listing, no HEAD, no header or index read
                assert len(gets) == len(requests), (name, rank, {(r.method, r.query) for r in requests})
                assert all(r.path.endswith(".safetensors") for r in gets)
            figures.append(f"{name} rank {rank}: {len(requests)} requests, {len(gets)} ranged GETs, "
                           f"{sum(r.nbytes for r in gets)} bytes")
    print("\n" + "\n".join(figures))


def test_http_ranks_fetch_only_their_ranges(results2) -> None:
    results = results2
    for name, prefix in (("http-tp", "/ok/"), ("http-flaky", "/flaky/")):
        log = [r for r in results["http_log"] if r.path.startswith(prefix)]
        for rank in range(2):
            stats = results["per_rank"][rank][name]
            mine = [r for r in log if _rank_of(r.user_agent) == rank]
            served = [r for r in mine if r.method == "GET" and r.fault is None]
            cut = sum(r.body_bytes for r in mine if r.fault == "truncate")
            assert all(r.status == 206 for r in served)
            assert sum(r.body_bytes for r in served) + cut == stats["bytes_read"] + stats["header_bytes"], (name, rank)
            if rank:
                assert all(r.method == "GET" and r.path.endswith(".safetensors") for r in mine), (name, rank)
    assert results["faults"]["503"] == 3 and results["faults"]["reset"] == 2 and results["faults"]["truncate"] == 3


def test_hub_ranks_read_the_commit_rank0_resolved(results2) -> None:
    results = results2
    shas, log = results["shas"], results["hub_log"]
    api = [r for r in log if r.path.startswith("/api/")]
    assert api and all(_rank_of(r.user_agent) == 0 for r in api)  # no metadata request from rank 1
    resolves = [r for r in log if "/resolve/" in r.path]
    assert {_rank_of(r.user_agent) for r in resolves} == {0, 1}
    assert all(r.path.split("/")[4] in (shas["a"], shas["b"]) and r.range for r in resolves)
    for name, sha in (("hub-main", shas["a"]), ("hub-v1-ep", shas["a"]), ("hub-main-again", shas["b"])):
        assert [r[name]["root"] for r in results["per_rank"]] == [f"org/mix@{sha}"] * 2, name
    # main moved to b during "hub-main" (at rank 0's listing, before any rank read data), yet rank 1
    # went on reading a (and values equal a's, above) until the next load resolved main again.
    moved = min(i for i, r in enumerate(log) if "/tree/" in r.path)
    first_b = min(i for i, r in enumerate(log) if shas["b"] in r.path)
    assert moved < first_b
    after_move = [r for r in log[moved:first_b] if "/resolve/" in r.path and _rank_of(r.user_agent) == 1]
    assert after_move and all(shas["a"] in r.path for r in after_move)


def test_persistent_failures_raise_the_same_clear_error_on_every_rank(results2) -> None:
    results = results2
    per_rank = results["per_rank"]
    for name, pattern in (
        ("http-broken", "giving up.*HTTP 503"),
        ("http-broken-data", "giving up.*HTTP 503"),
        ("http-norange", "ignored the Range header"),
    ):
        errors = [r[name] for r in per_rank]
        assert all(e.get("error") == StorageReadError.__name__ for e in errors), (name, errors)
        # Rank 0's error, broadcast (metadata) or gathered by DCP (data): the same text on every rank.
        assert errors[1]["message"].replace("on rank 0: ", "") == errors[0]["message"], name
        assert all(e["elapsed"] < 8 for e in errors), name  # bounded time, no hang
        assert re.search(pattern, errors[0]["message"]), (name, errors[0]["message"])
    assert results["faults"]["broken"] == FAST["attempts"]  # rank 0 alone tried the index; rank 1 none
    data_faults = [r for r in results["http_log"] if r.path.startswith("/broken-data/") and r.fault]
    assert {_rank_of(r.user_agent) for r in data_faults} == {0, 1}

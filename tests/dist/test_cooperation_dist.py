"""Span ownership on 4 gloo ranks: every needed checkpoint byte is read by one rank, and the ranks
exchange the raw bytes each needs; the parameters are bit-identical to the direct load and to
transformers.

Layouts: ``dp=2,tp=2`` (FSDP2 over TP: ``_StridedShard`` rows, norms replicated over ``tp``),
``dp_replicate=2,tp=2`` (HSDP x TP: two replicas of every row- and column-parallel shard), ``ep=4``
(experts split over the ranks), the MoE with rewrites (fused qkv, stacked experts), all from bf16
checkpoints into float32 models, and an FP8 block-scaled checkpoint dequantized on the receiving
ranks. Small spans (``span_bytes=4096``) make every rank an owner; the defaults are checked too,
on local files and on the test S3 and HTTP servers, by their own logs. A read failing on one
owner, the exchange failing, and a rank dying mid-exchange make every rank raise a typed error.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from hp_dcp_hf.tools.launch import _context, free_port, run_ranks
from tests.support.families import family_model_class, load_family_reference
from tests.support.models import load_reference
from tests.support.quantized import make_fp8_checkpoint

CASES = {  # name -> (checkpoint, transforms, mesh, reader options)
    "llama-fsdp-tp": ("llama", (), "dp=2,tp=2", {"span_bytes": 4096}),
    "llama-hsdp-tp": ("llama", (), "dp_replicate=2,tp=2", {"span_bytes": 4096}),
    "llama-hsdp-tp-defaults": ("llama", (), "dp_replicate=2,tp=2", {}),
    "mixtral-ep": ("mixtral", (), "ep=4", {"span_bytes": 4096}),
    "mixtral-hsdp-rewritten": ("mixtral", ("fuse_qkv", "grouped_gemm_experts"), "dp_replicate=2,tp=2",
                               {"span_bytes": 4096}),
    "deepseek-fp8-fsdp-tp": ("fp8", (), "dp=2,tp=2", {"span_bytes": 4096}),
}


def _full(state: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def _load(rank: int, world: int, paths: dict) -> dict:
    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.integrations.transformers import from_pretrained

    out = {}
    for name, (checkpoint, transforms, mesh, options) in CASES.items():
        fp8 = checkpoint == "fp8"
        extra = {"model_cls": family_model_class("deepseek_v3"), "dtype": torch.bfloat16} if fp8 else {
            "dtype": torch.float32}
        states, stats = {}, {}
        for mode in ("never", "always"):
            reader = HFStorageReader(paths[checkpoint], cooperate=mode, **options)
            model, report = from_pretrained(paths[checkpoint], distributed_config=mesh, transforms=transforms,
                                            reader=reader, **extra)
            states[mode] = _full(model.state_dict())
            stats[mode] = {"read": reader.stats.total().bytes_read, "cooperating": reader.cooperating,
                           "phases": [k for k in report.seconds if k in ("metadata", "plan", "spans", "read",
                                                                          "exchange")],
                           "needed": report.plan.bytes_needed, "received": reader.exchange.bytes_received,
                           "sent": reader.exchange.bytes_sent,
                           "own": reader.spans.own_bytes if reader.spans else None,
                           "relayed": reader.spans.relay_bytes if reader.spans else None,
                           "storage": reader.spans.storage_bytes if reader.spans else None,
                           "spans": len(reader.spans.plan) if reader.spans else None}
        out[name] = {"stats": stats, "same": all(torch.equal(states["never"][k], v) for k, v in states["always"].items()),
                     "state": states["always"] if rank == 0 else None}
    out["remote"] = _remote(rank, paths)
    out["failures"] = _failures(rank, paths["llama"])
    return out


def _remote(rank: int, paths: dict[str, str]) -> dict:
    """The HSDP llama from S3 and HTTP with the default ``cooperate="auto"`` and default spans."""
    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.integrations.transformers import from_pretrained

    out = {}
    for name, options in (("s3", {"storage_options": {**paths["s3_options"], "config_kwargs": {
                               "user_agent_extra": f"rank/{rank}"}}}),
                          ("http", {"headers": {"User-Agent": f"rank/{rank}"}})):
        reader = HFStorageReader(paths[name], **options)
        model, report = from_pretrained(paths[name], dtype=torch.float32, distributed_config="dp_replicate=2,tp=2",
                                        reader=reader)
        total = reader.stats.total()
        state = _full(model.state_dict())  # collective
        out[name] = {"cooperating": reader.cooperating, "read": total.bytes_read, "requests": total.requests,
                     "needed": report.plan.bytes_needed, "own": reader.spans.own_bytes,
                     "received": reader.exchange.bytes_received, "state": state if rank == 0 else None}
    # FSDP x TP: spans would save little (norms replicated over tp), so "auto" reads directly
    reader = HFStorageReader(paths["s3_direct"], storage_options=paths["s3_options"])
    model, report = from_pretrained(paths["s3_direct"], dtype=torch.float32, distributed_config="dp=2,tp=2",
                                    reader=reader)
    total = reader.stats.total()
    state = _full(model.state_dict())
    out["s3_direct"] = {"eligible": reader.cooperates(4), "cooperating": reader.cooperating,
                        "read": total.bytes_read, "needed": report.plan.bytes_needed, "spans": reader.spans,
                        "received": reader.exchange.bytes_received, "phases": [k for k in report.seconds if k in ("spans", "exchange")],
                        "state": state if rank == 0 else None}
    return out


def _failures(rank: int, path: str) -> dict[str, str]:
    """Rank 3's planning fails, then rank 2's reads of its spans, then rank 1's exchange, then rank
    2's reads where ``cooperate="auto"`` chose direct reads after gathering the needs: what every
    rank raises, and whether its model is as it was (never half loaded)."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader
    from hp_dcp_hf.errors import MappingError, StorageReadError
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.storage.read import exchange
    from hp_dcp_hf.storage.transport import fsspec_backend

    def plan_fails(self, *args):
        raise MappingError("injected planning failure")

    read_into = fsspec_backend._LocalFile.read_into

    def read_fails(self, start, buffers):  # tensor data only: config.json reads as before
        if self.file.endswith(".safetensors"):
            raise StorageReadError("injected read failure", file=self.file)
        read_into(self, start, buffers)

    def take_fails(self, out, nbytes):
        raise RuntimeError("injected exchange failure")

    cooperating = {"cooperate": "always", "span_bytes": 4096}
    outcomes = {}
    for name, rank_failing, cls, method, broken, options, mesh in (
        ("plan", 3, HFMappingPlanner, "_validate", plan_fails, cooperating, "dp_replicate=2,tp=2"),
        ("read", 2, fsspec_backend._LocalFile, "read_into", read_fails, cooperating, "dp_replicate=2,tp=2"),
        ("exchange", 1, exchange.Stream, "take_into", take_fails, cooperating, "dp_replicate=2,tp=2"),
        # the local files taken for shared storage, read with preadv (read_into, not mappings) and
        # coalesced as on a remote store: spans would save too little here
        ("auto-direct-read", 2, fsspec_backend._LocalFile, "read_into", read_fails,
         {"cooperate": "auto", "map_local_files": False, "coalesce_gap": 2**20}, "dp=2,tp=2"),
    ):
        real = cls.__dict__[method]  # as defined (a staticmethod stays one when put back)
        shared = HFStorageReader.__dict__["cooperates"]
        if rank == rank_failing:
            setattr(cls, method, broken)
        if options["cooperate"] == "auto":
            HFStorageReader.cooperates = lambda self, world_size: world_size > 1
        reader = HFStorageReader(path, **options)
        try:
            from_pretrained(path, dtype=torch.float32, distributed_config=mesh, reader=reader)
            outcomes[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test checks the type
            outcomes[name] = f"{type(e).__name__}: {e}"
        finally:
            setattr(cls, method, real)
            HFStorageReader.cooperates = shared
        outcomes[f"{name} cooperating"] = reader.cooperating
    return outcomes


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    from tests.support.servers.range_server import StaticRangeServer
    from tests.support.servers.s3 import MotoS3

    llama = tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)
    mixtral = tiny_checkpoints("mixtral", torch.bfloat16, intermediate_size=48)
    fp8 = make_fp8_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8"))
    moto = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    http = StaticRangeServer(llama.path)
    try:
        moto.create_bucket("cooperation")
        moto.upload_dir(llama.path, "cooperation", "llama")
        moto.upload_dir(llama.path, "cooperation", "llama-fsdp-tp")
        paths = {"llama": str(llama.path), "mixtral": str(mixtral.path), "fp8": str(fp8.path),
                 "s3": "s3://cooperation/llama", "s3_direct": "s3://cooperation/llama-fsdp-tp",
                 "s3_options": moto.storage_options(), "http": http.url}
        moto.start_recording()
        per_rank = run_ranks(4, _load, paths, timeout=400)
        moto.stop_recording()
        logs = {"s3": moto.recording(), "http": list(http.log)}
    finally:
        moto.stop()
        http.stop()
    return per_rank, paths, logs, fp8


def _tensor_bytes(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
    return total


def _reference(case: str, paths: dict, fp8) -> dict[str, torch.Tensor]:
    checkpoint = CASES[case][0]
    if checkpoint == "fp8":
        return load_family_reference(fp8.twin, "deepseek_v3", torch.bfloat16)
    return load_reference(paths[checkpoint], checkpoint, torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_each_needed_byte_is_read_once_and_the_values_are_the_direct_loads(run, case):
    per_rank, paths, _, fp8 = run
    checkpoint, transforms = CASES[case][:2]
    results = [r[case] for r in per_rank]
    assert all(r["same"] for r in results)  # bit-identical to the direct load on every rank
    reference = _reference(case, paths, fp8)
    state = results[0]["state"]
    compared = [key for key in state if key in reference]  # rewritten ones: equal to the direct load above
    assert len(compared) == len(state) if not transforms else len(compared) >= len(state) // 2
    assert not [key for key in compared if not torch.equal(state[key], reference[key])]
    direct = [r["stats"]["never"] for r in results]
    shared = [r["stats"]["always"] for r in results]
    assert not any(s["cooperating"] for s in direct) and all(s["cooperating"] for s in shared)
    assert all(s["phases"] == ["metadata", "plan", "read"] for s in direct), [s["phases"] for s in direct]
    assert all(s["phases"] == ["metadata", "plan", "spans", "read", "exchange"] for s in shared)
    # Every tensor is needed by some rank: over the cluster, each tensor byte is read exactly once.
    assert sum(s["read"] for s in shared) == sum(s["storage"] for s in shared) == _tensor_bytes(paths[checkpoint])
    if "tp" in CASES[case][2]:  # replicated norms (and HSDP copies): direct reads read them on several ranks
        assert sum(s["read"] for s in direct) > sum(s["read"] for s in shared)
    else:  # FSDP and EP alone: every byte is some one rank's, as direct reads have it already
        assert sum(s["read"] for s in direct) == sum(s["read"] for s in shared)
    for s in shared:  # a rank receives exactly the bytes it needs and did not read itself
        assert s["received"] + s["own"] == s["needed"] and s["own"] <= s["storage"]
    assert sum(s["sent"] for s in shared) == sum(s["received"] for s in shared)
    if "dp_replicate" in CASES[case][2]:  # replicas are twins: bytes of others' spans go down a chain of them
        assert sum(s["relayed"] for s in shared) > 0
    if "span_bytes" in CASES[case][3]:
        assert all(s["storage"] > 0 for s in shared)  # small spans: every rank owns some
        assert all(s["spans"] >= 8 for s in shared)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_remote_servers_serve_each_needed_byte_once(run, store):
    """From the servers' own logs: the GETs of tensor data (those past each file's header) add up to
    the checkpoint's tensor bytes once, and the loads equal transformers'."""
    per_rank, paths, logs, _ = run
    results = [r["remote"][store] for r in per_rank]
    assert all(r["cooperating"] for r in results)  # the default, auto, cooperates on remote stores
    data_start = _data_starts(paths["llama"])
    if store == "s3":
        gets = _s3_gets(logs["s3"], "/llama/")
    else:
        gets = [(r.path.rsplit("/", 1)[-1], r.span[0], r.body_bytes)
                for r in logs["http"] if r.method == "GET" and r.path.endswith(".safetensors")]
    data = [nbytes for file, start, nbytes in gets if start >= data_start[f"/{file}"]]  # not header reads
    tensor_bytes = _tensor_bytes(paths["llama"])
    assert sum(r["read"] for r in results) == tensor_bytes  # each byte once over the cluster
    assert sum(data) == tensor_bytes  # the server agrees
    assert len(data) == sum(r["requests"] for r in results)
    for r in results:
        assert r["received"] + r["own"] == r["needed"]
    reference = load_reference(paths["llama"], "llama", torch.float32)
    for key, value in results[0]["state"].items():
        assert torch.equal(value, reference[key]), key


def test_auto_reads_directly_where_spans_would_save_little(run):
    """FSDP x TP from S3 with the default ``cooperate="auto"``: the ranks gather their needs and plan
    the spans, which would save only the norms' second reads, so each rank reads its own items,
    exchanging nothing; the server sends what they read, and the values are transformers'."""
    per_rank, paths, logs, _ = run
    results = [r["remote"]["s3_direct"] for r in per_rank]
    assert all(r["eligible"] and not r["cooperating"] for r in results)
    assert all(r["spans"] is None and r["received"] == 0 for r in results)
    assert all(r["phases"] == ["spans"] for r in results)  # needs gathered and spans planned; no exchange
    assert all(r["read"] >= r["needed"] for r in results)
    data_start = _data_starts(paths["llama"])
    data = [nbytes for file, start, nbytes in _s3_gets(logs["s3"], "/llama-fsdp-tp/") if start >= data_start[f"/{file}"]]
    assert sum(data) == sum(r["read"] for r in results) > _tensor_bytes(paths["llama"])  # norms read twice
    reference = load_reference(paths["llama"], "llama", torch.float32)
    for key, value in results[0]["state"].items():
        assert torch.equal(value, reference[key]), key


def _data_starts(path: str) -> dict[str, int]:
    """Each safetensors file's first tensor byte, by ``/name``: GETs from there on read tensor data."""
    return {f"/{f.name}": 8 + int.from_bytes(f.read_bytes()[:8], "little") for f in Path(path).glob("*.safetensors")}


def _s3_gets(log: list, prefix: str) -> list[tuple[str, int, int]]:
    """``(file name, first byte, bytes)`` of each ranged GET of a safetensors file under ``prefix``."""
    return [(r.path.rsplit("/", 1)[-1], int(r.range.split("=")[1].split("-")[0]), r.nbytes)
            for r in log if r.method == "GET" and r.path.endswith(".safetensors") and prefix in r.path]


def test_a_rank_failing_to_plan_or_mid_read_or_mid_exchange_fails_every_rank_with_its_error(run):
    per_rank = run[0]
    outcomes = [r["failures"] for r in per_rank]
    assert all(o["plan"].startswith("MappingError") and "injected planning failure" in o["plan"] for o in outcomes)
    assert all(o["read"].startswith("StorageReadError") and "injected read failure" in o["read"] for o in outcomes)
    assert all(o["exchange"].startswith("StorageReadError") and "injected exchange failure" in o["exchange"]
               for o in outcomes), outcomes
    # auto gathered the needs, chose direct reads, and rank 2's failure still reached every rank
    auto = [(o["auto-direct-read"], o["auto-direct-read cooperating"]) for o in outcomes]
    assert all(not cooperating for _, cooperating in auto), auto
    assert all(error.startswith("StorageReadError") and "injected read failure" in error for error, _ in auto), auto


def _dying_rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Rank 3 dies (``os._exit``) as the first bytes reach it; the others write what they raised."""
    import torch.distributed as dist

    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.storage.read import exchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 3:
        put = exchange.Stream.put

        def die(self, data):
            if data.numel():
                os._exit(3)
            put(self, data)

        exchange.Stream.put = die
    start = time.monotonic()
    try:
        from_pretrained(path, dtype=torch.float32, distributed_config="dp_replicate=2,tp=2",
                        reader=HFStorageReader(path, cooperate="always", span_bytes=4096))
        outcome = "loaded"
    except Exception as e:  # noqa: BLE001 - the test checks the type
        outcome = f"{type(e).__name__}: {e}"
    Path(out, f"{rank}.json").write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start}))
    os._exit(0)  # the group cannot be torn down with a peer gone


def test_a_rank_dying_mid_exchange_fails_every_other_rank_with_a_typed_error(tiny_checkpoints, tmp_path):
    llama = tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)
    ctx, port = _context(), free_port()
    procs = [ctx.Process(target=_dying_rank, args=(rank, 4, port, str(llama.path), str(tmp_path)))
             for rank in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)  # a bound against a hang
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert not alive, f"ranks {alive} hung after rank 3 died"
    assert [p.exitcode for p in procs] == [0, 0, 0, 3]
    outcomes = [json.loads(Path(tmp_path, f"{rank}.json").read_text())["outcome"] for rank in range(3)]
    assert all(o.startswith("StorageReadError") and "did a rank leave the load?" in o for o in outcomes), outcomes


def _overlap(rank: int, world: int) -> dict:
    """Two spans per rank; this rank reads span 0 first and span 1 only once the peer's bytes of
    span 0 have arrived: the exchange must send what is read while the reads go on."""
    import threading

    from hp_dcp_hf.storage.read.exchange import ReadProgress, Region, Stream, exchange

    peer = 1 - rank
    spans = {s: torch.full((8,), 10 * rank + s, dtype=torch.uint8) for s in (0, 1)}
    received = {s: torch.zeros(8, dtype=torch.uint8) for s in (0, 1)}
    moved: list[tuple[int, int]] = []
    progress = ReadProgress()
    regions = [Region(span, offset, 4) for span in (0, 1) for offset in (0, 4)]  # whole regions, 4 a round
    sends = [Stream(regions, lambda r: spans[r.key], lambda r: None, lambda r: progress.ready(r.key)) if p == peer
             else Stream([], None, None) for p in range(world)]
    receives = [Stream(regions, lambda r: received[r.key], lambda r: moved.append((r.key, r.nbytes))) if p == peer
                else Stream([], None, None) for p in range(world)]
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(stats=exchange(sends, receives, 4, progress)))
    thread.start()
    progress.read(0)
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing assertion
    while sum(n for k, n in list(moved) if k == 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    span0_first = sum(n for k, n in list(moved) if k == 0) == 8 and not any(k == 1 for k, _ in list(moved))
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(f"looked-{rank}", "1")
    store.wait([f"looked-{peer}"])
    progress.read(1)
    progress.finish(None)
    thread.join()
    return {"span0_first": span0_first, "received": {s: t.tolist() for s, t in received.items()},
            "bytes": outcome["stats"].bytes_received, "rounds": outcome["stats"].rounds}


def test_the_exchange_sends_what_is_read_while_reads_go_on_in_bounded_rounds():
    for rank, result in enumerate(run_ranks(2, _overlap, timeout=120)):
        peer = 1 - rank
        assert result["span0_first"], rank
        assert result["received"] == {0: [10 * peer] * 8, 1: [10 * peer + 1] * 8}
        assert result["bytes"] == 16 and result["rounds"] >= 4  # 4 bytes a round to the one peer


def _four_replicas(rank: int, world: int, path: str) -> dict:
    """HSDP with four replicas over ``tp=2``: chains of four twins (forwarded twice and more)."""
    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.integrations.transformers import from_pretrained

    states, out = {}, {}
    for mode in ("never", "always"):
        reader = HFStorageReader(path, cooperate=mode, span_bytes=4096)
        model, report = from_pretrained(path, dtype=torch.float32, distributed_config="dp_replicate=4,tp=2",
                                        reader=reader)
        states[mode] = _full(model.state_dict())
        out[mode] = {"read": reader.stats.total().bytes_read, "needed": report.plan.bytes_needed,
                     "received": reader.exchange.bytes_received, "sent": reader.exchange.bytes_sent,
                     "own": reader.spans.own_bytes if reader.spans else None,
                     "relayed": reader.spans.relay_bytes if reader.spans else None}
    out["same"] = all(torch.equal(states["never"][k], v) for k, v in states["always"].items())
    return out


def test_four_replicas_relay_down_their_chain_and_load_the_direct_values(tiny_checkpoints):
    llama = tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)
    results = run_ranks(8, _four_replicas, str(llama.path), timeout=400)
    assert all(r["same"] for r in results)
    shared = [r["always"] for r in results]
    assert sum(s["read"] for s in shared) == _tensor_bytes(str(llama.path))  # each byte read once
    for s in shared:
        assert s["received"] + s["own"] == s["needed"]
    assert sum(s["sent"] for s in shared) == sum(s["received"] for s in shared)
    assert sum(s["relayed"] for s in shared) > 0


def _landing(rank: int, world: int, path: str) -> dict:
    """bf16 into bf16 on ``dp=2,tp=2``: chunks take the file's bytes as stored, so the spans a rank
    alone needs are read straight into its parameters; direct reads of the same load as reference."""
    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.integrations.transformers import from_pretrained

    states, out = {}, {}
    for mode, options in (("never", {}), ("always", {"span_bytes": 4096}), ("always-direct-io", {
            "span_bytes": 4096, "direct_io": True})):
        reader = HFStorageReader(path, cooperate=mode.removesuffix("-direct-io"), **options)
        model, report = from_pretrained(path, dtype=torch.bfloat16, distributed_config="dp=2,tp=2", reader=reader)
        states[mode] = _full(model.state_dict())
        out[mode] = {"read": reader.stats.total().bytes_read, "needed": report.plan.bytes_needed,
                     "received": reader.exchange.bytes_received,
                     "own": reader.spans.own_bytes if reader.spans else None,
                     "landed": reader.spans.landed_bytes if reader.spans else None}
    out["same"] = [all(torch.equal(states["never"][k], v) for k, v in states[mode].items())
                   for mode in ("always", "always-direct-io")]
    return out


def test_spans_a_rank_alone_needs_land_in_its_parameters(tiny_checkpoints):
    # MLP rows of 2 MiB a rank: stretches one rank alone needs are spans of their own (1 MiB and more)
    llama = tiny_checkpoints("llama", torch.bfloat16, hidden_size=512, intermediate_size=4096)
    results = run_ranks(4, _landing, str(llama.path), timeout=400)
    assert all(r["same"] == [True, True] for r in results)  # bit-identical to the direct load
    shared = [r["always"] for r in results]
    assert sum(s["read"] for s in shared) == _tensor_bytes(str(llama.path))  # each byte read once
    for s in shared:
        assert s["received"] + s["own"] == s["needed"]
        assert 2**20 < s["landed"] <= s["own"]  # every rank alone needs spans of MLP rows
    # O_DIRECT reads need aligned buffers: spans are read whole into their own, and copied out
    assert all(r["always-direct-io"]["landed"] == 0 for r in results)

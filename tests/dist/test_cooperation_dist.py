"""Cooperative loads on 4 gloo ranks: replicas read each shared byte once and send each other their
slices; the parameters are bit-identical to the direct load and to transformers.

Layouts: ``dp=2,tp=2`` (FSDP2 over TP: ``_StridedShard`` weights are unique to a rank, the norms
are replicated over ``tp``), ``dp_replicate=2,tp=2`` (HSDP: two replicas of every TP shard, the
norms on all four ranks) and the MoE with rewrites. Over the ranks, the bytes read from storage
equal the checkpoint's tensor bytes exactly (``coalesce_gap=0``: each needed byte once; every
tensor is needed); each rank receives exactly the slices it planned not to read. A rank failing
mid-read or mid-exchange makes every rank raise the same typed error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hp_dcp_hf.launch import run_ranks
from tests.models import load_reference

CASES = {  # name -> (checkpoint, transforms, mesh)
    "llama-fsdp-tp": ("llama", (), "dp=2,tp=2"),
    "llama-hsdp": ("llama", (), "dp_replicate=2,tp=2"),
    "mixtral-hsdp-rewritten": ("mixtral", ("fuse_qkv", "grouped_gemm_experts"), "dp_replicate=2,tp=2"),
}


def _load(rank: int, world: int, paths: dict[str, str]) -> dict:
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.pipeline import from_pretrained

    out = {}
    for name, (checkpoint, transforms, mesh) in CASES.items():
        states, stats = {}, {}
        for mode in ("never", "always"):
            reader = HFStorageReader(paths[checkpoint], replicas=mode, coalesce_gap=0)
            model, report = from_pretrained(paths[checkpoint], dtype=torch.float32, distributed_config=mesh, transforms=transforms,
                                            reader=reader)
            states[mode] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
            stats[mode] = {"read": reader.stats.total().bytes_read, "cooperating": reader.cooperating,
                           "phases": [k for k in report.seconds if k in ("metadata", "plan", "read", "exchange")],
                           "received": reader.exchange.bytes_received, "sent": reader.exchange.bytes_sent,
                           "planned_in": report.plan.peer_bytes_in, "planned_out": report.plan.peer_bytes_out,
                           "shared": report.plan.shared_targets}
        out[name] = {"stats": stats, "same": all(torch.equal(states["never"][k], v) for k, v in states["always"].items()),
                     "state": states["always"] if rank == 0 else None}
    out["remote"] = _remote(rank, paths)
    out["failures"] = _failures(rank, paths["llama"])
    return out


def _remote(rank: int, paths: dict[str, str]) -> dict:
    """The HSDP llama from S3 and HTTP with the default ``replicas="auto"``: cooperative there."""
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.pipeline import from_pretrained

    out = {}
    for name, options in (("s3", {"storage_options": {**paths["s3_options"], "config_kwargs": {
                               "user_agent_extra": f"rank/{rank}"}}}),
                          ("http", {"headers": {"User-Agent": f"rank/{rank}"}})):
        reader = HFStorageReader(paths[name], coalesce_gap=0, **options)
        model, _ = from_pretrained(paths[name], dtype=torch.float32, distributed_config="dp_replicate=2,tp=2", reader=reader)
        total = reader.stats.total()
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}  # collective
        out[name] = {"cooperating": reader.cooperating, "read": total.bytes_read,
                     "requests": total.requests, "state": state if rank == 0 else None}
    return out


def _failures(rank: int, path: str) -> dict[str, str]:
    """Rank 3's planning fails (after the replicas found each other), then rank 2's read, then rank
    1's exchange: what every rank raises."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader
    from hp_dcp_hf.errors import MappingError, StorageReadError
    from hp_dcp_hf.parallel import cooperation
    from hp_dcp_hf.pipeline import from_pretrained

    def plan_fails(self, *args):
        raise MappingError("injected planning failure")

    def read_fails(self, plan, planner):
        raise StorageReadError("injected read failure", file="model.safetensors")

    def take_fails(self, nbytes):
        raise RuntimeError("injected exchange failure")

    outcomes = {}
    for name, rank_failing, cls, method, broken in (
        ("plan", 3, HFMappingPlanner, "_validate", plan_fails),
        ("read", 2, HFStorageReader, "_read_data", read_fails),
        ("exchange", 1, cooperation._Stream, "take", take_fails),
    ):
        real = getattr(cls, method)
        if rank == rank_failing:
            setattr(cls, method, broken)
        try:
            from_pretrained(path, dtype=torch.float32, distributed_config="dp_replicate=2,tp=2", reader=HFStorageReader(path, replicas="always"))
            outcomes[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test checks the type
            outcomes[name] = f"{type(e).__name__}: {e}"
        finally:
            setattr(cls, method, real)
    return outcomes


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    from tests.servers.range_server import StaticRangeServer
    from tests.servers.s3 import MotoS3

    llama = tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)
    mixtral = tiny_checkpoints("mixtral", torch.bfloat16, intermediate_size=48)
    moto = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    http = StaticRangeServer(llama.path)
    try:
        moto.create_bucket("cooperation")
        moto.upload_dir(llama.path, "cooperation", "llama")
        paths = {"llama": str(llama.path), "mixtral": str(mixtral.path), "s3": "s3://cooperation/llama",
                 "s3_options": moto.storage_options(), "http": http.url}
        moto.start_recording()
        per_rank = run_ranks(4, _load, paths, timeout=400)
        moto.stop_recording()
        logs = {"s3": moto.recording(), "http": list(http.log)}
    finally:
        moto.stop()
        http.stop()
    return per_rank, paths, logs


def _tensor_bytes(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_read_each_byte_once_and_load_the_same_values(run, case):
    per_rank, paths, _ = run
    checkpoint = CASES[case][0]
    results = [r[case] for r in per_rank]
    assert all(r["same"] for r in results)  # bit-identical to the direct load on every rank
    reference = load_reference(paths[checkpoint], checkpoint, torch.float32)
    state = results[0]["state"]
    compared = [key for key in state if key in reference]  # rewritten ones: equal to the direct load above
    assert len(compared) >= len(state) // 2
    for key in compared:
        assert torch.equal(state[key], reference[key]), key
    direct = [r["stats"]["never"] for r in results]
    shared = [r["stats"]["always"] for r in results]
    assert not any(s["cooperating"] for s in direct) and all(s["cooperating"] for s in shared)
    assert all(s["phases"] == ["metadata", "plan", "read"] for s in direct), [s["phases"] for s in direct]
    assert all(s["phases"] == ["metadata", "plan", "read", "exchange"] for s in shared)
    assert sum(s["read"] for s in shared) == _tensor_bytes(paths[checkpoint])  # each byte once
    assert sum(s["read"] for s in direct) > sum(s["read"] for s in shared)
    for s in shared:  # each rank receives exactly the slices it did not read, and sends its own
        assert s["shared"] > 0 and s["received"] == s["planned_in"] and s["sent"] == s["planned_out"]
    assert sum(s["sent"] for s in shared) == sum(s["received"] for s in shared)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_remote_servers_serve_each_needed_byte_once(run, store):
    """From the servers' own logs: the GETs of tensor data (those past each file's header) add up to
    the checkpoint's tensor bytes once, and the loads equal transformers'."""
    per_rank, paths, logs = run
    results = [r["remote"][store] for r in per_rank]
    assert all(r["cooperating"] for r in results)
    data_start = {f"/{f.name}": 8 + int.from_bytes(f.read_bytes()[:8], "little")
                  for f in Path(paths["llama"]).glob("*.safetensors")}
    if store == "s3":
        spans = [(r.path.rsplit("/", 1)[-1], int(r.range.split("=")[1].split("-")[0]), r.nbytes)
                 for r in logs["s3"] if r.method == "GET" and r.path.endswith(".safetensors")]
    else:
        spans = [(r.path.rsplit("/", 1)[-1], r.span[0], r.body_bytes)
                 for r in logs["http"] if r.method == "GET" and r.path.endswith(".safetensors")]
    data = [nbytes for file, start, nbytes in spans if start >= data_start[f"/{file}"]]  # not header reads
    tensor_bytes = _tensor_bytes(paths["llama"])
    assert sum(r["read"] for r in results) == tensor_bytes  # each byte once over the cluster
    assert sum(data) == tensor_bytes  # the server agrees
    assert len(data) == sum(r["requests"] for r in results)
    reference = load_reference(paths["llama"], "llama", torch.float32)
    for key, value in results[0]["state"].items():
        assert torch.equal(value, reference[key]), key


def test_a_rank_failing_to_plan_or_mid_read_or_mid_exchange_fails_every_rank_with_its_error(run):
    per_rank, _, _ = run
    outcomes = [r["failures"] for r in per_rank]
    assert all(o["plan"].startswith("MappingError") and "injected planning failure" in o["plan"] for o in outcomes)
    assert all(o["read"].startswith("StorageReadError") and "injected read failure" in o["read"] for o in outcomes)
    assert all(o["exchange"].startswith("StorageReadError") and "injected exchange failure" in o["exchange"]
               for o in outcomes), outcomes


def _overlap(rank: int, world: int) -> dict:
    """Two shared tensors; this rank's reads finish ``a`` first and ``b`` only once the replica's
    slice of ``a`` has arrived: the exchange must send finished tensors while reads go on."""
    import threading
    import time

    from hp_dcp_hf.parallel.cooperation import ReadProgress, SharedTarget, share_slices

    tensors = {key: torch.full((6, 5), -1.0) for key in ("a", "b")}
    targets = [SharedTarget(key, t, (0, 1)) for key, t in tensors.items()]
    progress = ReadProgress()
    for target in targets:
        progress.expect(target.key, 1)
        target.local.view(-1)[slice(*target.elements(rank))] = rank + (10 if target.key == "b" else 0)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(stats=share_slices(targets, 2**20, progress)))
    thread.start()
    progress.complete("a")
    peer = 1 - rank
    lo, hi = targets[0].elements(peer)
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing assertion
    while not bool((tensors["a"].view(-1)[lo:hi] == peer).all()) and time.monotonic() < deadline:
        time.sleep(0.01)
    a_before_b = bool((tensors["a"].view(-1)[lo:hi] == peer).all())
    b_untouched = bool((tensors["b"].view(-1)[slice(*targets[1].elements(peer))] == -1).all())
    # Both ranks have looked before either completes b: otherwise the replica, having seen a,
    # may legitimately send its b before this rank looks.
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(f"looked-{rank}", "1")
    store.wait([f"looked-{peer}"])
    progress.complete("b")
    progress.finish(None)
    thread.join()
    return {"a_before_b": a_before_b, "b_untouched_then": b_untouched,
            "a": tensors["a"].view(-1).tolist(), "b": tensors["b"].view(-1).tolist(),
            "received": outcome["stats"].bytes_received}


def test_the_exchange_sends_what_is_final_while_reads_go_on():
    for rank, result in enumerate(run_ranks(2, _overlap, timeout=120)):
        assert result["a_before_b"] and result["b_untouched_then"], rank
        assert result["a"] == [0.0] * 15 + [1.0] * 15 and result["b"] == [10.0] * 15 + [11.0] * 15
        assert result["received"] == 2 * 15 * 4  # the replica's halves of a and b, nothing else

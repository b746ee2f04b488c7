"""The weight sync without an engine: trainer ranks send, in-process workers receive, every byte once.

Trainers on 2 and 4 gloo ranks load a tiny checkpoint (fused qkv / gate-up under transformers' TP
and FSDP2 x TP plans; a MoE with grouped experts under EP x TP; a non-contiguous ``_StridedShard``),
then send it to workers in the test process twice: the loaded weights, and the weights after a
"training step" that changes one layer. Workers consume either every tensor (one worker) or half of
every matrix's rows (two workers, as a TP engine would). Oracle: the checkpoint's own tensors read
with safetensors (and the changed layer computed from them): every needed box bit-identical; the
bytes counted on both sides equal the bytes the workers need; a delta update sends only the changed
tensors' bytes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hp_dcp_hf.errors import SyncError, VerificationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import make_checkpoint, read_checkpoint

CHANGED = "model.layers.0.self_attn."  # the "training step" adds 1 to this layer's attention


def _parallelize(case: str, world: int):
    from hp_dcp_hf.parallel.plans import TransformersPlans
    from tests.support.layouts import apply_layout

    if case in ("tp", "fsdp_tp", "ep"):
        spec = {"tp": "tp=2", "fsdp_tp": "dp=2,tp=2", "ep": "ep=4"}[case]
        return TransformersPlans(spec, warn=False)
    return lambda model: apply_layout(model, case, world)


def _trainer(rank: int, world: int, path: str, model_type: str, case: str, rendezvous: str, delta: bool,
             bucket_bytes: int, fail: str) -> dict:
    from hp_dcp_hf.geometry.shards import local_tensor
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.sync.sender import WeightSender
    from hp_dcp_hf.sync.source import HFWeightSource
    from hp_dcp_hf.sync.wire import tensors_json

    transforms = ("fuse_qkv", "fuse_gate_up") if model_type == "llama" else ("grouped_gemm_experts",)
    model, _ = from_pretrained(path, dtype=torch.float32, transforms=transforms,
                               parallelize=_parallelize(case, world))
    source = HFWeightSource(model)
    sender = WeightSender(source, timeout_s=20, delta=delta, bucket_bytes=bucket_bytes)
    if rank == 0:
        meta = {"trainers": sender.addresses, "tensors": tensors_json(source.metadata())}
        Path(rendezvous, "trainers.json.tmp").write_text(json.dumps(meta))
        os.replace(Path(rendezvous, "trainers.json.tmp"), Path(rendezvous, "trainers.json"))
    sender.accept()
    first = sender.send(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if CHANGED.removeprefix("model.") in name:  # the model's names: fused qkv_proj, o_proj
                local_tensor(param).add_(1.0)
    if fail == "trainer" and rank == world - 1:
        os._exit(3)  # dies without a word: its sockets close with the process
    if fail == "worker":  # the engine's worker is gone: every rank must say so, not hang
        try:
            sender.send(2)
        except SyncError as error:
            return {"error": str(error)}
        return {"error": None}
    second = sender.send(2)
    held = source.held_bytes
    return {"first": first.bytes_sent, "second": second.bytes_sent, "held": held,
            "unchanged": second.pieces_unchanged}


def _needs(tensors: dict, workers: int, worker: int) -> dict[str, list[Box]]:
    """One worker: everything. Two: each its half of every matrix's rows, vectors whole."""
    needs = {}
    for name, (_, shape) in tensors.items():
        if workers == 1 or len(shape) < 2:
            needs[name] = [Box.full(shape)]
        else:
            rows = -(-shape[0] // workers)
            lo, hi = min(worker * rows, shape[0]), min((worker + 1) * rows, shape[0])
            needs[name] = [Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))] if hi > lo else []
    return needs


def _workers(rendezvous: str, workers: int, results: list, corrupt: bool, die: bool) -> list[threading.Thread]:
    from hp_dcp_hf.sync.receiver import WeightReceiver
    from hp_dcp_hf.sync.source import TensorMeta
    from hp_dcp_hf.sync.wire import tensors_from_json

    def run(worker: int) -> None:
        try:
            path = Path(rendezvous, "trainers.json")
            deadline = time.monotonic() + 120
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the trainers never published their addresses")
                time.sleep(0.05)
            meta = json.loads(path.read_text())
            tensors = {m.name: (m.dtype, m.shape) for m in tensors_from_json(meta["tensors"])}
            receiver = WeightReceiver(
                [tuple(a) for a in meta["trainers"]], [TensorMeta(n, d, s) for n, (d, s) in tensors.items()],
                _needs(tensors, workers, worker), worker=worker, workers=workers, timeout_s=20, verify=True)
            if corrupt:  # one byte flipped on the way in (the wire, the worker's buffer), once
                connection = receiver._connections[-1]
                read_into, flipped = connection.read_into, []

                def flipping(view, **kwargs):
                    read_into(view, **kwargs)
                    if not flipped and kwargs.get("count", True) and view.nbytes:
                        view.cast("B")[0] ^= 0x40
                        flipped.append(True)
                connection.read_into = flipping
            got = []
            for update in (1, 2):
                if die and update == 2:  # the worker's process dies: its connections close
                    receiver.close()
                    break
                kept = receiver.receive(update)
                got.append(({k: v.clone() for k, v in kept.items()}, receiver.stats, receiver.needed_bytes))
            results.append((worker, got, receiver.needs))
        except BaseException as error:
            results.append((worker, error, None))

    return [threading.Thread(target=run, args=(w,), daemon=True) for w in range(workers)]


CASES = [  # (model type, layout, trainer ranks, engine workers)
    ("llama", "tp", 2, 1),
    ("llama", "fsdp_tp", 4, 2),
    ("llama", "strided", 2, 2),
    ("qwen3_moe", "ep", 4, 1),
]


def _run(tmp_path, model_type, case, world, workers, *, delta=False, bucket_bytes=1 << 14, fail="", corrupt=False,
         die=False):
    path = make_checkpoint(model_type, tmp_path / "ckpt", dtype=torch.float32, seed=3)
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    results: list = []
    threads = _workers(str(rendezvous), workers, results, corrupt, die)
    for thread in threads:
        thread.start()
    try:
        trainers = run_ranks(world, _trainer, str(path), model_type, case, str(rendezvous), delta, bucket_bytes,
                             fail, timeout=300)
    except BaseException as error:
        trainers = error
    for thread in threads:
        thread.join(60)
    return read_checkpoint(path), trainers, sorted(results, key=lambda r: r[0])


@pytest.mark.parametrize("model_type,case,world,workers", CASES, ids=[f"{m}-{c}-{w}x{e}" for m, c, w, e in CASES])
def test_each_worker_receives_its_slices_exactly_once(tmp_path, model_type, case, world, workers):
    reference, trainers, results = _run(tmp_path, model_type, case, world, workers)
    assert not isinstance(trainers, BaseException), trainers
    changed = {k: v + 1.0 if k.startswith(CHANGED) else v for k, v in reference.items()}
    needed = 0
    for worker, got, needs in results:
        assert not isinstance(got, BaseException), got
        for (kept, stats, needed_bytes), expected in zip(got, (reference, changed)):
            for name, boxes in needs.items():
                for box in boxes:
                    assert torch.equal(kept[name][box.slices()], expected[name][box.slices()]), (worker, name, box)
            assert stats.bytes_received == needed_bytes  # each needed byte once, nothing else
        needed += got[0][2]
    assert sum(t["first"] for t in trainers) == needed  # counted on the trainers' side too
    if workers == 1:  # one worker needs everything: each trainer rank sends exactly what it holds
        assert [t["first"] for t in trainers] == [t["held"] for t in trainers]
    assert sum(t["held"] for t in trainers) == sum(v.numel() * 4 for v in reference.values())


def test_delta_update_sends_only_what_changed(tmp_path):
    reference, trainers, results = _run(tmp_path, "llama", "tp", 2, 1, delta=True)
    assert not isinstance(trainers, BaseException), trainers
    (_, got, needs), = results
    kept, stats, _ = got[1]
    changed_bytes = sum(v.numel() * 4 for k, v in reference.items() if k.startswith(CHANGED))
    assert 0 < changed_bytes < got[0][1].bytes_received
    assert stats.bytes_received == changed_bytes == sum(t["second"] for t in trainers)
    assert stats.pieces_unchanged == sum(t["unchanged"] for t in trainers) > 0
    for name, value in reference.items():  # the kept copy stays exact
        assert torch.equal(kept[name], value + 1.0 if name.startswith(CHANGED) else value), name


def test_a_flipped_byte_is_found_and_named(tmp_path):
    _, trainers, results = _run(tmp_path, "llama", "tp", 2, 1, corrupt=True)
    (_, error, _), = results
    assert isinstance(error, VerificationError), error
    assert error.key and "box offsets" in error.reason
    assert isinstance(trainers, VerificationError) and trainers.key == error.key  # the trainers hear it too


def test_a_trainer_rank_dying_fails_the_update_everywhere(tmp_path):
    _, trainers, results = _run(tmp_path, "llama", "tp", 2, 1, fail="trainer")
    (_, error, _), = results
    assert isinstance(error, SyncError) and "trainer rank 1" in str(error), error
    assert isinstance(trainers, BaseException)


def test_an_engine_worker_dying_fails_the_update_on_every_trainer_rank(tmp_path):
    _, trainers, _ = _run(tmp_path, "llama", "tp", 2, 1, die=True, fail="worker")
    assert not isinstance(trainers, BaseException), trainers
    assert all(t["error"] and "engine worker 0" in t["error"] for t in trainers), trainers

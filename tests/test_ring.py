"""The staging ring (:mod:`hp_dcp_hf.storage.read.ring`) on CPU destinations, in one process.

CUDA destinations take the same route as a host destination that is not a plain CPU tensor: every
chunk read into a ring slot, then copied out of it. Forcing that route on CPU tensors (``_Chunk.host``
patched to ``False``) runs all of its logic but the device copies themselves, so CI covers it.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hp_dcp_hf import load_hf_checkpoint
from hp_dcp_hf.storage.read import chunks as chunks_module
from hp_dcp_hf.storage.read import direct as direct_module
from hp_dcp_hf.storage.read.reader import HFStorageReader
from hp_dcp_hf.storage.read.ring import SlotCopier, StagingRing
from tests.support.models import build_model

TENSORS = {
    "big": torch.randn(40, 33),  # 5280 bytes: cut into several chunks per slot
    "bf16": torch.randn(17, 9).to(torch.bfloat16),
    "small": torch.randn(3),
    "ids": torch.arange(7, dtype=torch.int64),
}
STAGING = dict(staging_bytes=1024, num_threads=4)  # slots of 256 bytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ring")
    save_file(TENSORS, str(path / "model.safetensors"))
    return path


def _destinations() -> dict[str, torch.Tensor]:
    """Every kind of destination: strided (a transpose), cast (bf16 -> fp32), contiguous as stored."""
    return {
        "big": torch.zeros(33, 40).t(),
        "bf16": torch.zeros(17, 9, dtype=torch.float32),
        "small": torch.zeros(3),
        "ids": torch.zeros(7, dtype=torch.int64),
    }


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _load(checkpoint: Path, **options) -> tuple[dict[str, torch.Tensor], HFStorageReader]:
    state_dict = _destinations()
    reader = HFStorageReader(checkpoint, **STAGING, **options)
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    return state_dict, reader


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])
def test_staged_route_matches_direct_path(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool) -> None:
    direct, direct_reader = _load(checkpoint, map_local_files=mapped)
    monkeypatch.setattr(chunks_module.Chunk, "host", property(lambda self: False))
    staged, reader = _load(checkpoint, map_local_files=mapped)
    for key, value in TENSORS.items():
        want = value.to(staged[key].dtype)
        assert _bits(staged[key]) == _bits(direct[key]) == _bits(want), key
    needed = sum(v.numel() * v.element_size() for v in TENSORS.values())
    assert reader.stats.total().bytes_read == direct_reader.stats.total().bytes_read == needed
    # every byte read went through the ring, within its bound, and none to a device
    ring = reader.staging
    assert ring.bytes_staged == needed and ring.device_bytes == 0
    assert 0 < ring.peak_bytes <= ring.capacity == (STAGING["num_threads"] + 1) * 256
    assert "copy" not in reader.seconds


def test_host_route_stages_only_what_cannot_land_in_place(checkpoint: Path) -> None:
    """Ranged reads land in contiguous same-dtype tensors; the transposed and the cast ones are staged."""
    state_dict, reader = _load(checkpoint, map_local_files=False)
    assert all(_bits(state_dict[k]) == _bits(v.to(state_dict[k].dtype)) for k, v in TENSORS.items())
    staged = TENSORS["big"].nbytes + TENSORS["bf16"].nbytes
    assert reader.staging.bytes_staged == staged and reader.staging.peak_bytes <= reader.staging.capacity
    mapped_state, mapped_reader = _load(checkpoint)  # a mapping copies into every host tensor
    assert mapped_reader.staging.bytes_staged == 0 and mapped_reader.staging.peak_bytes == 0
    assert all(_bits(mapped_state[k]) == _bits(state_dict[k]) for k in TENSORS)


def test_ring_bounds_bytes_in_use_under_contention() -> None:
    ring = StagingRing(3, 64)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(50):
                slot = ring.acquire(rng.randint(1, 64))
                assert slot.data.numel() == slot.nbytes
                time.sleep(rng.random() / 2000)
                ring.release(slot)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert 0 < ring.peak_bytes <= 3 * 64 and ring.in_use == 0
    assert ring.wait_seconds > 0  # 8 threads on 3 slots: some waited


def test_ring_rejects_a_request_larger_than_a_slot() -> None:
    ring = StagingRing(2, 64)
    with pytest.raises(ValueError, match="do not fit a staging slot of 64 bytes"):
        ring.acquire(65)
    with pytest.raises(ValueError):
        StagingRing(0, 64)


def test_reads_larger_than_a_slot_are_cut(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``big`` (5280 bytes) through 256-byte slots: every slot request fits, none is rejected."""
    sizes: list[int] = []
    acquire = StagingRing.acquire
    monkeypatch.setattr(StagingRing, "acquire", lambda self, n: sizes.append(n) or acquire(self, n))
    monkeypatch.setattr(chunks_module.Chunk, "host", property(lambda self: False))
    state_dict, reader = _load(checkpoint)
    assert _bits(state_dict["big"]) == _bits(TENSORS["big"])
    assert len(sizes) >= TENSORS["big"].nbytes // 256 and max(sizes) <= 256


def test_cpu_load_makes_no_cuda_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load into CPU tensors (bf16 checkpoint into an fp32 model: every tensor cast) never touches
    ``torch.cuda``, and reports no ``copy`` phase."""
    source = build_model("llama", dtype=torch.bfloat16)
    source.save_pretrained(tmp_path)
    model = build_model("llama", dtype=torch.float32, seed=1)

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU load called torch.cuda")

    for name in ("Stream", "Event", "stream", "current_stream", "synchronize", "is_available"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    report = load_hf_checkpoint(model, str(tmp_path), map_local_files=False)
    monkeypatch.undo()
    assert list(report.seconds) == ["metadata", "plan", "first_byte", "read", "convert", "finish"]
    want = source.state_dict()
    assert all(torch.equal(v, want[k].float()) for k, v in model.state_dict().items())


class _FakeCuda:
    """Just enough of ``torch.cuda`` for :class:`SlotCopier`: copies run at once, and an event
    completes only when the test lets it (as a copy still in flight on the device would)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.records = 0

    def Stream(self, device):  # noqa: N802 - torch.cuda's name
        return self

    def current_stream(self, device):
        return self

    def stream(self, stream):
        return contextlib.nullcontext()

    def Event(self, blocking=False):  # noqa: N802 - torch.cuda's name
        return self

    def wait_stream(self, other) -> None:
        pass

    def record(self, stream) -> None:
        self.records += 1

    def synchronize(self) -> None:
        assert self.done.wait(10), "the test never completed the copies"


class _DeviceDest:
    """A CPU tensor that says it is on ``cuda:0`` (the copier routes on ``device`` alone)."""

    device = torch.device("cuda", 0)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.dtype = tensor.dtype

    def is_contiguous(self) -> bool:
        return True

    def copy_(self, source: torch.Tensor, non_blocking: bool = False) -> None:
        assert non_blocking, "a copy to the device must not block"
        self.tensor.copy_(source)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    for name in ("Stream", "current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    return cuda


def _staged(ring: StagingRing, values: torch.Tensor):
    slot = ring.acquire(values.nbytes)
    slot.data.copy_(values.view(torch.uint8))
    return slot, slot.data.view(values.dtype)


def test_device_copies_hold_their_slot_until_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot copied to a device goes back to the ring, and its batch is committed, only once the
    copies' event completes (host copies of the same slot are done at once); ``close`` waits."""
    cuda = _fake_cuda(monkeypatch)
    ring = StagingRing(2, 64)
    copier = SlotCopier(ring, [torch.device("cuda", 0)])
    values = torch.arange(10, dtype=torch.float32)
    slot, staged = _staged(ring, values)
    device, host = _DeviceDest(torch.zeros(4)), torch.zeros(6, dtype=torch.float64)
    committed: list[str] = []
    copier.copy(slot, [(device, staged[:4]), (host, staged[4:])], lambda: committed.append("batch"))
    assert torch.equal(host, values[4:].double()) and cuda.records == 1
    time.sleep(0.05)
    assert ring.in_use == 40 and not committed  # the device copy may still read the slot
    cuda.done.set()
    assert copier.close() is None
    assert ring.in_use == 0 and committed == ["batch"] and torch.equal(device.tensor, values[:4])
    assert copier.stats.bytes_staged == 40 and copier.stats.device_bytes == 16


def test_device_copy_commit_error_comes_back_from_close(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _fake_cuda(monkeypatch)
    ring = StagingRing(1, 64)
    copier = SlotCopier(ring, [torch.device("cuda", 0)])
    slot, staged = _staged(ring, torch.ones(4))

    def fail() -> None:
        raise RuntimeError("commit failed")

    copier.copy(slot, [(_DeviceDest(torch.zeros(4)), staged)], fail)
    cuda.done.set()
    error = copier.close()
    assert isinstance(error, RuntimeError) and ring.in_use == 0


def test_mapped_loads_read_large_landing_chunks_by_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch of two 1 MiB tensors that land as read and a small one: only the small one is
    copied out of a mapping (the whole batch was, for the small one's sake); values the same."""
    tensors = {"a": torch.randn(512, 512), "norm": torch.randn(7), "b": torch.randn(512, 512)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mapped: list[int] = []
    copy_mapped = direct_module._copy_mapped

    def counted(handle, batch, targets, record) -> None:
        mapped.append(sum(chunk.nbytes for chunk in batch))
        copy_mapped(handle, batch, targets, record)

    monkeypatch.setattr(direct_module, "_copy_mapped", counted)
    state_dict = {key: torch.zeros_like(value) for key, value in tensors.items()}
    reader = HFStorageReader(tmp_path, staging_bytes=8 * 2**20, num_threads=1)
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    assert all(_bits(state_dict[key]) == _bits(value) for key, value in tensors.items())
    assert mapped == [tensors["norm"].nbytes]
    assert reader.stats.total().bytes_read == sum(value.nbytes for value in tensors.values())

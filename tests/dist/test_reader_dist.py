"""HFStorageReader under DCP: sharded DTensor loads on 2 and 4 gloo ranks, plus single-process checks.

Each rank's expected shard is computed independently of DTensor (``torch.chunk`` per mesh dim, which
is what ``Shard`` means), and each rank must read exactly the bytes of its own shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hp_dcp_hf.errors import HPDCPHFError, PlanningError, StorageReadError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.catalog import INDEX_FILE
from hp_dcp_hf.storage.read.reader import HFStorageReader
from hp_dcp_hf.storage.transport import location as location_module
from hp_dcp_hf.tools.launch import run_ranks

FILE_1 = {
    "rows": torch.randn(7, 5),
    "cols": torch.randn(5, 9).to(torch.bfloat16),
    "bias": torch.randn(7),
}
FILE_2 = {
    "emb": torch.randn(11, 6),
    "scale": torch.tensor(0.5),
    "f8": torch.randn(6, 4).to(torch.float8_e4m3fn),
    "mask": torch.rand(5, 3) > 0.5,
    "ids": torch.arange(10, dtype=torch.int64),
}


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(FILE_1, str(root / "model-00001-of-00002.safetensors"))
    save_file(FILE_2, str(root / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in FILE_1}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in FILE_2}
    (root / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return root


def _placements(layout: str, ndim: int) -> list:
    """The placements a layout gives a tensor of ``ndim`` dims (dims it cannot shard are replicated)."""
    if layout == "shard0":
        return [Shard(0) if ndim >= 1 else Replicate()]
    if layout == "shard1":
        return [Shard(1) if ndim >= 2 else Shard(0) if ndim == 1 else Replicate()]
    return [Shard(0) if ndim >= 1 else Replicate(), Shard(1) if ndim >= 2 else Replicate()]  # "mesh2d"


def _expected_local(
    tensor: torch.Tensor, placements: list, coordinate: list[int], mesh_shape: tuple
) -> torch.Tensor:
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            parts = torch.chunk(tensor, mesh_shape[mesh_dim], dim=placement.dim)
            index = coordinate[mesh_dim]
            tensor = parts[index] if index < len(parts) else tensor.narrow(placement.dim, 0, 0)
    return tensor


def _load_sharded(
    rank: int, world_size: int, path: str, layout: str, mesh_shape: tuple, cast: bool, reader_kwargs: dict
) -> dict:
    """Load every checkpoint key as a DTensor; report values, bytes read vs needed, header traffic."""
    mesh = init_device_mesh("cpu", mesh_shape)
    source = load_file(f"{path}/model-00001-of-00002.safetensors") | load_file(
        f"{path}/model-00002-of-00002.safetensors"
    )
    state_dict, expected = {}, {}
    for key, tensor in source.items():
        placements = _placements(layout, tensor.ndim)
        dtype = torch.float32 if cast else tensor.dtype
        state_dict[key] = torch.distributed.tensor.zeros(
            tensor.shape, dtype=dtype, device_mesh=mesh, placements=placements
        )
        expected[key] = _expected_local(tensor, placements, mesh.get_coordinate(), mesh_shape)
    reader = HFStorageReader(path, **reader_kwargs)
    dcp.load(state_dict, storage_reader=reader)
    equal = {}
    for key, dtensor in state_dict.items():
        local = dtensor.to_local()
        want = expected[key].to(local.dtype)
        equal[key] = local.shape == want.shape and _bytes(local) == _bytes(want)
    total = reader.stats.total()
    return {
        "equal": equal,
        "shard_bytes": sum(t.numel() * t.element_size() for t in expected.values()),
        "bytes_read": total.bytes_read,
        "bytes_needed": total.bytes_needed,
        "header_bytes": total.header_bytes,
        "local_numel": sum(t.numel() for t in expected.values()),
    }


def _read_corrupt_metadata(rank: int, world_size: int, path: str) -> dict:
    """Rank 0 finds a broken header; every rank must raise a typed error, none may hang."""
    try:
        HFStorageReader(path).read_metadata()
    except HPDCPHFError as error:
        direct = (type(error).__name__, error.file, "rank 0" in error.reason or rank == 0)
    else:
        direct = None
    state_dict = {"rows": torch.zeros(7, 5)}
    try:
        dcp.load(state_dict, storage_reader=HFStorageReader(path))
    except CheckpointException as error:
        via_dcp = "bad.safetensors" in str(error)
    else:
        via_dcp = False
    dist.barrier()
    return {"direct": direct, "via_dcp": via_dcp}


def _two_rank_scenarios(rank: int, world_size: int, path: str, corrupt: str) -> dict:
    return {
        "shard0": _load_sharded(rank, world_size, path, "shard0", (2,), False, {}),
        "shard1_cast": _load_sharded(rank, world_size, path, "shard1", (2,), True, {"staging_bytes": 256}),
        "no_broadcast": _load_sharded(
            rank, world_size, path, "shard0", (2,), False, {"broadcast_metadata": False}
        ),
        "corrupt": _read_corrupt_metadata(rank, world_size, corrupt),
    }


def _four_rank_scenarios(rank: int, world_size: int, path: str) -> dict:
    return {
        "mesh2d": _load_sharded(rank, world_size, path, "mesh2d", (2, 2), False, {}),
        "shard1_small_staging": _load_sharded(
            rank, world_size, path, "shard1", (4,), False, {"staging_bytes": 64, "num_threads": 2}
        ),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def two_ranks(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    corrupt = tmp_path_factory.mktemp("corrupt")
    (corrupt / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    return run_ranks(2, _two_rank_scenarios, str(checkpoint), str(corrupt))


@pytest.fixture(scope="module")
def four_ranks(checkpoint: Path) -> list[dict]:
    return run_ranks(4, _four_rank_scenarios, str(checkpoint))


def _assert_exact_load(results: list[dict], scenario: str) -> None:
    for rank, result in enumerate(r[scenario] for r in results):
        assert all(result["equal"].values()), (rank, result["equal"])
        assert result["bytes_read"] == result["bytes_needed"] == result["shard_bytes"], (rank, result)
    # Shards partition every sharded tensor: the ranks together need more than nothing.
    assert sum(r[scenario]["local_numel"] for r in results) > 0


@pytest.mark.parametrize("scenario", ["shard0", "no_broadcast"])
def test_two_ranks_shard0_reads_exactly_local_bytes(two_ranks: list[dict], scenario: str) -> None:
    _assert_exact_load(two_ranks, scenario)


def test_two_ranks_shard1_bf16_and_f8_into_fp32(two_ranks: list[dict]) -> None:
    """Cast on copy: checkpoint dtype bytes are read (shard_bytes counts checkpoint itemsizes)."""
    _assert_exact_load(two_ranks, "shard1_cast")


def test_only_rank0_reads_headers(two_ranks: list[dict]) -> None:
    rank0, rank1 = (r["shard0"] for r in two_ranks)
    assert rank0["header_bytes"] > 0 and rank1["header_bytes"] == 0
    assert all(r["no_broadcast"]["header_bytes"] == rank0["header_bytes"] for r in two_ranks)


def test_rank0_failure_raises_on_every_rank(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert result["corrupt"]["direct"] == ("CheckpointFormatError", "bad.safetensors", True)
        assert result["corrupt"]["via_dcp"]


@pytest.mark.parametrize("scenario", ["mesh2d", "shard1_small_staging"])
def test_four_ranks_uneven_shards(four_ranks: list[dict], scenario: str) -> None:
    _assert_exact_load(four_ranks, scenario)
    assert [r[scenario]["header_bytes"] > 0 for r in four_ranks] == [True, False, False, False]


# -- single process -------------------------------------------------------------------------------


def test_parity_with_torch_huggingface_reader(checkpoint: Path) -> None:
    keys = ["rows", "cols", "bias", "emb", "scale", "ids"]  # dtypes torch's reader maps correctly
    ours = {k: torch.full_like(v, 7) for k, v in (FILE_1 | FILE_2).items() if k in keys}
    theirs = {k: torch.full_like(v, 7) for k, v in ours.items()}
    reader = HFStorageReader(checkpoint)
    dcp.load(ours, storage_reader=reader, no_dist=True)
    dcp.load(theirs, storage_reader=HuggingFaceStorageReader(str(checkpoint)), no_dist=True)
    for key in keys:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
        assert torch.equal(ours[key], (FILE_1 | FILE_2)[key]), key
    assert reader.stats.total().bytes_read == sum(v.numel() * v.element_size() for v in ours.values())


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])
def test_f8_bool_through_file_url_and_index(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool) -> None:
    """Where torch's reader fails or guesses: F8/BOOL dtypes, a file:// URL; one copy per tensor out of
    a mapping, none at all with preadv."""
    state_dict = {
        "f8": torch.zeros(6, 4, dtype=torch.float8_e4m3fn),
        "mask": torch.zeros(5, 3, dtype=torch.bool),
    }
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda self, *a, **k: copies.append(1) or original(self, *a, **k)
    )
    reader = HFStorageReader(f"file://{checkpoint}", map_local_files=mapped)
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    monkeypatch.undo()
    assert _bytes(state_dict["f8"]) == _bytes(FILE_2["f8"]) and torch.equal(
        state_dict["mask"], FILE_2["mask"]
    )
    # preadv: contiguous, same dtype, so the bytes land in the destination directly
    assert len(copies) == (2 if mapped else 0)


def test_noncontiguous_cast_and_staging_budget(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = location_module._LocalFile.read_into

    def spy(self, start, buffers):
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        return original(self, start, buffers)

    monkeypatch.setattr(location_module._LocalFile, "read_into", spy)
    state_dict = {"emb": torch.zeros(6, 11).t(), "cols": torch.zeros(5, 9, dtype=torch.float64)}
    reader = HFStorageReader(checkpoint, staging_bytes=64, num_threads=2, map_local_files=False)
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    assert torch.equal(state_dict["emb"], FILE_2["emb"])
    assert torch.equal(state_dict["cols"], FILE_1["cols"].double())
    data_reads = sizes[-reader.stats.total().requests :]
    assert max(data_reads) <= 32 and len(data_reads) >= (11 * 6 * 4 + 5 * 9 * 2) // 32


def test_mapped_copies_cast_into_noncontiguous(checkpoint: Path) -> None:
    state_dict = {"emb": torch.zeros(6, 11).t(), "cols": torch.zeros(5, 9, dtype=torch.float64)}
    reader = HFStorageReader(checkpoint, staging_bytes=64, num_threads=2)
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    assert torch.equal(state_dict["emb"], FILE_2["emb"])
    assert torch.equal(state_dict["cols"], FILE_1["cols"].double())
    stats = reader.stats.total()
    assert stats.bytes_read == stats.bytes_needed == 11 * 6 * 4 + 5 * 9 * 2


def test_large_contiguous_reads_use_preadv_strided_boxes_the_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole 2 MiB tensor lands in its destination by preadv (a mapping would page-fault through
    it); a column box of it (one range per row) is one copy out of the mapping."""
    big = torch.randn(512, 1024)
    save_file({"big": big}, str(tmp_path / "model.safetensors"))
    mapped: list[str] = []
    original = location_module._LocalFile.mapped
    monkeypatch.setattr(
        location_module._LocalFile, "mapped", lambda self, *span: mapped.append(span) or original(self, *span)
    )
    for box, expect_mapped in ((Box((0, 0), (512, 1024)), False), (Box((0, 0), (512, 512)), True)):
        mapped.clear()
        reader = HFStorageReader(tmp_path)
        reader.read_metadata()
        dest = torch.zeros(box.sizes)
        reader.read_data(LoadPlan([_item("big", "big", box)]), _Planner({"big": dest})).wait()
        assert torch.equal(dest, big[box.slices()])
        assert bool(mapped) == expect_mapped, box
        # a mapping spans its chunk only: at most the per-thread staging budget (64 MiB / 8)
        assert all(end - start <= 8 * 2**20 for start, end in mapped)
        stats = reader.stats.total()
        assert stats.bytes_read == stats.bytes_needed == box.numel * 4
        assert stats.requests == (1 if box.sizes[1] == 1024 else 512)


def test_mapped_span_stays_within_the_staging_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the columns of a 2 MiB tensor: 1 MiB needed, but its rows span 2 MiB of the file. With
    512 KiB per thread, each mapping covers at most 512 KiB (what a thread holds resident)."""
    big = torch.randn(512, 1024)
    save_file({"big": big}, str(tmp_path / "model.safetensors"))
    spans: list[tuple[int, int]] = []
    original = location_module._LocalFile.mapped
    monkeypatch.setattr(
        location_module._LocalFile, "mapped", lambda self, *span: spans.append(span) or original(self, *span)
    )
    reader = HFStorageReader(tmp_path, staging_bytes=4 * 2**20, num_threads=8)
    reader.read_metadata()
    dest = torch.zeros(512, 512)
    reader.read_data(LoadPlan([_item("big", "big", Box((0, 256), (512, 512)))]), _Planner({"big": dest})).wait()
    assert torch.equal(dest, big[:, 256:768])
    assert len(spans) == 4 and all(end - start <= 2**19 for start, end in spans)
    assert reader.stats.total().bytes_read == 2**20


def test_unaligned_tensor_is_read_not_mapped(tmp_path: Path) -> None:
    """A header whose length leaves the data unaligned (legal, if unusual): the bytes cannot be
    viewed as float32 in place, so they are read by ranges instead, with the same values."""
    values = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
    if len(header) % 2 == 0:
        header += b" "
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + values.numpy().tobytes()
    )
    reader = HFStorageReader(tmp_path)
    state_dict = {"x": torch.zeros(2, 3)}
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    assert reader.entries["x"].data_start % 4 != 0
    assert torch.equal(state_dict["x"], values.view(2, 3))


class _Planner:
    """Just what ``read_data`` calls: a destination per item, and a record of commits."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests = dests
        self.commits: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.dests[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        assert (
            tensor is self.dests[item.dest_index.fqn]
            or tensor.data_ptr() == self.dests[item.dest_index.fqn].data_ptr()
        )
        self.commits.append(item.dest_index.fqn)


def _item(dest: str, key: str, box: Box) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(dest),
        dest_offsets=torch.Size([0] * box.ndim),
        storage_index=MetadataIndex(key, [0] * box.ndim),
        storage_offsets=torch.Size(box.offsets),
        lengths=torch.Size(box.sizes),
    )


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])
@pytest.mark.parametrize("gap", [0, 4096])
def test_column_box_coalescing(checkpoint: Path, gap: int, mapped: bool) -> None:
    """Column boxes are one range per row; a gap coalesces them into one request, except out of a
    mapping, which copies needed bytes only."""
    reader = HFStorageReader(checkpoint, coalesce_gap=gap, map_local_files=mapped)
    reader.read_metadata()
    dests = {"cols": torch.zeros(11, 2), "none": torch.zeros(0, 6), "ids": torch.zeros(3, dtype=torch.int64)}
    planner = _Planner(dests)
    plan = LoadPlan(
        [
            _item("cols", "emb", Box((0, 3), (11, 2))),
            _item("none", "emb", Box((4, 0), (0, 6))),
            _item("ids", "ids", Box((2,), (3,))),
        ]
    )
    reader.read_data(plan, planner).wait()
    assert torch.equal(dests["cols"], FILE_2["emb"][:, 3:5]) and torch.equal(dests["ids"], FILE_2["ids"][2:5])
    assert sorted(planner.commits) == ["cols", "ids", "none"]
    stats = reader.stats.per_file["model-00002-of-00002.safetensors"]
    assert stats.bytes_needed == 11 * 2 * 4 + 3 * 8 and stats.ranges == 11 + 1
    if gap == 0 or mapped:
        assert stats.requests == 12 and stats.bytes_read == stats.bytes_needed
    else:  # one request from the first needed byte of emb to the last of ids, whatever lies between
        emb, ids = reader.entries["emb"], reader.entries["ids"]
        spans = [
            (emb.data_start + 3 * 4, emb.data_start + 10 * 24 + 5 * 4),
            (ids.data_start + 16, ids.data_start + 40),
        ]
        assert stats.requests == 1
        assert stats.bytes_read == max(e for _, e in spans) - min(s for s, _ in spans)


def test_short_read_names_file_and_key(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(100), "y": torch.ones(100)}, str(tmp_path / "m.safetensors"))
    reader = HFStorageReader(tmp_path)
    reader.read_metadata()
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-40])
    with pytest.raises(StorageReadError, match="changed since its header was read") as info:
        reader.read_data(LoadPlan([_item("y", "y", Box((0,), (100,)))]), _Planner({"y": torch.zeros(100)}))
    assert (info.value.file, info.value.key) == ("m.safetensors", "y")


@pytest.mark.parametrize(
    ("key", "box", "dest"),
    [("nope", Box((0,), (3,)), (3,)), ("ids", Box((8,), (3,)), (3,)), ("ids", Box((0,), (3,)), (4,))],
)
def test_inconsistent_plans_are_refused(checkpoint: Path, key: str, box: Box, dest: tuple) -> None:
    reader = HFStorageReader(checkpoint)
    reader.read_metadata()
    with pytest.raises(PlanningError):
        reader.read_data(LoadPlan([_item("d", key, box)]), _Planner({"d": torch.zeros(dest)}))


def test_metadata_matches_checkpoint(checkpoint: Path) -> None:
    reader = HFStorageReader(checkpoint)
    metadata = reader.read_metadata()
    for key, tensor in (FILE_1 | FILE_2).items():
        md = metadata.state_dict_metadata[key]
        assert md.properties.dtype == tensor.dtype and md.size == tensor.shape
        assert [(c.offsets, c.sizes) for c in md.chunks] == [(torch.Size([0] * tensor.ndim), tensor.shape)]
        assert metadata.storage_data[MetadataIndex(key, [0] * tensor.ndim)] is reader.entries[key]
    assert reader.stats.total().header_requests == 2 * 2 + 1
    reader.reset()
    assert reader.entries == {} and reader.stats.total().header_requests == 0
    with pytest.raises(PlanningError, match="read_metadata"):
        reader.read_data(LoadPlan([]), _Planner({}))

"""torch's distributed HF files (``HuggingFaceStorageWriter(save_distributed=True)``), single process.

Each rank of such a save writes ``shard-0000r-model-00001-of-00001.safetensors`` with the chunks it
holds, placed by ``DCP_SHARDING_INFO`` in the header's ``__metadata__``; no index. Here the files
come from torch's own writer: its ``write_data``, called once per simulated rank with that rank's
chunks (what ``dcp.save`` does on each rank once the plans are made), so names, headers and offsets
are torch's byte for byte, in any layout, broken ones included. Also: the pure tiling logic
(:func:`~hp_dcp_hf.storage.format.catalog.assemble`, :meth:`CheckpointTensor.pieces`) and the header
rules of ``DCP_SHARDING_INFO``. Saves from DTensors on real ranks: tests/dist/test_torch_shards_dist.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter, _hf_utils
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from transformers.core_model_loading import Concatenate, WeightConverter

from hp_dcp_hf import HFMappingPlanner, HFStorageReader
from hp_dcp_hf.errors import CheckpointFormatError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.catalog import INDEX_FILE, Catalog, assemble, scan
from hp_dcp_hf.storage.format.header import SAVED_OFFSETS_KEY, SHARDING_INFO_KEY, TensorEntry
from hp_dcp_hf.storage.transport.location import filesystem, locate
from hp_dcp_hf.storage.transport.stats import ReadStats
from tests.support.servers.range_server import _Into

_RANDOM = torch.Generator().manual_seed(0)
FULL = {
    "rows": torch.randn(7, 5, generator=_RANDOM),  # Shard(0) over 4: 2, 2, 2, 1 rows
    "cols": torch.randn(3, 6, generator=_RANDOM).bfloat16(),  # Shard(1) over 4: 2, 2, 2 columns, an empty chunk
    "grid": torch.randn(4, 6, generator=_RANDOM),  # 2 x 2 mesh: Shard(0), Shard(1)
    "whole": torch.randn(5, generator=_RANDOM),  # Replicate: written once, by rank 1
    "scalar": torch.tensor(3.5),  # 0-d, by rank 2
}


def _chunks_of(world: int = 4) -> list[dict[str, tuple[tuple[int, ...], torch.Tensor]]]:
    """Per rank, key -> (offsets, chunk): the layouts DTensor gives :data:`FULL` (chunks of
    ``torch.chunk``, an empty one at the end where a dim runs out)."""
    ranks: list[dict[str, tuple[tuple[int, ...], torch.Tensor]]] = [{} for _ in range(world)]
    for rank in range(world):
        start = min(2 * rank, 7)
        ranks[rank]["rows"] = ((start, 0), FULL["rows"][start : start + 2])
        start = min(2 * rank, 6)
        ranks[rank]["cols"] = ((0, start), FULL["cols"][:, start : start + 2])
        r, c = divmod(rank, 2)
        ranks[rank]["grid"] = ((2 * r, 3 * c), FULL["grid"][2 * r : 2 * r + 2, 3 * c : 3 * c + 3])
    ranks[1]["whole"] = ((0,), FULL["whole"])
    ranks[2]["scalar"] = ((), FULL["scalar"])
    return ranks


class _Resolve:
    """What ``write_data`` asks of a save planner: each item's tensor."""

    def __init__(self, data: dict[MetadataIndex, torch.Tensor]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.data[item.index]


def write_torch_shards(path: Path, ranks: list[dict[str, tuple[tuple[int, ...], torch.Tensor]]]) -> Path:
    """``ranks[r]`` (key -> offsets, chunk) written by torch's
    ``HuggingFaceStorageWriter(save_distributed=True)`` as rank ``r`` of ``len(ranks)`` writes it:
    the global plan gives each rank its shard index."""
    path.mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
    plans = writer.prepare_global_plan([SavePlan([]) for _ in ranks])
    for rank, chunks in enumerate(ranks):
        items, data = [], {}
        for key, (offsets, chunk) in chunks.items():
            index = MetadataIndex(key, offsets)
            sizes = torch.Size(chunk.shape)
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), sizes),
                        properties=TensorProperties.create_from_tensor(chunk),
                        size=sizes,
                    ),
                )
            )
            data[index] = chunk.contiguous()
        writer.set_up_storage_writer(rank == 0, rank=rank)
        plan = writer.prepare_local_plan(
            dataclasses.replace(SavePlan(items), storage_data=plans[rank].storage_data)
        )
        writer.write_data(plan, _Resolve(data)).wait()
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_torch_shards(tmp_path_factory.mktemp("torch-shards"), _chunks_of())


def _scan(path: Path) -> Catalog:
    return scan(*locate(*filesystem(str(path))), ReadStats())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- what torch writes, and its reading ------------------------------------------------------------


def test_the_format_is_torchs(shards: Path) -> None:
    assert (SHARDING_INFO_KEY, SAVED_OFFSETS_KEY) == (
        _hf_utils.CUSTOM_METADATA_KEY,
        _hf_utils.SAVED_OFFSETS_KEY,
    )
    assert sorted(p.name for p in shards.iterdir()) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2, 3, 4)
    ]  # and no index
    catalog = _scan(shards)
    assert {key: tensor.shape for key, tensor in catalog.entries.items()} == {
        k: tuple(v.shape) for k, v in FULL.items()
    }
    assert [len(catalog.entries[k].parts) for k in FULL] == [4, 4, 4, 1, 1]
    assert catalog.entries["cols"].dtype == torch.bfloat16 and catalog.entries["cols"].nbytes == _nbytes(
        FULL["cols"]
    )
    assert catalog.entries["rows"].parts[3].box == Box((6, 0), (1, 5))


def test_default_planner_loads_whole_tensors_as_torchs_reader_does(shards: Path) -> None:
    """DefaultLoadPlanner sees one whole chunk per key; every byte read once, from its own file."""
    ours = {k: torch.zeros_like(v) for k, v in FULL.items()}
    theirs = {k: torch.zeros_like(v) for k, v in FULL.items()}
    reader = HFStorageReader(shards)
    dcp.load(ours, storage_reader=reader, no_dist=True)
    dcp.load(theirs, storage_reader=HuggingFaceStorageReader(str(shards)), no_dist=True)
    for key, tensor in FULL.items():
        assert torch.equal(ours[key], tensor) and torch.equal(theirs[key], tensor), key
    stats = reader.stats.total()
    assert stats.bytes_read == stats.bytes_needed == sum(_nbytes(t) for t in FULL.values())
    metadata = reader.read_metadata()
    for key, tensor in FULL.items():
        md = metadata.state_dict_metadata[key]
        assert md.size == tensor.shape and [(c.offsets, c.sizes) for c in md.chunks] == [
            (torch.Size([0] * tensor.ndim), tensor.shape)
        ]
        assert metadata.storage_data[MetadataIndex(key, [0] * tensor.ndim)] is reader.entries[key]


def _item(key: str, box: Box) -> ReadItem:
    zeros = torch.Size([0] * box.ndim)
    return ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex(key, zeros),
        zeros,
        MetadataIndex(key, zeros),
        torch.Size(box.offsets),
        torch.Size(box.sizes),
    )


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])
def test_a_box_across_chunks_reads_each_file_only_its_bytes(shards: Path, mapped: bool) -> None:
    """Rows 1-4, columns 1-3 of ``rows`` lie in the chunks of ranks 1-3; a 3 x 4 box of ``grid``
    in all four. Each file gives the bytes of its piece, nothing else."""
    reader = HFStorageReader(shards, map_local_files=mapped)
    reader.read_metadata()
    boxes = {"rows": Box((1, 1), (4, 3)), "grid": Box((1, 1), (3, 4))}
    dests = {key: torch.zeros(box.sizes) for key, box in boxes.items()}
    plan = LoadPlan([_item(key, box) for key, box in boxes.items()])
    reader.read_data(plan, _Into(dests)).wait()
    for key, box in boxes.items():
        assert torch.equal(dests[key], FULL[key][box.slices()]), key
    per_file = {f: (s.bytes_read, s.bytes_needed) for f, s in reader.stats.per_file.items() if s.bytes_needed}
    name = "shard-0000{}-model-00001-of-00001.safetensors".format
    # rows: 1 row x 3 of rank 0, 2 x 3 of rank 1, 1 x 3 of rank 2; grid: 1x2, 1x2, 2x2, 2x2 (fp32)
    assert per_file == {
        name(1): (4 * 5, 4 * 5),
        name(2): (4 * 8, 4 * 8),
        name(3): (4 * 7, 4 * 7),
        name(4): (4 * 4, 4 * 4),
    }
    files = {file for file, _ in reader.plan_requests(plan.items)}
    assert files == set(per_file)


def test_a_conversion_over_chunks(tmp_path: Path) -> None:
    """q, k, v saved in chunks (rows split over 2 ranks, columns over the other 2) load fused into
    ``qkv`` through a transformers ``Concatenate``: the planner sees whole tensors, the reader chunks."""
    q, k, v = torch.randn(4, 6), torch.randn(2, 6), torch.randn(2, 6)
    ranks = [
        {"attn.q.weight": ((0, 0), q[:2]), "attn.k.weight": ((0, 0), k[:, :3]), "attn.v.weight": ((0, 0), v)},
        {"attn.q.weight": ((2, 0), q[2:]), "attn.k.weight": ((0, 3), k[:, 3:])},
    ]
    path = write_torch_shards(tmp_path, ranks)
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.qkv = nn.Linear(6, 8, bias=False)
    mapping = [
        WeightConverter(
            ["attn.q.weight", "attn.k.weight", "attn.v.weight"], "attn.qkv.weight", [Concatenate(dim=0)]
        )
    ]
    reader = HFStorageReader(path)
    planner = HFMappingPlanner(model, weights_mapping=mapping)
    dcp.load(model.state_dict(), storage_reader=reader, planner=planner, no_dist=True)
    assert torch.equal(model.attn.qkv.weight.detach(), torch.cat([q, k, v]))
    stats = reader.stats.total()
    assert stats.bytes_read == stats.bytes_needed == planner.stats.bytes_needed == 8 * 6 * 4


def test_catalog_json_round_trip_keeps_chunks(shards: Path) -> None:
    catalog = _scan(shards)
    again = Catalog.from_json(catalog.to_json())
    assert again == catalog
    assert again.entries["grid"].parts[3].offsets == (2, 3) and again.entries["whole"].parts[0].offsets == (
        0,
    )


def test_whole_tensor_accessors_refuse_chunks(shards: Path) -> None:
    """Code that reads a tensor as one span of one file (``file``, ``data_start``) fails clearly."""
    catalog = _scan(shards)
    assert catalog.entries["whole"].file == "shard-00002-model-00001-of-00001.safetensors"
    with pytest.raises(ValueError, match="'rows' is stored in 4 chunks"):
        catalog.entries["rows"].file  # noqa: B018


# -- broken chunk layouts: typed errors naming the file and the key --------------------------------


def _broken(ranks: list[dict], tmp_path: Path) -> CheckpointFormatError:
    write_torch_shards(tmp_path, ranks)
    with pytest.raises(CheckpointFormatError) as info:
        _scan(tmp_path)
    return info.value


def test_overlapping_chunks(tmp_path: Path) -> None:
    w = torch.randn(6, 4)
    error = _broken([{"w": ((0, 0), w[:4])}, {"w": ((3, 0), w[3:])}], tmp_path)
    assert (error.file, error.key) == ("shard-00002-model-00001-of-00001.safetensors", "w")
    assert "chunk at offsets [3, 0] of shape [3, 4] overlaps the chunk in 'shard-00001" in error.reason


def test_chunks_with_a_gap(tmp_path: Path) -> None:
    """The middle rank's file missing: rows 2-3 are nowhere (the shape still reaches row 6)."""
    w = torch.randn(6, 4)
    error = _broken([{"w": ((0, 0), w[:2])}, {}, {"w": ((4, 0), w[4:])}], tmp_path)
    assert error.key == "w" and error.file.startswith("shard-0000")
    assert "2 chunk(s) hold 16 of the 24 elements of shape [6, 4]: a gap" in error.reason


def test_chunks_of_two_dtypes_or_ranks(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    error = _broken([{"w": ((0, 0), w[:2])}, {"w": ((2, 0), w[2:].half())}], tmp_path / "dtype")
    assert error.key == "w" and "chunk F16 [2, 4] does not match the chunk in 'shard-00001" in error.reason
    error = _broken([{"w": ((0, 0), w[:2])}, {"w": ((2,), w[2])}], tmp_path / "rank")
    assert "share its dtype and rank" in error.reason


def test_scalar_in_two_files(tmp_path: Path) -> None:
    error = _broken([{"s": ((), torch.tensor(1.0))}, {"s": ((), torch.tensor(2.0))}], tmp_path)
    assert error.key == "s" and "overlaps" in error.reason


def test_key_in_two_files_without_sharding_info_stays_an_error(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointFormatError, match="neither file places it as a chunk") as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == ("b.safetensors", "w")
    (tmp_path / "b.safetensors").unlink()
    write_torch_shards(tmp_path, [{"w": ((2,), torch.zeros(2))}])
    with pytest.raises(CheckpointFormatError, match="'a.safetensors' does not place it as a chunk"):
        _scan(tmp_path)


def test_an_index_names_one_file_per_key(shards: Path, tmp_path: Path) -> None:
    for file in shards.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / INDEX_FILE).write_text(
        json.dumps(
            {
                "weight_map": {
                    k: "shard-00001-model-00001-of-00001.safetensors" for k in ("rows", "cols", "grid")
                }
                | {
                    "whole": "shard-00002-model-00001-of-00001.safetensors",
                    "scalar": "shard-00003-model-00001-of-00001.safetensors",
                }
            }
        )
    )
    with pytest.raises(
        CheckpointFormatError, match="maps the key to this file but it is in 'shard-00001"
    ) as info:
        _scan(tmp_path)
    assert info.value.key == "rows"


def _header_file(path: Path, info: object, tensors: dict[str, torch.Tensor] | None = None) -> None:
    metadata = {SHARDING_INFO_KEY: info if isinstance(info, str) else json.dumps(info)}
    save_file(
        tensors or {"w": torch.zeros(2, 3), "b": torch.zeros(3)},
        str(path / "x.safetensors"),
        metadata=metadata,
    )


@pytest.mark.parametrize(
    ("info", "key", "words"),
    [
        ("{not json", None, "DCP_SHARDING_INFO in __metadata__: not valid JSON"),
        (
            '{"w": {"saved_offsets": [0, 0]}, "w": {"saved_offsets": [0, 0]}, "b": {"saved_offsets": [0]}}',
            "w",
            "duplicate JSON key",
        ),
        ({"w": {"saved_offsets": [0, -1]}, "b": {"saved_offsets": [0]}}, "w", "non-negative ints"),
        ({"w": {"saved_offsets": [0, True]}, "b": {"saved_offsets": [0]}}, "w", "non-negative ints"),
        ({"w": [0, 0], "b": {"saved_offsets": [0]}}, "w", "non-negative ints"),
        (
            {"w": {"saved_offsets": [0]}, "b": {"saved_offsets": [0]}},
            "w",
            "saved_offsets [0] to a tensor of shape [2, 3]",
        ),
        ({"w": {"saved_offsets": [0, 0]}}, "b", "places other keys but not this one"),
        (
            {"w": {"saved_offsets": [0, 0]}, "b": {"saved_offsets": [0]}, "c": {"saved_offsets": [0]}},
            "c",
            "places a key the file does not hold",
        ),
    ],
)
def test_sharding_info_rules(tmp_path: Path, info: object, key: str | None, words: str) -> None:
    _header_file(tmp_path, info)
    with pytest.raises(CheckpointFormatError, match=re.escape(words)) as raised:
        _scan(tmp_path)
    assert (raised.value.file, raised.value.key) == ("x.safetensors", key)


# -- the tiling logic, on entries alone --------------------------------------------------------------


def _entry(
    file: str, offsets: tuple[int, ...] | None, shape: tuple[int, ...], dtype_name: str = "F32"
) -> TensorEntry:
    return TensorEntry(
        "t", file, dtype_name, torch.float32, shape, 0, 4 * int(torch.Size(shape).numel()), offsets
    )


def test_assemble_tiles_and_splits_boxes() -> None:
    parts = [_entry(f"f{r}{c}", (2 * r, 3 * c), (2, 3)) for r in range(3) for c in range(2)] + [
        _entry("empty", (6, 0), (0, 6))
    ]
    tensor = assemble("t", parts)
    assert tensor.shape == (6, 6) and tensor.chunked and tensor.nbytes == 144
    pieces = {part.file: piece for part, piece in tensor.pieces(Box((1, 2), (3, 2)))}
    assert pieces == {
        "f00": Box((1, 2), (1, 1)),
        "f01": Box((1, 3), (1, 1)),
        "f10": Box((2, 2), (2, 1)),
        "f11": Box((2, 3), (2, 1)),
    }
    whole = assemble("t", [_entry("w", None, (6, 6))])
    assert not whole.chunked and whole.pieces(Box((1, 2), (3, 2))) == [(whole.parts[0], Box((1, 2), (3, 2)))]
    assert not assemble("t", [_entry("w", (0, 0), (6, 6))]).chunked  # torch's rank-0 save: one chunk at 0


def test_overlap_off_the_sweep_dim_is_found() -> None:
    """The sweep runs along the dim with the most distinct starts (columns here); chunks that share
    columns overlap only if their rows do too."""
    parts = [
        _entry("a", (0, 0), (3, 2)),
        _entry("b", (0, 2), (3, 2)),
        _entry("c", (0, 4), (3, 2)),
        _entry("d", (2, 1), (2, 2)),
        _entry("e", (3, 0), (1, 1)),
    ]
    with pytest.raises(CheckpointFormatError, match="overlaps the chunk in 'a'") as info:
        assemble("t", parts)
    assert (info.value.file, info.value.key) == ("d", "t")
    side_by_side = [_entry("a", (0, 0), (2, 2)), _entry("b", (2, 0), (2, 2)), _entry("c", (0, 2), (4, 1))]
    assert assemble("t", side_by_side).shape == (4, 3)


def test_many_chunks_tile_in_linear_time() -> None:
    """A 1-D split over 4096 ranks (and a 32 x 32 grid) is checked by a sweep, not by every pair
    (8 million pairs: minutes)."""
    rows = [_entry(f"r{i}", (i, 0), (1, 8)) for i in range(4096)]
    assert assemble("t", rows[::-1]).shape == (4096, 8)
    grid = [_entry(f"g{i}", (i // 32, i % 32), (1, 1)) for i in range(1024)]
    assert assemble("t", grid).shape == (32, 32)

"""Files torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes from DTensors, loaded on 4 gloo
ranks in other layouts than they were saved in.

One spawned world does it all: ranks 0 and 1 save on their 2-rank submesh, all 4 ranks save on
theirs (1-D and 2-D meshes, uneven and empty chunks, replicated tensors written once), then every
rank loads both saves into DTensors laid out differently (1-D to 2-D, ``Shard(0)`` to ``Shard(1)``,
``Replicate``), through torch's ``DefaultLoadPlanner`` and through ``HFMappingPlanner`` with a
transformers ``Concatenate`` that fuses q, k, v. Values must be bit-identical to the saved tensors
(gathered whole on every rank) and each rank must read exactly the bytes of its own shards.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers.core_model_loading import Concatenate, WeightConverter

from hp_dcp_hf import HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.tools.launch import run_ranks

WORLD = 4
QKV = ("attn.q.weight", "attn.k.weight", "attn.v.weight")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    full = {
        "w": torch.randn(8, 6, generator=generator).to(torch.bfloat16),
        "u": torch.randn(7, 9, generator=generator),  # uneven on 2 and 4 ranks
        "e": torch.randn(3, 4, generator=generator),  # 3 rows: an empty chunk on the 4th rank
        "n": torch.randn(5, generator=generator),
        "s": torch.randn((), generator=generator),
    }
    sizes = dict(zip(QKV, (8, 4, 4), strict=True))
    return full | {key: torch.randn(rows, 6, generator=generator) for key, rows in sizes.items()}


def _save_layouts(mesh1: DeviceMesh, mesh2: DeviceMesh | None) -> dict[str, tuple[DeviceMesh, list]]:
    """How each tensor is saved: on 2 ranks (``mesh2`` None) or on 4 (2-D on ``mesh2``)."""
    if mesh2 is None:
        placements = {
            "w": [Shard(0)],
            "u": [Shard(1)],
            "e": [Shard(0)],
            "n": [Replicate()],
            "s": [Replicate()],
            QKV[0]: [Shard(0)],
            QKV[1]: [Shard(1)],
            QKV[2]: [Replicate()],
        }
        return {key: (mesh1, p) for key, p in placements.items()}
    return {
        "w": (mesh2, [Shard(0), Shard(1)]),
        "u": (mesh1, [Shard(0)]),
        "e": (mesh1, [Shard(0)]),
        "n": (mesh1, [Shard(0)]),
        "s": (mesh1, [Replicate()]),
        QKV[0]: (mesh1, [Shard(1)]),
        QKV[1]: (mesh2, [Shard(0), Replicate()]),
        QKV[2]: (mesh1, [Shard(0)]),
    }


def _load_placements(layout: str, ndim: int) -> list:
    """The layouts loaded into, none of them a layout a tensor was saved in."""
    if ndim == 0 or layout == "replicate":
        return [Replicate()] * (2 if layout == "2d" else 1)
    if layout == "2d":
        return [Shard(1), Shard(0)] if ndim == 2 else [Shard(0), Replicate()]
    return [Shard(ndim - 1)]  # "shard_last"


def _distributed(full: torch.Tensor, mesh: DeviceMesh, placements: list) -> DTensor:
    return distribute_tensor(full, mesh, placements, src_data_rank=None)  # every rank holds ``full``


def _nan_filled(full: torch.Tensor, mesh: DeviceMesh, placements: list) -> DTensor:
    """A DTensor of ``full``'s shape whose every local element is NaN (one a load misses stays NaN)."""
    tensor = _distributed(torch.empty_like(full), mesh, placements)
    tensor.to_local().fill_(float("nan"))
    return tensor


def _identical(loaded: DTensor, full: torch.Tensor) -> bool:
    whole = loaded.full_tensor()  # not always contiguous on torch 2.12
    return whole.shape == full.shape and torch.equal(
        whole.reshape(-1).view(torch.uint8), full.reshape(-1).view(torch.uint8)
    )


def _nbytes(tensor: DTensor) -> int:
    return tensor.to_local().numel() * tensor.dtype.itemsize


def _load(path: str, layout: str, meshes: dict[str, DeviceMesh], full: dict[str, torch.Tensor]) -> dict:
    """Every saved tensor, by DCP's DefaultLoadPlanner, into ``layout``."""
    state = {}
    for key, tensor in full.items():
        placements = _load_placements(layout, tensor.ndim)
        state[key] = _nan_filled(tensor, meshes["2d" if len(placements) == 2 else "1d"], placements)
    reader = HFStorageReader(path)
    dcp.load(state, storage_reader=reader)
    stats = reader.stats.total()
    metadata = reader.read_metadata()
    return {
        "identical": {key: _identical(state[key], tensor) for key, tensor in full.items()},
        "shapes": all(metadata.state_dict_metadata[k].size == t.shape for k, t in full.items()),
        "read": (stats.bytes_read, stats.bytes_needed, sum(_nbytes(t) for t in state.values())),
        "header_bytes": stats.header_bytes,
    }


def _load_fused(
    path: str, mesh: DeviceMesh, placements: list, full: dict[str, torch.Tensor], cooperate: str = "auto"
) -> dict:
    """q, k, v fused into ``attn.qkv.weight`` by ``Concatenate(dim=0)``, through HFMappingPlanner (the
    other saved tensors make no model tensor); ``cooperate="always"``: ranks holding the same values
    split the reads and exchange them."""
    fused = torch.cat([full[key] for key in QKV])
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.qkv = nn.Linear(6, fused.shape[0], bias=False)
    model.attn.qkv.weight = nn.Parameter(_nan_filled(fused, mesh, placements), requires_grad=False)
    reader = HFStorageReader(path, cooperate=cooperate)
    mapping = [WeightConverter(list(QKV), "attn.qkv.weight", [Concatenate(dim=0)])]
    report = load_hf_checkpoint(model, path, reader=reader, weights_mapping=mapping, unexpected="ignore")
    stats = reader.stats.total()
    return {
        "identical": _identical(model.attn.qkv.weight, fused),
        "loaded": sorted(report.loaded_keys),
        "read": (stats.bytes_read, stats.bytes_needed, _nbytes(model.attn.qkv.weight)),
    }


def _world(rank: int, world: int, root: str) -> dict:
    full = _tensors()
    meshes = {
        "1d": init_device_mesh("cpu", (world,)),
        "2d": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner")),
    }
    pair = meshes["2d"]["inner"]  # ranks {0, 1} and {2, 3}
    saves = {"2 ranks": f"{root}/two", "4 ranks": f"{root}/four"}
    if rank < 2:
        layouts = _save_layouts(pair, None)
        state = {key: _distributed(full[key], *layouts[key]) for key in full}
        dcp.save(
            state,
            storage_writer=HuggingFaceStorageWriter(saves["2 ranks"], save_distributed=True),
            process_group=pair.get_group(),
        )
    layouts = _save_layouts(meshes["1d"], meshes["2d"])
    state = {key: _distributed(full[key], *layouts[key]) for key in full}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(saves["4 ranks"], save_distributed=True))
    dist.barrier()
    out = {}
    for name, path in saves.items():
        for layout in ("2d", "shard_last", "replicate"):
            out[name, layout] = _load(path, layout, meshes, full)
        out[name, "fused rows"] = _load_fused(path, meshes["1d"], [Shard(0)], full)
        out[name, "fused 2d"] = _load_fused(path, meshes["2d"], [Shard(1), Shard(0)], full)
        out[name, "fused cooperating"] = _load_fused(
            path, meshes["1d"], [Replicate()], full, cooperate="always"
        )
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Where the two saves are, and what every rank found loading them."""
    root = tmp_path_factory.mktemp("torch-shards")
    results = run_ranks(WORLD, _world, str(root))
    files = {name: sorted(p.name for p in (root / name).iterdir()) for name in ("two", "four")}
    assert files == {
        "two": [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)],
        "four": [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2, 3, 4)],
    }
    return root, results


@pytest.fixture(scope="module")
def results(saved: tuple[Path, list[dict]]) -> list[dict]:
    return saved[1]


@pytest.mark.parametrize("save", ["2 ranks", "4 ranks"])
@pytest.mark.parametrize("layout", ["2d", "shard_last", "replicate"])
def test_resharded_load_is_bit_identical_and_reads_only_own_bytes(
    results: list[dict], save: str, layout: str
) -> None:
    for rank, result in enumerate(r[save, layout] for r in results):
        assert all(result["identical"].values()), (rank, result["identical"])
        assert result["shapes"], rank
        bytes_read, bytes_needed, shard_bytes = result["read"]
        assert bytes_read == bytes_needed == shard_bytes, (rank, result["read"])
    # rank 0 alone read the headers; the others got them (chunks and all) as JSON
    assert [r[save, layout]["header_bytes"] > 0 for r in results] == [True, False, False, False]


@pytest.mark.parametrize("save", ["2 ranks", "4 ranks"])
@pytest.mark.parametrize("layout", ["fused rows", "fused 2d"])
def test_fused_qkv_over_chunks(results: list[dict], save: str, layout: str) -> None:
    for rank, result in enumerate(r[save, layout] for r in results):
        assert result["identical"] and result["loaded"] == ["attn.qkv.weight"], (rank, result)
        bytes_read, bytes_needed, shard_bytes = result["read"]
        assert bytes_read == bytes_needed == shard_bytes > 0, (rank, result["read"])
    assert sum(r[save, layout]["read"][2] for r in results) == 16 * 6 * 4  # the ranks split qkv


@pytest.mark.parametrize("save", ["2 ranks", "4 ranks"])
def test_cooperating_ranks_read_each_chunk_once(results: list[dict], save: str) -> None:
    """Every rank holds the whole fused qkv; cooperating, the cluster reads each chunk's bytes once,
    each file (one span: the chunks are small) by a rank of its own, and the ranks exchange them."""
    read = [r[save, "fused cooperating"]["read"] for r in results]
    assert all(r[save, "fused cooperating"]["identical"] for r in results)
    assert all(bytes_read == bytes_needed for bytes_read, bytes_needed, _ in read), read
    assert sum(bytes_read for bytes_read, _, _ in read) == 16 * 6 * 4, read
    assert sum(r[0] > 0 for r in read) == {"2 ranks": 2, "4 ranks": 4}[save], read


def test_chunk_count_of_each_save(saved: tuple[Path, list[dict]]) -> None:
    """The saves really split tensors across files (else the loads above prove little)."""
    root, _ = saved
    for name, world, split in (
        ("two", 2, {"w", "u", "e", *QKV[:2]}),
        ("four", 4, {"w", "u", "e", "n", *QKV}),
    ):
        reader = HFStorageReader(root / name)
        reader.read_metadata()
        assert {k for k, t in reader.entries.items() if t.chunked} == split, name
        assert math.prod(reader.entries["w"].shape) == 48 and len(reader.entries["w"].parts) == world

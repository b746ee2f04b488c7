"""The reader's cold-cache options (``prefetch``: ``posix_fadvise(WILLNEED)`` ahead of the reads;
``direct_io``: ``O_DIRECT`` reads around the page cache) read the same bytes as the default reads,
row-sharded boxes, casts, transposes and ranges at unaligned offsets included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hp_dcp_hf import HFStorageReader
from hp_dcp_hf.storage.transport import fsspec_backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TENSORS = {
    "big": torch.arange(33 * 40, dtype=torch.float32).view(33, 40),  # 5280 bytes: crosses a page
    "bf16": torch.randn(17, 9, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "small": torch.tensor([1.0, 2.0, 3.0]),
    "ids": torch.arange(7, dtype=torch.int64),
    "rows": torch.randn(300, 24, generator=torch.Generator().manual_seed(1)),  # 28.8 KB: several pages
}
OPTIONS = {
    "default": {},
    "prefetch": {"prefetch": True},
    "direct": {"direct_io": True},
    "direct-preadv-gap0": {"direct_io": True, "coalesce_gap": 0},
    "both": {"prefetch": True, "direct_io": True},
    "prefetch-preadv": {"prefetch": True, "map_local_files": False},
}
STAGING = {"num_threads": 2, "staging_bytes": 4096}  # many small batches: the prefetcher's window matters


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cold")
    save_file(dict(list(TENSORS.items())[:3]), str(path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(TENSORS.items())[3:]), str(path / "model-00002-of-00002.safetensors"))
    return path


def _destinations() -> dict[str, torch.Tensor]:
    return {
        "big": torch.zeros(40, 33).t(),  # strided
        "bf16": torch.zeros(17, 9, dtype=torch.float32),  # cast
        "small": torch.zeros(3),
        "ids": torch.zeros(7, dtype=torch.int64),
        "rows": torch.zeros(300, 24),
    }


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_read_the_same_bytes(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    advised: list[tuple[int, int]] = []
    direct: list[bool] = []
    advise, use_direct = fsspec_backend._LocalFile.advise, fsspec_backend._LocalFile.use_direct_io
    monkeypatch.setattr(fsspec_backend._LocalFile, "advise",
                        lambda self, s, e: advised.append((s, e)) or advise(self, s, e))
    monkeypatch.setattr(fsspec_backend._LocalFile, "use_direct_io",
                        lambda self: direct.append(use_direct(self)) or direct[-1])
    state_dict = _destinations()
    reader = HFStorageReader(checkpoint, **STAGING, **OPTIONS[name])
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    for key, value in TENSORS.items():
        assert _bits(state_dict[key]) == _bits(value.to(state_dict[key].dtype)), key
    needed = sum(v.numel() * v.element_size() for v in TENSORS.values())
    total = reader.stats.total()
    assert total.bytes_needed == needed
    assert total.bytes_read == needed  # whole tensors: no hole to read across
    if OPTIONS[name].get("prefetch"):
        assert sum(e - s for s, e in advised) >= needed  # every byte read was advised first
    else:
        assert not advised
    assert bool(direct) == bool(OPTIONS[name].get("direct_io"))
    if direct and hasattr(os, "O_DIRECT"):
        assert all(direct)  # tmp_path's file system takes O_DIRECT here (ext4)


def _row_items(key: str, rows: tuple[int, int], cols: tuple[int, int]) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key), dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex(key, torch.Size([0, 0])),
                    storage_offsets=torch.Size([rows[0], cols[0]]),
                    lengths=torch.Size([rows[1] - rows[0], cols[1] - cols[0]]))


@pytest.mark.parametrize("name", ["default", "direct", "direct-preadv-gap0", "both"])
def test_row_sharded_box_at_unaligned_offsets(checkpoint: Path, name: str) -> None:
    """A column-sharded box of ``rows`` (one range per row, none aligned to a page): the same values
    and the same needed bytes whatever the option; ``direct_io`` reads across the sub-page holes."""
    reader = HFStorageReader(checkpoint, **STAGING, **OPTIONS[name])
    reader.read_metadata()
    item = _row_items("rows", (3, 291), (5, 17))
    want = TENSORS["rows"][3:291, 5:17]

    class Planner:
        def __init__(self) -> None:
            self.out = torch.full(tuple(want.shape), float("nan"))

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            return self.out

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass

    planner = Planner()
    from torch.distributed.checkpoint.planner import LoadPlan

    reader.read_data(LoadPlan([item]), planner).wait()
    assert torch.equal(planner.out, want)
    total = reader.stats.total()
    assert total.bytes_needed == want.numel() * 4
    if OPTIONS[name].get("direct_io") and OPTIONS[name].get("coalesce_gap") is None:
        assert total.bytes_read > total.bytes_needed  # the 48-byte holes between rows are read across
        assert total.requests < total.ranges
    else:
        assert total.bytes_read == total.bytes_needed

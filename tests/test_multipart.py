"""Saving to S3 as multipart uploads, in one process: the parts arithmetic, a box's runs inside a
part's window, and saves against moto's S3 server (objects equal the local save byte for byte; an
aborted save leaves no object and no pending upload, and an older checkpoint as it was)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hp_dcp_hf
from hp_dcp_hf.errors import StorageWriteError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.files import SavedTensor
from hp_dcp_hf.storage.write.destination import BoxWrite, box_runs
from hp_dcp_hf.storage.write.multipart import MultipartUploads
from hp_dcp_hf.storage.write.parts import MAX_PARTS, MIN_PART_BYTES, file_parts, part_size, rounds
from tests.support.boxes import tensor_and_box
from tests.support.checkpoints import anonymized, big_llama, local_files
from tests.support.servers.s3 import BUCKET, objects, pending_uploads

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- parts ------------------------------------------------------------------------------------------


def test_parts_are_fixed_ranges_and_each_round_gives_a_rank_at_most_one():
    parts = file_parts([("a", 12 * 2**20), ("b", 3)], MIN_PART_BYTES)
    assert [(p.file, p.number, p.start, p.end) for p in parts] == [
        ("a", 1, 0, MIN_PART_BYTES), ("a", 2, MIN_PART_BYTES, 2 * MIN_PART_BYTES),
        ("a", 3, 2 * MIN_PART_BYTES, 12 * 2**20), ("b", 1, 0, 3)]
    grouped = rounds(parts, 3)
    assert [[part for _, part in r] for r in grouped] == [parts[:3], parts[3:]]
    assert [[owner for owner, _ in r] for r in grouped] == [[0, 1, 2], [2]]  # the smallest upload so far gets more


def test_a_huge_file_gets_bigger_parts_and_small_parts_are_refused():
    size = 100_000 * MIN_PART_BYTES
    assert len(file_parts([("a", size)], MIN_PART_BYTES)) <= MAX_PARTS
    assert part_size(size, MIN_PART_BYTES) % 2**20 == 0
    with pytest.raises(ValueError, match="at least"):
        part_size(10, MIN_PART_BYTES - 1)


# -- a box's runs in a window -------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(tensor_and_box(min_size=1), st.integers(0, 3), st.integers(1, 40), st.booleans())
def test_windowed_runs_partition_the_box_bytes(case, lead, window, cast):
    """Cutting the file into windows and writing each window's runs writes what the whole box does."""
    shape, box, dtype = case
    file_dtype = torch.float32 if cast else dtype
    tensor = SavedTensor("w", "f", file_dtype, shape, lead * file_dtype.itemsize)
    size = tensor.start + tensor.nbytes
    values = (torch.arange(math.prod(box.sizes)) % 97).to(dtype).reshape(box.sizes)
    write = BoxWrite(tensor, box, values)

    def written(windows):
        out = bytearray(size)
        for w in windows:
            for offset, run in box_runs(write, 8, w):
                assert w is None or w[0] <= offset and offset + len(run) <= w[1]
                out[offset : offset + len(run)] = run
        return out

    whole = written([None])
    assert written([(lo, lo + window) for lo in range(0, size, window)]) == whole
    expected = bytearray(size)
    full = torch.zeros(shape, dtype=file_dtype)
    full[box.slices()] = values.to(file_dtype)
    expected[tensor.start :] = full.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert whole == expected


# -- saves against moto -------------------------------------------------------------------------


def test_s3_save_is_the_local_save_byte_for_byte(moto, tmp_path):
    model = big_llama()
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "local", max_shard_size="12MB")
    writer = hp_dcp_hf.HFStorageWriter(f"s3://{BUCKET}/llama", max_shard_size="12MB", part_bytes=MIN_PART_BYTES,
                                       **moto.storage_options())
    hp_dcp_hf.save_hf_checkpoint(model, f"s3://{BUCKET}/llama", writer=writer)
    local = local_files(tmp_path / "local")
    assert len([n for n in local if n.endswith(".safetensors")]) == 2
    assert all(len(data) > MIN_PART_BYTES for n, data in local.items() if n.endswith(".safetensors"))  # 2+ parts
    assert anonymized(objects(moto, "llama")) == anonymized(local)
    assert writer.destination.bytes_uploaded == sum(len(d) for n, d in local.items() if n.endswith(".safetensors"))
    assert writer.destination.bytes_sent == 0  # one rank: every part is its own
    assert pending_uploads(moto) == []
    reloaded = big_llama(seed=1)
    hp_dcp_hf.load_hf_checkpoint(reloaded, f"s3://{BUCKET}/llama", storage_options=moto.storage_options())
    for (name, ours), theirs in zip(reloaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_a_failed_s3_save_leaves_no_object_and_the_older_checkpoint(moto, tmp_path, monkeypatch):
    prefix = "failing"
    hp_dcp_hf.save_hf_checkpoint(big_llama(), f"s3://{BUCKET}/{prefix}", max_shard_size="12MB",
                                 **moto.storage_options())
    before = objects(moto, prefix)
    real = MultipartUploads.upload

    def upload(self, staged, part, data):
        if part.number == 2:
            raise OSError(28, "No space left on device")
        return real(self, staged, part, data)

    monkeypatch.setattr(MultipartUploads, "upload", upload)
    with pytest.raises(StorageWriteError, match="No space left") as caught:
        hp_dcp_hf.save_hf_checkpoint(big_llama(seed=2), f"s3://{BUCKET}/{prefix}", max_shard_size="12MB",
                                     part_bytes=MIN_PART_BYTES, **moto.storage_options())
    assert f"s3://{BUCKET}/{prefix}" in str(caught.value)
    assert objects(moto, prefix) == before
    assert pending_uploads(moto) == []
    with pytest.raises(StorageWriteError, match="No space left"):
        hp_dcp_hf.save_hf_checkpoint(big_llama(seed=2), f"s3://{BUCKET}/fresh", part_bytes=MIN_PART_BYTES,
                                     **moto.storage_options())
    assert objects(moto, "fresh") == {} and pending_uploads(moto) == []


def test_a_smaller_checkpoint_replaces_a_sharded_one_entirely(moto):
    prefix = "shrinking"
    hp_dcp_hf.save_hf_checkpoint(big_llama(), f"s3://{BUCKET}/{prefix}", max_shard_size="12MB",
                                 **moto.storage_options())
    assert "model.safetensors.index.json" in objects(moto, prefix)
    hp_dcp_hf.save_hf_checkpoint(big_llama(), f"s3://{BUCKET}/{prefix}", **moto.storage_options())
    assert sorted(objects(moto, prefix)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_box_runs_cover_a_part_exactly_or_the_part_is_refused():
    """What a part's owner checks before uploading: every byte of the part, once."""
    from hp_dcp_hf.storage.write.multipart import _assemble
    from hp_dcp_hf.storage.write.parts import Part

    part = Part("f", 1, 0, 16)
    header = b"12345678"
    rows = torch.tensor([[8, 4], [12, 4]])
    buffer = _assemble(part, header, rows, torch.arange(8, dtype=torch.uint8))
    assert bytes(buffer.numpy()) == header + bytes(range(8))
    for bad in ([[8, 4]], [[8, 4], [11, 5]], [[8, 8], [12, 4]]):
        with pytest.raises(StorageWriteError, match="exactly once"):
            _assemble(part, header, torch.tensor(bad), torch.zeros(sum(n for _, n in bad), dtype=torch.uint8))


def test_box_write_span_is_the_box_bytes():
    tensor = SavedTensor("w", "f", torch.float32, (4, 6), 8)
    assert BoxWrite(tensor, Box((1, 2), (2, 3)), torch.zeros(2, 3)).span() == (8 + 32, 8 + 4 * (13 + 3 * 1) + 4)

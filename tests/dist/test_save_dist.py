"""``save_hf_checkpoint`` on 2 and 4 gloo ranks: every rank writes its own shards' bytes at their
final offsets, and the result is what ``save_pretrained`` wrote for the unsharded, unrewritten
model: same file names, same keys in each file, bit-identical tensors, same index and config.

Layouts, as transformers' plans give them: TP (uneven: the tiny models' sizes avoid factors of 2),
FSDP2 over TP (``_StridedShard``), HSDP (replicas write in turns), EP, and the rewrites
(``fuse_qkv`` laid out in rank order under TP, ``grouped_gemm_experts``). Each rank's bytes
written equal its planned bytes, and over the ranks they add up to the files' tensor data exactly:
no byte is written twice. A rank whose write fails makes every rank raise, and nothing is published.
"""

from __future__ import annotations

import os

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.checkpoints import SHARD, anonymized, assert_same_checkpoint
from tests.support.families import build_family_model, family_model_class, save_family_model

CASES = {  # name -> (family, mesh, transforms)
    "llama-dp2tp2": ("llama", "dp=2,tp=2", ()),
    "llama-fused": ("llama", "dp=2,tp=2", ("fuse_qkv", "fuse_gate_up")),
    "llama-hsdp": ("llama", "dp_replicate=2,tp=2", ()),
    "mixtral-ep4": ("mixtral", "ep=4", ()),
    "mixtral-rewritten": ("mixtral", "dp=2,tp=2", ("fuse_qkv", "grouped_gemm_experts")),
    "qwen3_moe-dp4": ("qwen3_moe", "dp=4", ()),
    "gte-dp2tp2": ("gte", "dp=2,tp=2", ()),
}
CASES_2 = {
    "llama-tp2": ("llama", "tp=2", ()),
    "mixtral-dp2": ("mixtral", "dp=2", ()),
}


def _save(rank: int, world: int, cases: dict, paths: dict, out: str) -> dict:
    import warnings

    from hp_dcp_hf import HFSavePlanner, HFStorageWriter, from_pretrained, save_hf_checkpoint

    results = {}
    for name, (family, mesh, transforms) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = from_pretrained(paths[family], dtype=torch.float32, model_cls=family_model_class(family),
                                       distributed_config=mesh, transforms=transforms)
            planner = HFSavePlanner(model)
            writer = HFStorageWriter(os.path.join(out, name), max_shard_size=SHARD)
            save_hf_checkpoint(model, os.path.join(out, name), planner=planner, writer=writer)
        results[name] = {"written": writer.bytes_written, "planned": planner.bytes_planned}
    return results


def _failing_save(rank: int, world: int, path: str, out: str) -> str:
    import warnings

    from hp_dcp_hf import from_pretrained, save_hf_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = from_pretrained(path, dtype=torch.float32, model_cls=family_model_class("llama"), distributed_config="dp=2")
    if rank == 1:
        real = os.pwrite

        def failing(fd, data, offset):
            raise OSError(5, "Input/output error")

        os.pwrite = failing
    try:
        save_hf_checkpoint(model, out, max_shard_size=SHARD)
    except Exception as e:  # noqa: BLE001 - the test checks the type
        return type(e).__name__ + ": " + str(e)
    finally:
        if rank == 1:
            os.pwrite = real
    return "saved"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("save-dist")
    families = {family for family, _, _ in [*CASES.values(), *CASES_2.values()]}
    return root, {f: str(save_family_model(build_family_model(f), root / f, SHARD)) for f in sorted(families)}


@pytest.fixture(scope="module")
def saved_4(checkpoints):
    root, paths = checkpoints
    return run_ranks(4, _save, CASES, paths, str(root / "out4"), timeout=400)


@pytest.fixture(scope="module")
def saved_2(checkpoints):
    root, paths = checkpoints
    return run_ranks(2, _save, CASES_2, paths, str(root / "out2"), timeout=400)


def _tensor_bytes(path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(f.get_slice(k).get_shape() and _nbytes(f.get_slice(k)) for k in f.keys())  # noqa: SIM118
    return total


def _nbytes(tensor_slice) -> int:
    import math

    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    return math.prod(tensor_slice.get_shape()) * sizes[tensor_slice.get_dtype()]


@pytest.mark.parametrize("case", list(CASES))
def test_4_ranks_write_what_save_pretrained_wrote(checkpoints, saved_4, case):
    root, paths = checkpoints
    family = CASES[case][0]
    assert_same_checkpoint(root / "out4" / case, root / family)
    written = [r[case]["written"] for r in saved_4]
    assert written == [r[case]["planned"] for r in saved_4]
    assert sum(written) == _tensor_bytes(root / family)  # each byte once


@pytest.mark.parametrize("case", list(CASES_2))
def test_2_ranks_write_what_save_pretrained_wrote(checkpoints, saved_2, case):
    root, _ = checkpoints
    assert_same_checkpoint(root / "out2" / case, root / CASES_2[case][0])
    assert sum(r[case]["written"] for r in saved_2) == _tensor_bytes(root / CASES_2[case][0])


def test_replicas_share_the_writing(saved_4):
    """HSDP: two replicas of every shard; both write, neither writes everything."""
    written = [r["llama-hsdp"]["written"] for r in saved_4]
    assert all(w > 0 for w in written)


def test_a_rank_failing_fails_every_rank_and_publishes_nothing(checkpoints):
    root, paths = checkpoints
    out = root / "failed"
    outcomes = run_ranks(2, _failing_save, paths["llama"], str(out), timeout=300)
    assert all(o.startswith("StorageWriteError") for o in outcomes), outcomes
    assert not out.exists() or not any(p.suffix == ".safetensors" or p.name.startswith(".hp-dcp-hf")
                                       for p in out.iterdir())


# -- S3: multipart uploads, parts assembled from every rank's bytes ----------------------------------


def _s3_save(rank: int, world: int, checkpoint: str, out: str, prefix: str, options: dict) -> dict:
    """Save to a local directory and to S3 under dp=2,tp=2, then save again to S3 with rank 2's
    uploads failing, and with rank 1 failing before its first byte: the first save's objects must
    survive."""
    import warnings

    from hp_dcp_hf import HFSavePlanner, HFStorageWriter, from_pretrained, save_hf_checkpoint
    from hp_dcp_hf.errors import MappingError
    from hp_dcp_hf.storage.write.multipart import MultipartUploads
    from hp_dcp_hf.storage.write.parts import MIN_PART_BYTES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = from_pretrained(checkpoint, dtype=torch.float32, model_cls=family_model_class("llama"), distributed_config="dp=2,tp=2")
        save_hf_checkpoint(model, out, max_shard_size="12MB")
        writer = HFStorageWriter(prefix, max_shard_size="12MB", part_bytes=MIN_PART_BYTES, **options)
        save_hf_checkpoint(model, prefix, writer=writer)
        result = {"written": writer.bytes_written, "sent": writer.destination.bytes_sent,
                  "uploaded": writer.destination.bytes_uploaded}
        if rank == 2:
            def failing(self, staged, part, data):
                raise OSError(5, "Input/output error")

            MultipartUploads.upload = failing
        try:
            save_hf_checkpoint(model, prefix, max_shard_size="12MB", part_bytes=MIN_PART_BYTES, **options)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            result["failure"] = f"{type(e).__name__}: {e}"
        if rank == 1:  # fails before its first byte: the others must not wait for its runs
            def unresolvable(self, item):
                raise MappingError("injected: no data for this item", key=item.index.fqn)

            HFSavePlanner.resolve_data = unresolvable
        try:
            save_hf_checkpoint(model, prefix, max_shard_size="12MB", part_bytes=MIN_PART_BYTES, **options)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            result["early_failure"] = f"{type(e).__name__}: {e}"
    return result


def test_4_ranks_save_to_s3_what_they_save_locally(tmp_path):
    from hp_dcp_hf.storage.write.parts import MIN_PART_BYTES
    from tests.support.checkpoints import big_llama, local_files
    from tests.support.servers.s3 import BUCKET, MotoS3, objects, pending_uploads

    checkpoint = save_family_model(big_llama(), tmp_path / "reference", "12MB")
    moto = MotoS3(tmp_path / "recording.jsonl")
    try:
        moto.create_bucket(BUCKET)
        results = run_ranks(4, _s3_save, str(checkpoint), str(tmp_path / "local"), f"s3://{BUCKET}/dist",
                            moto.storage_options(), timeout=300)
        local = local_files(tmp_path / "local")
        assert anonymized(objects(moto, "dist")) == anonymized(local)  # byte for byte, after the failed save too
        assert pending_uploads(moto) == []
    finally:
        moto.stop()
    assert all(r["failure"].startswith("StorageWriteError") and "Input/output error" in r["failure"]
               for r in results), results
    assert all(r["early_failure"].startswith("MappingError") and "injected" in r["early_failure"] for r in results)
    weights = {name: len(data) for name, data in local.items() if name.endswith(".safetensors")}
    assert sum(r["written"] for r in results) == _tensor_bytes(tmp_path / "local")  # each byte once
    assert sum(r["uploaded"] for r in results) == sum(weights.values())  # each part once, by one rank
    assert all(0 < r["sent"] <= r["written"] for r in results)  # parts gather bytes from several ranks
    assert max(r["uploaded"] for r in results) <= min(r["uploaded"] for r in results) + 2 * MIN_PART_BYTES

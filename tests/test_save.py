"""Saving back to Hugging Face format in one process: ``save_hf_checkpoint`` writes what
``save_pretrained`` writes (same file names, same keys in each file, bit-identical tensors, same
index and config), after rewrites too, cast when asked, atomically.

The oracle is transformers' ``save_pretrained`` of the unrewritten model that wrote the checkpoint
(``tests.families``: tiny models with distinct random values); checkpoints are split at 20 KB so
the tiny models span several files and an index.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hp_dcp_hf
from hp_dcp_hf.errors import PlanningError, StorageWriteError
from hp_dcp_hf.storage.files import layout_file
from hp_dcp_hf.storage.journal import INDEX_FILE, SAVE_ID_KEY, STAGING_PREFIX
from tests.families import build_family_model, family_model_class, save_family_model

SHARD = "20KB"
FAMILIES = ("llama", "mixtral", "gte", "qwen3_moe", "gradium_phonon_tts")  # tied, MoE merge, Chunk, PermuteForRope

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def save_id_of(file: Path) -> str | None:
    """The save id in a safetensors file's ``__metadata__`` (None for save_pretrained's files)."""
    with safe_open(file, "pt") as handle:
        return (handle.metadata() or {}).get(SAVE_ID_KEY)


def anonymized(files: dict[str, bytes]) -> dict[str, bytes]:
    """Files' bytes with every save id zeroed: two saves of the same model compare equal."""
    pattern = re.compile(rb'("' + SAVE_ID_KEY.encode() + rb'": ?")[0-9a-f]{32}"')
    return {name: pattern.sub(rb'\g<1>' + b"0" * 32 + b'"', data) for name, data in files.items()}


def assert_same_checkpoint(ours: Path, reference: Path) -> None:
    """Same files; in each safetensors file the same keys, dtypes, shapes and bits; same index and
    config. Ours carry one save id, in every file's header and in the index (its only difference)."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())
    ids = set()
    for file in reference.glob("*.safetensors"):
        expected, actual = load_file(file), load_file(ours / file.name)
        assert sorted(actual) == sorted(expected), file.name
        for key, value in expected.items():
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        ids.add(save_id_of(ours / file.name))
    assert len(ids) == 1 and re.fullmatch("[0-9a-f]{32}", ids.pop() or ""), ids
    for name in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        if (reference / name).exists():
            actual = json.loads((ours / name).read_text())
            if name == INDEX_FILE:
                assert actual["metadata"].pop(SAVE_ID_KEY) == save_id_of(ours / next(iter(actual["weight_map"].values())))
            assert actual == json.loads((reference / name).read_text()), name


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """A family's model and the checkpoint its ``save_pretrained`` wrote."""
    model = build_family_model(request.param)
    path = save_family_model(model, tmp_path_factory.mktemp(request.param) / "reference", SHARD)
    return request.param, model, path


def test_save_writes_what_save_pretrained_writes(saved, tmp_path):
    _, model, reference = saved
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", max_shard_size=SHARD)
    assert_same_checkpoint(tmp_path / "ours", reference)


def test_load_save_load_round_trip(saved, tmp_path):
    """A model loaded by hp-dcp-hf saves back to the checkpoint it came from, which transformers
    loads bit for bit."""
    family, model, reference = saved
    loaded, _ = hp_dcp_hf.from_pretrained(str(reference), model_cls=family_model_class(family))
    hp_dcp_hf.save_hf_checkpoint(loaded, tmp_path / "ours", max_shard_size=SHARD)
    assert_same_checkpoint(tmp_path / "ours", reference)
    again = family_model_class(family).from_pretrained(tmp_path / "ours").state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("transforms", [("fuse_qkv", "fuse_gate_up"), ("fuse_qkv", "grouped_gemm_experts")],
                         ids=["fused", "grouped-experts"])
def test_rewritten_models_save_unrewritten(transforms, tmp_path):
    """Fused q/k/v, gate/up and stacked, transposed experts write back into the original keys."""
    family = "mixtral" if "grouped_gemm_experts" in transforms else "llama"
    model = build_family_model(family)
    reference = save_family_model(model, tmp_path / "reference", SHARD)
    rewritten, _ = hp_dcp_hf.from_pretrained(str(reference), model_cls=family_model_class(family), transforms=transforms)
    hp_dcp_hf.save_hf_checkpoint(rewritten, tmp_path / "ours", max_shard_size=SHARD)
    assert_same_checkpoint(tmp_path / "ours", reference)


def test_dtype_casts_on_write(tmp_path):
    model = build_family_model("mixtral")
    reference = save_family_model(build_family_model("mixtral", dtype=torch.bfloat16), tmp_path / "reference", SHARD)
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", max_shard_size=SHARD, dtype=torch.bfloat16)
    for file in reference.glob("*.safetensors"):
        expected, actual = load_file(file), load_file(tmp_path / "ours" / file.name)
        assert {v.dtype for v in actual.values()} == {torch.bfloat16}
        assert all(torch.equal(actual[k], v) for k, v in expected.items())


def test_headers_follow_the_safetensors_format(tmp_path):
    """8-byte length, JSON padded to 8 bytes, tensors aligned to their dtype, offsets contiguous."""
    saved = layout_file("x.safetensors", {"b": (torch.bfloat16, (3, 5)), "a": (torch.float32, (7,)),
                                          "c": (torch.int64, (2,))})
    assert len(saved.header) % 8 == 0
    assert [t.key for t in saved.tensors] == ["c", "a", "b"]  # widest elements first
    assert all(t.start % t.dtype.itemsize == 0 for t in saved.tensors)
    from safetensors import safe_open

    path = tmp_path / "x.safetensors"
    path.write_bytes(saved.header + bytes(saved.size - len(saved.header)))
    with safe_open(path, "pt") as f:
        assert {k: f.get_slice(k).get_shape() for k in f.keys()} == {"a": [7], "b": [3, 5], "c": [2]}  # noqa: SIM118


# -- faults ---------------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_older_checkpoint(tmp_path, monkeypatch):
    """An I/O error midway: StorageWriteError, the older checkpoint at the path byte for byte as it
    was, no staging directory left, nothing new published."""
    model = build_family_model("llama")
    old = save_family_model(build_family_model("llama", seed=1), tmp_path / "ckpt", SHARD)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def failing_pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    with pytest.raises(StorageWriteError) as raised:
        hp_dcp_hf.save_hf_checkpoint(model, old, max_shard_size=SHARD)
    assert "No space left" in str(raised.value)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert not [p for p in old.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_a_model_without_a_config_is_refused_before_writing(tmp_path):
    with pytest.raises(PlanningError):
        hp_dcp_hf.save_hf_checkpoint(torch.nn.Linear(3, 4), tmp_path / "ours")
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())


def test_tied_embeddings_are_written_once(tiny_checkpoints, tmp_path):
    """A tied lm_head is not a checkpoint tensor: the embedding is written under the name
    ``save_pretrained`` keeps, once."""
    from tests.conftest import DEFAULT_SHARD_SIZE
    from tests.models import model_class

    llama = tiny_checkpoints("llama", torch.bfloat16)
    model, _ = hp_dcp_hf.from_pretrained(str(llama.path), dtype=torch.bfloat16, model_cls=model_class("llama"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", max_shard_size=DEFAULT_SHARD_SIZE)
    assert_same_checkpoint(tmp_path / "ours", llama.path)


@pytest.mark.parametrize("url", ["memory://model", "gs://bucket/model", "https://example.com/model"])
def test_stores_without_a_writer_are_refused_before_anything_is_planned(tmp_path, url):
    with pytest.raises(StorageWriteError, match="local or shared file systems and to S3"):
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama"), url)
    model = build_family_model("llama")
    hp_dcp_hf.save_hf_checkpoint(model, f"file://{tmp_path / 'ours'}", max_shard_size=SHARD)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()

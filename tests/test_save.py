"""Saving back to Hugging Face format in one process: ``save_hf_checkpoint`` writes what
``save_pretrained`` writes (same file names, same keys in each file, bit-identical tensors, same
index and config), after rewrites too, cast when asked, atomically.

The oracle is transformers' ``save_pretrained`` of the unrewritten model that wrote the checkpoint
(``tests.support.families``: tiny models with distinct random values); checkpoints are split at 20 KB so
the tiny models span several files and an index.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hp_dcp_hf
from hp_dcp_hf.errors import (
    ArgumentError,
    InterruptedSaveError,
    MappingError,
    MixedCheckpointError,
    PlanningError,
    StorageWriteError,
)
from hp_dcp_hf.storage.format.files import layout_file
from hp_dcp_hf.storage.format.journal import INDEX_FILE, STAGING_PREFIX
from hp_dcp_hf.tools.inspection import inspect_checkpoint
from tests.support.checkpoints import SHARD, assert_same_checkpoint
from tests.support.families import build_family_model, family_model_class, save_family_model

FAMILIES = ("llama", "mixtral", "gte", "qwen3_moe", "gradium_phonon_tts")  # tied, MoE merge, Chunk, PermuteForRope

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


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
    """The files hold the dtype asked for and ``config.json`` names it, as ``save_pretrained`` of the
    model in that dtype writes it; transformers then loads it in that dtype."""
    model = build_family_model("mixtral")
    reference = save_family_model(build_family_model("mixtral", dtype=torch.bfloat16), tmp_path / "reference", SHARD)
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", max_shard_size=SHARD, dtype=torch.bfloat16)
    assert_same_checkpoint(tmp_path / "ours", reference)
    for file in reference.glob("*.safetensors"):
        assert {v.dtype for v in load_file(tmp_path / "ours" / file.name).values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = family_model_class("mixtral").from_pretrained(tmp_path / "ours")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_config_is_save_pretrained_s_for_a_model_built_from_a_config(tmp_path, dtype):
    """``dtype`` and ``architectures`` as ``save_pretrained`` writes them, for a model it never saw
    (``save_pretrained`` sets both on the model's config; ours leaves the model as it was)."""
    ours, theirs = build_family_model("llama", dtype=dtype), build_family_model("llama", dtype=dtype)
    hp_dcp_hf.save_hf_checkpoint(ours, tmp_path / "ours")
    assert ours.config.architectures is None  # the model's own config is not changed
    theirs.save_pretrained(tmp_path / "theirs")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config == json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == str(dtype).removeprefix("torch.")


def test_max_shard_size_defaults_to_save_pretrained_s(tmp_path):
    import inspect

    from transformers import PreTrainedModel

    from hp_dcp_hf.storage.format.files import save_pretrained_max_shard_size

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert save_pretrained_max_shard_size() == default
    hp_dcp_hf.save_hf_checkpoint(build_family_model("llama"), tmp_path / "ours")
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "generation_config.json",
                                                                     "model.safetensors"]


def test_headers_follow_the_safetensors_format(tmp_path):
    """8-byte length, JSON padded to 8 bytes, tensors aligned to their dtype, offsets contiguous."""
    saved = layout_file("x.safetensors", {"b": (torch.bfloat16, (3, 5)), "a": (torch.float32, (7,)),
                                          "c": (torch.int64, (2,))})
    assert len(saved.header) % 8 == 0
    assert [t.key for t in saved.tensors] == ["c", "a", "b"]  # widest elements first
    assert all(t.start % t.dtype.itemsize == 0 for t in saved.tensors)

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


def test_a_shard_of_another_save_is_refused_naming_it(tmp_path):
    """A mix made by hand: one shard copied in from another save (ours or save_pretrained's) is a
    MixedCheckpointError naming that file, for hp-dcp-hf's reader and its inspect."""
    for seed, name in ((1, "a"), (2, "b")):
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama", seed=seed), tmp_path / name, max_shard_size=SHARD)
    save_family_model(build_family_model("llama", seed=3), tmp_path / "theirs", SHARD)
    shard = sorted((tmp_path / "a").glob("model-*.safetensors"))[1].name
    for source in ("b", "theirs"):
        mixed = tmp_path / f"mixed-{source}"
        shutil.copytree(tmp_path / "a", mixed)
        shutil.copy(tmp_path / source / shard, mixed / shard)
        model = build_family_model("llama", seed=4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(MixedCheckpointError, match=f"files of another save: '{shard}'") as raised:
            hp_dcp_hf.load_hf_checkpoint(model, str(mixed))
        assert raised.value.file == shard
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded
        with pytest.raises(MixedCheckpointError):
            inspect_checkpoint(str(mixed))
    hp_dcp_hf.load_hf_checkpoint(build_family_model("llama"), str(tmp_path / "theirs"))  # no ids: loads as ever


def test_two_saves_into_one_path_at_once(tmp_path, monkeypatch):
    """While one save writes, a second into the same path raises at once and changes nothing; the
    first completes, and the path holds its checkpoint whole."""
    from hp_dcp_hf.storage.write.destination import Directory

    first, second = build_family_model("llama", seed=1), build_family_model("llama", seed=2)
    writing, release = threading.Event(), threading.Event()
    real_write = Directory.write

    def slow_write(self, *args, **kwargs):
        if threading.current_thread().name == "first":
            writing.set()
            release.wait(30)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Directory, "write", slow_write)
    errors: list[BaseException] = []

    def save_first():
        try:
            hp_dcp_hf.save_hf_checkpoint(first, tmp_path / "ckpt", max_shard_size=SHARD)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=save_first, name="first")
    thread.start()
    assert writing.wait(30)
    with pytest.raises(StorageWriteError, match="another save into this path is running") as raised:
        hp_dcp_hf.save_hf_checkpoint(second, tmp_path / "ckpt", max_shard_size=SHARD)
    assert f"pid {os.getpid()}" in str(raised.value).replace('"pid": ', "pid ")
    release.set()
    thread.join(30)
    assert errors == []
    loaded = build_family_model("llama", seed=3)
    hp_dcp_hf.load_hf_checkpoint(loaded, str(tmp_path / "ckpt"))
    assert all(torch.equal(v, first.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".hp-dcp-hf")]


def test_a_publish_interrupted_in_its_hole_is_named_and_repaired(tmp_path, capsys, monkeypatch):
    """A save whose config differs removes the old entry file before writing config.json: killed
    there, both readers refuse the path (no mix); ``hp-dcp-hf repair`` completes the new checkpoint."""
    from hp_dcp_hf.storage.write.destination import Directory
    from hp_dcp_hf.tools.cli import main

    path = save_family_model(build_family_model("llama", seed=1), tmp_path / "ckpt", SHARD)
    model = build_family_model("llama", seed=2, dtype=torch.bfloat16)  # another dtype: another config.json

    class Killed(Exception):
        """The process dies here: nothing after this step runs but the kernel closing its files."""

    real_write_text = Directory.write_text

    def write_text(self, name, text):
        if name == "config.json":
            raise Killed
        return real_write_text(self, name, text)

    monkeypatch.setattr(Directory, "write_text", write_text)
    monkeypatch.setattr(Directory, "abort", lambda self, staged: os.close(self._lock_fd))
    with pytest.raises(StorageWriteError, match="Killed"):
        hp_dcp_hf.save_hf_checkpoint(model, path, max_shard_size=SHARD)
    monkeypatch.undo()
    assert INDEX_FILE not in os.listdir(path)
    with pytest.raises(InterruptedSaveError, match="repair"):
        hp_dcp_hf.load_hf_checkpoint(build_family_model("llama"), str(path))
    with pytest.raises(OSError, match="no file named"):
        family_model_class("llama").from_pretrained(path)
    assert main(["repair", str(path)]) == 0
    assert "completed the publish of save" in capsys.readouterr().out
    loaded = build_family_model("llama", dtype=torch.bfloat16)
    hp_dcp_hf.load_hf_checkpoint(loaded, str(path))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert not [p for p in path.iterdir() if p.name.startswith(".hp-dcp-hf")]


def test_model_safetensors_is_read_before_an_index(tmp_path):
    """As transformers reads a directory: ``model.safetensors`` wins over an index beside it."""
    path = save_family_model(build_family_model("llama", seed=1), tmp_path / "ckpt", SHARD)
    single = save_family_model(build_family_model("llama", seed=2), tmp_path / "single")
    shutil.copy(single / "model.safetensors", path / "model.safetensors")
    ours, theirs = build_family_model("llama"), family_model_class("llama").from_pretrained(path)
    hp_dcp_hf.load_hf_checkpoint(ours, str(path))
    assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())
    assert torch.equal(ours.model.norm.weight, build_family_model("llama", seed=2).model.norm.weight)


def test_a_model_without_a_config_is_refused_before_writing(tmp_path):
    with pytest.raises(PlanningError):
        hp_dcp_hf.save_hf_checkpoint(torch.nn.Linear(3, 4), tmp_path / "ours")
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())


@pytest.mark.parametrize("where", ["path", "parent"])
def test_a_path_through_a_file_is_refused_naming_it(tmp_path, where):
    """A path that is a file, or lies under one, is a typed error naming it; the file stays as it was."""
    file = tmp_path / "a-file"
    file.write_bytes(b"not a directory")
    path = file if where == "path" else file / "model"
    with pytest.raises(StorageWriteError) as info:
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama"), path)
    assert info.value.file == str(path) and "the path is not a directory" in info.value.reason
    assert file.read_bytes() == b"not a directory"


def test_a_shard_size_in_units_save_pretrained_refuses_is_refused_before_writing(tmp_path):
    """``"20KiB"`` is no size ``save_pretrained`` takes either: an ArgumentError, no directory made."""
    with pytest.raises(ArgumentError, match=r"max_shard_size='20KiB'.*Supported units"):
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama"), tmp_path / "ours", max_shard_size="20KiB")
    assert not (tmp_path / "ours").exists()


def test_a_tensor_named_like_the_header_metadata_is_refused_before_writing(tmp_path):
    """safetensors keeps ``__metadata__`` for the header's own entry: a tensor of that name would
    take its place (and the file's save id with it); it is a typed error, and nothing is written."""
    module = torch.nn.Module()
    module.register_parameter("__metadata__", torch.nn.Parameter(torch.ones(2)))
    module.weight = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(MappingError, match="cannot be named '__metadata__'") as info:
        hp_dcp_hf.save_hf_checkpoint(module, tmp_path / "ours", weights_mapping=[])
    assert info.value.key == "__metadata__"
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())


def test_tied_embeddings_are_written_once(tiny_checkpoints, tmp_path):
    """A tied lm_head is not a checkpoint tensor: the embedding is written under the name
    ``save_pretrained`` keeps, once."""
    from tests.support.models import DEFAULT_SHARD_SIZE, model_class

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

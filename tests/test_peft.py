"""PEFT LoRA adapters in one process (:mod:`hp_dcp_hf.integrations.peft`): the key mapping is
peft's own and round-trips, the TP layout derivation, loads and saves bit-identical to
``PeftModel.from_pretrained`` / ``save_pretrained``, and bad adapters refused by name before any
byte of the model changes. The multi-rank cases (FSDP2, TP) are in ``tests/dist/test_peft_dist.py``.

Oracles are peft's own calls on real tiny transformers models (``tests.support.models``); nothing of peft
is mocked.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate, Shard

from tests.support.models import build_model, model_class

pytest.importorskip("peft")

from hp_dcp_hf.errors import (  # noqa: E402
    ArchitectureMismatchError,
    CheckpointNotFoundError,
    HPDCPHFError,
    LayoutError,
    MappingError,
    MissingKeysError,
    UnexpectedKeysError,
)
from hp_dcp_hf.integrations.peft import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_keys,
    load_peft_adapter,
    lora_placements,
    read_adapter_config,
    save_peft_adapter,
)
from hp_dcp_hf.storage import HFStorageReader  # noqa: E402
from tests.support.peft import (
    RANK,
    TARGETS,
    adapter_values,
    assert_same_adapter,
    make_adapter,
    peft_load,
    peft_reference,
)


def wrapped(family: str, base: Path, adapter: Path, *, is_trainable: bool = False):
    """The base model, wrapped by peft with the adapter's config (random LoRA values)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model_class(family).from_pretrained(base, dtype=torch.float32),
                              read_adapter_config(adapter, is_trainable=is_trainable))


def trainable(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


@pytest.fixture(scope="module", params=list(TARGETS))
def adapter(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"peft-{request.param}")
    base, path = make_adapter(request.param, root)
    reference = peft_reference(request.param, base, path, root / "reference")
    return request.param, base, path, reference, root / "reference"


# -- the key mapping --------------------------------------------------------------------------------


def test_keys_are_peft_file_keys_mapped_to_the_adapters_parameters(adapter):
    family, base, path, reference, _ = adapter
    names = adapter_keys(reference)
    assert sorted(names) == sorted(load_file(path / ADAPTER_WEIGHTS))  # exactly what save_pretrained wrote
    lora = {key for key in reference.state_dict() if ".lora_" in key}
    assert set(names.values()) == lora  # every LoRA tensor, nothing of the base
    for file_key, model_key in names.items():
        assert model_key == file_key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
    if family == "qwen3_moe":  # the experts' parameters (nested ParamWrappers)
        assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in names
        assert "base_model.model.model.layers.1.mlp.experts.lora_B.weight" in names


def test_keys_of_another_adapter_name(adapter):
    """peft's names carry no adapter name: a second adapter maps the same file keys to its own
    parameters."""
    family, base, path, reference, _ = adapter
    reference.load_adapter(path, adapter_name="other")
    try:
        names = adapter_keys(reference, "other")
        assert sorted(names) == sorted(adapter_keys(reference))
        assert all(".other." in key and ".default." not in key for key in names.values())
    finally:
        reference.delete_adapter("other")


# -- the TP layout ----------------------------------------------------------------------------------


def test_lora_placements_follow_the_base_layer():
    colwise, rowwise, replicated = lora_placements((Shard(0),)), lora_placements((Shard(1),)), lora_placements((Replicate(),))
    assert (colwise.base, colwise.lora_A, colwise.lora_B) == ("colwise", Replicate(), Shard(0))
    assert (rowwise.base, rowwise.lora_A, rowwise.lora_B) == ("rowwise", Shard(1), Replicate())
    assert (replicated.lora_A, replicated.lora_B) == (Replicate(), Replicate())
    with pytest.raises(LayoutError, match="before fully_shard"):
        lora_placements((Shard(0), Shard(0)))


# -- load and save in one process -------------------------------------------------------------------


def test_load_is_bit_identical_to_peft_and_reads_each_byte_once(adapter):
    family, base, path, reference, _ = adapter
    model = wrapped(family, base, path)
    expected = adapter_values(reference)
    assert any(not torch.equal(v, expected[k]) for k, v in adapter_values(model).items())  # random before
    reader = HFStorageReader(path / ADAPTER_WEIGHTS)
    report = load_peft_adapter(model, path, reader=reader)
    assert adapter_values(model).keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in adapter_values(model).items())
    assert sorted(report.loaded_keys) == sorted(load_file(path / ADAPTER_WEIGHTS)) and not report.missing_keys
    stats = reader.stats.total()
    file_bytes = sum(t.numel() * t.element_size() for t in load_file(path / ADAPTER_WEIGHTS).values())
    assert stats.bytes_read == stats.bytes_needed == file_bytes


def test_save_writes_what_peft_save_pretrained_writes(adapter, tmp_path):
    family, base, path, reference, reference_dir = adapter
    save_peft_adapter(reference, tmp_path / "ours")
    assert_same_adapter(tmp_path / "ours", reference_dir)
    save_peft_adapter(reference, tmp_path / "ours")  # over an older save: replaced whole
    assert_same_adapter(tmp_path / "ours", reference_dir)


def test_another_adapter_saves_into_its_subdirectory_as_peft_does(adapter, tmp_path):
    family, base, path, reference, _ = adapter
    reference.load_adapter(path, adapter_name="other")
    try:
        reference.save_pretrained(tmp_path / "peft", selected_adapters=["other"])
        save_peft_adapter(reference, tmp_path / "ours", adapter_name="other")
        assert_same_adapter(tmp_path / "ours" / "other", tmp_path / "peft" / "other")
    finally:
        reference.delete_adapter("other")


# -- bad adapters: refused by name, the model unchanged ---------------------------------------------


def _copy_adapter(path: Path, to: Path) -> Path:
    shutil.copytree(path, to)
    return to


def _refused(model, path: Path, error: type[HPDCPHFError]) -> HPDCPHFError:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as info:
        load_peft_adapter(model, path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused adapter changed the model"
    return info.value


def test_missing_adapter_config_is_named(adapter, tmp_path):
    family, base, path, _, _ = adapter
    broken = _copy_adapter(path, tmp_path / "broken")
    (broken / ADAPTER_CONFIG).unlink()
    error = _refused(wrapped(family, base, path), broken, CheckpointNotFoundError)
    assert error.file.endswith(ADAPTER_CONFIG) and "adapter_config.json" in str(error)


def test_keys_that_match_no_lora_tensor_are_named(adapter, tmp_path):
    family, base, path, _, _ = adapter
    broken = _copy_adapter(path, tmp_path / "broken")
    tensors = load_file(path / ADAPTER_WEIGHTS)
    first = sorted(tensors)[0]
    tensors[first.replace("layers.0.", "layers.7.")] = tensors.pop(first)
    save_file(tensors, broken / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    error = _refused(wrapped(family, base, path), broken, UnexpectedKeysError)
    assert error.file.endswith(ADAPTER_WEIGHTS) and error.key == first.replace("layers.0.", "layers.7.")
    assert "no LoRA tensor of the model" in error.reason


def test_lora_tensors_the_file_lacks_are_named(adapter, tmp_path):
    family, base, path, _, _ = adapter
    broken = _copy_adapter(path, tmp_path / "broken")
    tensors = load_file(path / ADAPTER_WEIGHTS)
    dropped = sorted(tensors)[-1]
    del tensors[dropped]
    save_file(tensors, broken / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    error = _refused(wrapped(family, base, path), broken, MissingKeysError)
    assert error.file.endswith(ADAPTER_WEIGHTS) and error.key == dropped


def test_an_adapter_for_another_base_is_refused(adapter, tmp_path):
    """Another base class (the config's auto_mapping), and another base size (the shapes)."""
    family, base, path, _, _ = adapter
    broken = _copy_adapter(path, tmp_path / "other-class")
    config = json.loads((broken / ADAPTER_CONFIG).read_text())
    config["auto_mapping"]["base_model_class"] = "MistralForCausalLM"
    (broken / ADAPTER_CONFIG).write_text(json.dumps(config))
    error = _refused(wrapped(family, base, path), broken, ArchitectureMismatchError)
    assert error.file.endswith(ADAPTER_CONFIG) and error.key == "auto_mapping.base_model_class"
    assert "MistralForCausalLM" in error.reason

    other_root = tmp_path / "other-size"
    other_root.mkdir()
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = get_peft_model(build_model(family, dtype=torch.float32, hidden_size=64, head_dim=16),
                               LoraConfig(r=RANK, init_lora_weights=False, **TARGETS[family]))
        other.save_pretrained(other_root)
    error = _refused(wrapped(family, base, path), other_root, MappingError)
    assert error.file.endswith(ADAPTER_WEIGHTS) and error.key is not None and "shape" in error.reason


def test_embedding_layers_peft_saves_load_and_save_with_the_adapter(adapter, tmp_path):
    """``save_embedding_layers=True`` puts the base's embeddings in the adapter file: they load when
    the file has them (and are not asked for when it has not), and save as peft saves them."""
    family, base, path, reference, _ = adapter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.save_pretrained(tmp_path / "peft", save_embedding_layers=True)
    stored = load_file(tmp_path / "peft" / ADAPTER_WEIGHTS)
    assert "base_model.model.model.embed_tokens.weight" in stored
    model = wrapped(family, base, path)
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()
    load_peft_adapter(model, tmp_path / "peft")
    assert torch.equal(model.get_input_embeddings().weight, reference.get_input_embeddings().weight)
    save_peft_adapter(reference, tmp_path / "ours", save_embedding_layers=True)
    assert_same_adapter(tmp_path / "ours", tmp_path / "peft")


def test_a_failed_save_leaves_the_older_adapter_as_it_was(adapter, tmp_path):
    """A save that fails once its files are staged (here: no data for a box) publishes nothing:
    the older adapter stays as it was, config included, and nothing staged is left."""
    from hp_dcp_hf import HFSavePlanner
    from hp_dcp_hf.integrations.peft import AdapterTensors

    family, base, path, reference, reference_dir = adapter
    out = tmp_path / "out"
    save_peft_adapter(reference, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    model = wrapped(family, base, path)  # other LoRA values, and another config text
    model.peft_config["default"].lora_alpha = 99

    class Failing(HFSavePlanner):
        def resolve_data(self, write_item):
            raise MappingError("injected: no data for this box", key=write_item.index.fqn)

    with pytest.raises(MappingError, match="injected"):
        save_peft_adapter(model, out, planner=Failing(AdapterTensors(model, adapter_keys(model)), weights_mapping=[]))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing staged left, nothing replaced
    save_peft_adapter(model, out)  # and the next save goes through, both files replaced
    assert json.loads((out / ADAPTER_CONFIG).read_text())["lora_alpha"] == 99
    ours, theirs = load_file(out / ADAPTER_WEIGHTS), load_file(reference_dir / ADAPTER_WEIGHTS)
    assert any(not torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_transformers_4_moe_adapter_is_named_as_such(tmp_path):
    """Per-expert keys (``mlp.experts.0.gate_proj.lora_A``: an adapter trained on transformers 4's
    per-expert Linears) are refused with what they are, not as any unknown key."""
    base, path = make_adapter("qwen3_moe", tmp_path)
    broken = _copy_adapter(path, tmp_path / "v4")
    tensors = load_file(path / ADAPTER_WEIGHTS)
    tensors["base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight"] = torch.zeros(RANK, 44)
    save_file(tensors, broken / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    error = _refused(wrapped("qwen3_moe", base, path), broken, UnexpectedKeysError)
    assert error.key.endswith("experts.0.gate_proj.lora_A.weight") and "transformers-4 MoE adapter" in error.reason


# -- training: peft's is_trainable ----------------------------------------------------------------


@pytest.mark.parametrize("is_trainable", [False, True], ids=["frozen", "trainable"])
def test_is_trainable_is_peft_from_pretrained_s(adapter, is_trainable):
    """``read_adapter_config(path, is_trainable=...)`` + ``get_peft_model`` trains what
    ``PeftModel.from_pretrained(..., is_trainable=...)`` trains: by default nothing (peft saves
    ``inference_mode: true``), with ``True`` every adapter tensor and nothing of the base."""
    family, base, path, _, _ = adapter
    ours, theirs = wrapped(family, base, path, is_trainable=is_trainable), peft_load(family, base, path,
                                                                                  is_trainable=is_trainable)
    assert json.loads((path / ADAPTER_CONFIG).read_text())["inference_mode"] is True
    assert ours.peft_config["default"].inference_mode is (not is_trainable)
    assert trainable(ours) == trainable(theirs)
    assert trainable(ours) == (set(adapter_keys(ours).values()) if is_trainable else set())
    load_peft_adapter(ours, path)
    assert trainable(ours) == trainable(theirs)


# -- from_pretrained(adapter=) ----------------------------------------------------------------------


def _same_as_peft(model, reference) -> None:
    """Every tensor bit for bit, the same tensors trainable, every module in the same mode."""
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert trainable(model) == trainable(reference)
    assert [(name, m.training) for name, m in model.named_modules()] == \
           [(name, m.training) for name, m in reference.named_modules()]


@pytest.mark.parametrize("is_trainable", [False, True], ids=["frozen", "trainable"])
def test_from_pretrained_with_an_adapter_is_peft_from_pretrained(adapter, is_trainable):
    """``hp_dcp_hf.from_pretrained(base, adapter=path, is_trainable=...)`` is
    ``PeftModel.from_pretrained(transformers' from_pretrained(base), path, is_trainable=...)``."""
    import hp_dcp_hf

    family, base, path, _, _ = adapter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, report = hp_dcp_hf.from_pretrained(str(base), dtype=torch.float32, adapter=str(path),
                                                  is_trainable=is_trainable)
    _same_as_peft(model, peft_load(family, base, path, is_trainable=is_trainable))
    assert sorted(report.adapter.loaded_keys) == sorted(load_file(path / ADAPTER_WEIGHTS))
    assert report.loaded_keys and not any(".lora_" in key for key in report.loaded_keys)  # the base's own names
    assert "adapter" in report.seconds


def test_is_trainable_without_an_adapter_is_refused(adapter):
    import hp_dcp_hf
    from hp_dcp_hf.errors import ArgumentError

    with pytest.raises(ArgumentError, match="adapter="):
        hp_dcp_hf.from_pretrained(str(adapter[1]), is_trainable=True)


# -- modules_to_save --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_modules(tmp_path_factory):
    """An adapter with full copies of lm_head and the embeddings (``modules_to_save``, untied)."""
    root = tmp_path_factory.mktemp("peft-modules-to-save")
    base, path = make_adapter("llama", root, name="mts", lora=dict(modules_to_save=["lm_head", "embed_tokens"]),
                              tie_word_embeddings=False)
    return base, path, peft_reference("llama", base, path, root / "reference"), root / "reference"


def test_modules_to_save_load_and_save_as_peft(saved_modules, tmp_path):
    """peft names the copies ``base_model.model.lm_head.weight`` in the file and holds them as
    ``...lm_head.modules_to_save.default.weight``: the load equals ``PeftModel.from_pretrained``
    (every tensor of the model), the save equals ``save_pretrained``'s files; with
    ``save_embedding_layers=True`` peft also writes the wrappers' inner names (its load drops
    ``...modules_to_save.weight``, and so does ours)."""
    import hp_dcp_hf

    base, path, reference, reference_dir = saved_modules
    stored = load_file(path / ADAPTER_WEIGHTS)
    names = adapter_keys(reference)
    assert names["base_model.model.lm_head.weight"] == "base_model.model.lm_head.modules_to_save.default.weight"
    assert names["base_model.model.model.embed_tokens.weight"] == \
           "base_model.model.model.embed_tokens.modules_to_save.default.weight"
    assert sorted(names) == sorted(stored)
    model = wrapped("llama", base, path)
    assert not torch.equal(model.state_dict()[names["base_model.model.lm_head.weight"]],
                           stored["base_model.model.lm_head.weight"])  # the copy starts as the base's
    load_peft_adapter(model, path)
    _same_as_peft(model, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_ours, _ = hp_dcp_hf.from_pretrained(str(base), dtype=torch.float32, adapter=str(path))
    _same_as_peft(from_ours, reference)

    save_peft_adapter(reference, tmp_path / "ours")
    assert_same_adapter(tmp_path / "ours", reference_dir)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.save_pretrained(tmp_path / "peft-all", save_embedding_layers=True)
    assert "base_model.model.lm_head.modules_to_save.weight" in load_file(tmp_path / "peft-all" / ADAPTER_WEIGHTS)
    save_peft_adapter(reference, tmp_path / "ours-all", save_embedding_layers=True)
    assert_same_adapter(tmp_path / "ours-all", tmp_path / "peft-all")
    model = wrapped("llama", base, path)
    load_peft_adapter(model, tmp_path / "peft-all")
    _same_as_peft(model, peft_load("llama", base, tmp_path / "peft-all"))

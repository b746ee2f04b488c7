"""HFMappingPlanner in one process: reports, validation before any write, deferred groups."""

from __future__ import annotations

import gc
import json
import logging
import time

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, add_weight_mapping, load_hf_checkpoint
from hp_dcp_hf.errors import (
    CheckpointNotFoundError,
    MappingError,
    MissingKeysError,
    PlanningError,
    UnsafeCheckpointError,
)
from tests.support.models import model_class, tiny_config


def _meta_model(model_type: str, dtype=torch.float32, **overrides):
    with torch.device("meta"):
        model = model_class(model_type)(tiny_config(model_type, **overrides)).to(dtype)
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_tied_aliases_count_as_loaded_and_lm_head_is_read_once(llama_checkpoint):
    model = _meta_model("llama")
    reader = HFStorageReader(str(llama_checkpoint.path), coalesce_gap=0)
    planner = HFMappingPlanner(model)
    began = time.perf_counter()
    report = load_hf_checkpoint(model, str(llama_checkpoint.path), reader=reader, planner=planner)
    wall = time.perf_counter() - began
    assert "lm_head.weight" in report.loaded_keys and "model.embed_tokens.weight" in report.loaded_keys
    assert "lm_head.weight" not in planner.filled
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = llama_checkpoint.reference()
    assert all(torch.equal(v, reference[k].float()) for k, v in model.state_dict().items())
    assert reader.stats.total().bytes_read == planner.stats.bytes_needed
    # each phase timed, in load order; the sequential ones add up to at most the load, and the first
    # byte landed within the read (values are wall times: only presence and order are checked)
    seconds = report.seconds
    assert list(seconds) == ["metadata", "plan", "first_byte", "read", "convert", "finish"]
    assert all(v >= 0 for v in seconds.values())
    assert seconds["metadata"] + seconds["plan"] + seconds["read"] + seconds["finish"] <= wall
    assert seconds["first_byte"] <= seconds["read"]



def test_a_load_runs_with_collection_paused(llama_checkpoint):
    """One pause over the whole load, not one per phase: each phase's end let the collector run with
    the load's structures alive, promoting them, until a process holding a model paid a full
    collection inside a load (0.4-0.6 s at 4 ranks on the MoE benchmark, one load in eight)."""
    model = _meta_model("llama")
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(200)
    try:
        [{} for _ in range(2000)]  # objects outside a load: collections
        assert len(collections) >= 5
        collections.clear()
        load_hf_checkpoint(model, str(llama_checkpoint.path))
        # at most one, set off once the pause ends (the load builds thousands of objects)
        assert len(collections) <= 1 and gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    reference = llama_checkpoint.reference()
    assert all(torch.equal(v, reference[k].float()) for k, v in model.state_dict().items())

def test_missing_keys_strict_raises_before_any_write(llama_checkpoint, tmp_path):
    model = _meta_model("llama", num_hidden_layers=3)
    before = _snapshot(model)
    with pytest.raises(MissingKeysError, match=r"model\.layers\.2\.mlp\.down_proj\.weight"):
        load_hf_checkpoint(model, str(llama_checkpoint.path))
    assert _unchanged(model, before)


def test_missing_keys_non_strict_are_reported(llama_checkpoint):
    model = _meta_model("llama", num_hidden_layers=3)
    report = load_hf_checkpoint(model, str(llama_checkpoint.path), strict=False)
    assert "model.layers.2.self_attn.q_proj.weight" in report.missing_keys
    assert "model.layers.1.self_attn.q_proj.weight" in report.loaded_keys
    assert torch.equal(model.model.layers[2].self_attn.q_proj.weight, torch.full_like(
        model.model.layers[2].self_attn.q_proj.weight, 7.0))


def test_unexpected_checkpoint_keys_are_reported(llama_checkpoint):
    model = _meta_model("llama", num_hidden_layers=1)
    report = load_hf_checkpoint(model, str(llama_checkpoint.path))
    assert "model.layers.1.mlp.up_proj.weight" in report.unexpected_keys
    assert all(k.startswith("model.layers.1.") for k in report.unexpected_keys)


def test_shape_mismatch_lists_every_offending_key_and_writes_nothing(llama_checkpoint):
    model = _meta_model("llama", intermediate_size=42)
    before = _snapshot(model)
    with pytest.raises(MappingError) as info:
        load_hf_checkpoint(model, str(llama_checkpoint.path))
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight: model expects (42, 44), checkpoint makes (43, 44)" in message
    assert "model.layers.1.mlp.down_proj.weight" in message
    assert info.value.key == "model.layers.0.mlp.down_proj.weight"  # the first, and the file holding its source
    assert info.value.file == json.loads((llama_checkpoint.path / "model.safetensors.index.json").read_text())[
        "weight_map"]["model.layers.0.mlp.down_proj.weight"]
    assert _unchanged(model, before)


def test_external_targets_and_claimed_sources(llama_checkpoint):
    model = _meta_model("llama")
    report = load_hf_checkpoint(
        model, str(llama_checkpoint.path),
        external_target_fqns={"model.norm.weight"}, claimed_source_keys={"model.norm.weight"},
    )
    assert "model.norm.weight" not in report.loaded_keys + report.missing_keys + report.unexpected_keys
    assert torch.equal(model.model.norm.weight, torch.full_like(model.model.norm.weight, 7.0))
    with pytest.raises(PlanningError, match="external targets absent"):
        load_hf_checkpoint(model, str(llama_checkpoint.path), external_target_fqns={"nope"})


def test_used_conversions_are_recorded_on_the_model(mixtral_checkpoint):
    model = _meta_model("mixtral")
    load_hf_checkpoint(model, str(mixtral_checkpoint.path))
    names = [type(t).__name__ for t in model._weight_conversions]
    assert names.count("WeightConverter") == 2 and "WeightRenaming" in names


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6, bias=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def test_plain_module_with_explicit_mapping_and_uncastable_dtype(tmp_path):
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"w.t": weight, "counter": torch.ones(3)}, tmp_path / "model.safetensors")
    model = _Tiny()
    before = _snapshot(model)
    mapping = [WeightConverter("w.t", "proj.weight", [_Transpose()]), WeightRenaming("counter", "steps")]
    with pytest.raises(MappingError, match=r"steps: cannot cast counter \(torch.float32\) to torch.int64") as info:
        load_hf_checkpoint(model, str(tmp_path), weights_mapping=mapping)
    assert (info.value.file, info.value.key) == ("model.safetensors", "steps")
    assert _unchanged(model, before)
    report = load_hf_checkpoint(model, str(tmp_path), weights_mapping=mapping[:1], strict=False)
    assert torch.equal(model.proj.weight, weight.t())
    assert report.missing_keys == ("steps",) and report.unexpected_keys == ("counter",)


class _Transpose(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (value,) = input_dict.values()
        return {target_patterns[0]: (value[0] if isinstance(value, list) else value).t()}


class _Negate(ConversionOps):
    """Math on values: cannot be traced, so it must go through a deferred group."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (value,) = input_dict.values()
        return {target_patterns[0]: -(value[0] if isinstance(value, list) else value)}


def test_untraceable_stage_is_deferred_reported_and_correct(mixtral_checkpoint, caplog):
    model = _meta_model("mixtral")
    add_weight_mapping(model, [WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj", [_Negate()])])
    reader = HFStorageReader(str(mixtral_checkpoint.path))
    planner = HFMappingPlanner(model)
    with caplog.at_level(logging.WARNING, logger="hp_dcp_hf.load.planner"):
        load_hf_checkpoint(model, str(mixtral_checkpoint.path), reader=reader, planner=planner)
    assert planner.stats.deferred_targets == 2 and planner.stats.deferred_bytes > 0
    assert "cannot be traced" in caplog.text
    reference = mixtral_checkpoint.reference()
    for name, value in model.state_dict().items():
        expected = -reference[name] if name.endswith("experts.down_proj") else reference[name]
        assert torch.equal(value, expected.float()), name


def test_metadata_errors_come_back_typed_through_dcp(tmp_path):
    """torch's dcp.load reduces read_metadata errors to AssertionError; the one-call form does not."""
    model = _Tiny()
    with pytest.raises(CheckpointNotFoundError):
        load_hf_checkpoint(model, str(tmp_path / "nowhere"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle we would ever open")
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        load_hf_checkpoint(model, str(tmp_path))

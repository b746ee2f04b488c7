"""Stage composition: transformers' mappings followed by recorded rewrites, traced exactly."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    Transpose,
    WeightConverter,
    WeightRenaming,
)

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.compose import Composition, Opaque, TensorSpec
from hp_dcp_hf.mapping.structure import Bound
from tests.support.symbolic_check import materialize


def _checkpoint(model_cls, config, tmp_path):
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(tmp_path)
    return model, load_file(tmp_path / "model.safetensors")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = MixtralConfig(hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=3, vocab_size=37)
    model, ckpt = _checkpoint(MixtralForCausalLM, config, tmp_path_factory.mktemp("mixtral"))
    return model, ckpt


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = LlamaConfig(hidden_size=24, intermediate_size=20, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=29)
    return _checkpoint(LlamaForCausalLM, config, tmp_path_factory.mktemp("llama"))


def _compose(model, ckpt, stages, final_names, **kwargs):
    return Composition(
        stages, {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in ckpt.items()}, final_names,
        model=model, config=model.config, base_model_prefix=model.base_model_prefix, **kwargs,
    )


def _check_traced_equals_real(composition, ckpt):
    real = composition.evaluate(list(composition.traced), ckpt.__getitem__)
    for name, traced in composition.traced.items():
        assert isinstance(traced, Bound), name
        assert torch.equal(materialize(traced, ckpt), real[name].double()), name
    return real


def test_checkpoint_mapping_alone_matches_transformers(mixtral):
    model, ckpt = mixtral
    composition = _compose(model, ckpt, [get_model_conversion_mapping(model)], set(model.state_dict()))
    real = _check_traced_equals_real(composition, ckpt)
    reference = model.state_dict()
    assert set(real) == set(reference)
    assert all(torch.equal(real[k], reference[k]) for k in real)
    assert composition.dropped == []
    assert len(composition.used_transforms) == 3


def test_rewrite_stages_compose_with_the_checkpoint_mapping(mixtral):
    model, ckpt = mixtral
    grouped_gemm = [
        WeightConverter("mlp.experts.gate_up_proj", "mlp.experts.w13", [Transpose(1, 2)]),
        WeightConverter("mlp.experts.down_proj", "mlp.experts.w2", [Transpose(1, 2)]),
    ]
    fused_qkv = [WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                                 "self_attn.qkv_proj.weight", [Concatenate(dim=0)])]
    renamed = [WeightRenaming(r"^model\.", "core.")]
    final = {
        n.replace("mlp.experts.gate_up_proj", "mlp.experts.w13").replace("mlp.experts.down_proj", "mlp.experts.w2")
        for n in model.state_dict() if not any(p in n for p in ("q_proj", "k_proj", "v_proj"))
    }
    final |= {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)}
    final = {n.replace("model.", "core.", 1) if n.startswith("model.") else n for n in final}
    composition = _compose(model, ckpt, [get_model_conversion_mapping(model), grouped_gemm, fused_qkv, renamed], final)
    assert set(composition.traced) == final
    real = _check_traced_equals_real(composition, ckpt)
    reference = model.state_dict()
    layer = "model.layers.1"
    assert torch.equal(real["core.layers.1.mlp.experts.w13"], reference[f"{layer}.mlp.experts.gate_up_proj"].transpose(1, 2))
    qkv = torch.cat([reference[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(real["core.layers.1.self_attn.qkv_proj.weight"], qkv)


def test_chunk_then_fuse_back(llama):
    """A fused checkpoint tensor chunked by the checkpoint mapping, then fused again by a rewrite."""
    model, ckpt = llama
    projections = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    fused = torch.randn(36, 24)
    ckpt = {k: v for k, v in ckpt.items() if not any(p in k for p in projections)}
    ckpt["model.layers.0.self_attn.qkv.weight"] = fused
    unfuse = [WeightConverter("self_attn.qkv.weight", projections, [Chunk(dim=0)])]
    refuse = [WeightConverter(projections, "self_attn.qkv_proj.weight", [Concatenate(dim=0)])]
    final = {n for n in model.state_dict() if not any(p in n for p in projections)}
    composition = _compose(model, ckpt, [unfuse], final | {"model.layers.0." + p for p in projections})
    real = _check_traced_equals_real(composition, ckpt)
    assert torch.equal(real["model.layers.0.self_attn.k_proj.weight"], fused[12:24])
    composition = _compose(model, ckpt, [unfuse, refuse], final | {"model.layers.0.self_attn.qkv_proj.weight"})
    assert composition.traced["model.layers.0.self_attn.qkv_proj.weight"].source_keys() == {"model.layers.0.self_attn.qkv.weight"}
    assert torch.equal(_check_traced_equals_real(composition, ckpt)["model.layers.0.self_attn.qkv_proj.weight"], fused)


class _Scale(ConversionOps):
    """An op that does math on values: it cannot be traced."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (value,) = input_dict.values()
        value = value[0] if isinstance(value, list) else value
        return {target_patterns[0]: value * 2}


def test_untraceable_ops_defer_with_exact_sources(mixtral):
    model, ckpt = mixtral
    stage = [WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj", [_Scale()])]
    composition = _compose(model, ckpt, [get_model_conversion_mapping(model), stage], set(model.state_dict()))
    deferred = composition.traced["model.layers.0.mlp.experts.down_proj"]
    assert isinstance(deferred, Opaque)
    assert deferred.sources == {f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(3)}
    value = composition.evaluate(["model.layers.0.mlp.experts.down_proj"], ckpt.__getitem__)
    assert torch.equal(value["model.layers.0.mlp.experts.down_proj"],
                       model.state_dict()["model.layers.0.mlp.experts.down_proj"] * 2)


def test_shapes_that_do_not_compose_raise_mapping_error(mixtral):
    model, ckpt = mixtral
    ckpt = dict(ckpt)
    ckpt["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(5, 16)
    with pytest.raises(MappingError, match="gate_up_proj"):
        _compose(model, ckpt, [get_model_conversion_mapping(model)], set(model.state_dict()))


def test_unused_checkpoint_keys_are_dropped(mixtral):
    model, ckpt = mixtral
    ckpt = dict(ckpt, **{"extra.weight": torch.zeros(2)})
    composition = _compose(model, ckpt, [get_model_conversion_mapping(model)], set(model.state_dict()))
    assert composition.dropped == ["extra.weight"]


def test_shape_asking_ops_see_shapes_recorded_by_later_rewrites(mixtral):
    model, ckpt = mixtral
    ckpt = {k.replace("block_sparse_moe", "mlp"): v for k, v in ckpt.items()}
    down = "model.layers.0.mlp.experts.0.w2.weight"
    check_dims = [WeightConverter("experts.0.w2.weight", "experts.0.w2.weight", [Transpose(0, 1, check_dims=True)])]
    rewrite = [WeightRenaming("experts.0.w2.weight", "experts.0.down.weight")]
    final = {n for n in ckpt if n != down} | {"model.layers.0.mlp.experts.0.down.weight"}
    with pytest.raises(MappingError, match="source_shapes"):
        _compose(model, ckpt, [check_dims, [WeightConverter("experts.0.w2.weight", "experts.0.down.weight",
                                                          [Concatenate(dim=0)])]], final)
    wanted = tuple(reversed(ckpt[down].shape))  # the rewrite says: before me it was transposed
    composition = _compose(model, ckpt, [check_dims, rewrite], final, stage_shapes=[{}, {down: wanted}])
    assert tuple(composition.traced["model.layers.0.mlp.experts.0.down.weight"].shape) == wanted
    with pytest.raises(MappingError, match="does not have"):  # renamed only, and the model lacks it
        _compose(model, ckpt, [check_dims, rewrite], final)

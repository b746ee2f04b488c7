"""torchtitan's models in one process: every family loads bit-identical to torchtitan's own
``from_hf`` of the whole checkpoint, saves back to the files ``save_pretrained`` wrote, and where
torchtitan's adapter loads nothing (GPT-OSS experts from an unquantized checkpoint), ours loads
the checkpoint's values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.support import titan
from tests.support.checkpoints import assert_same_checkpoint

FAMILIES = titan.FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    family = request.param
    return family, titan.make_checkpoint(family, tmp_path_factory.mktemp(family) / "hf")


def _hf_state(path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def test_load_equals_torchtitan_from_hf_and_saves_back(checkpoint, tmp_path):
    from hp_dcp_hf.integrations import torchtitan as tt
    from hp_dcp_hf.load.written import own_state_dict

    family, path = checkpoint
    expected = titan.reference(family, path)
    model = titan.build(family, device="cpu")
    before = {k: v.clone() for k, v in own_state_dict(model).items()}
    report = tt.load_hf_checkpoint(model, str(path), unexpected="raise", check_written=True)
    ours = own_state_dict(model)
    assert sorted(ours) == sorted(expected)
    skipped = sorted(set(ours) - set(tt.model_tensors(model)))
    for key, value in ours.items():
        if key in skipped:  # no HF checkpoint holds it: left as it was, as torchtitan leaves it
            assert key.endswith("expert_bias_E") and torch.equal(value, before[key]), key
        elif family == "gpt_oss" and ".inner_experts." in key:
            continue  # torchtitan's adapter loads none of these (below)
        else:
            assert torch.equal(value, expected[key]), key
    assert set(report.loaded_keys) == set(tt.model_tensors(model))
    tt.save_hf_checkpoint(model, tmp_path / "saved", max_shard_size="200KB")
    assert_same_checkpoint(tmp_path / "saved", path)


def test_gpt_oss_experts_load_where_torchtitans_adapter_does_not(tmp_path):
    """torchtitan 0.3's GPT-OSS adapter maps only the MXFP4 names (``*_blocks``) to parameter names
    the model does not have: from an unquantized checkpoint its experts stay at init."""
    from hp_dcp_hf.integrations import torchtitan as tt

    path = titan.make_checkpoint("gpt_oss", tmp_path / "hf")
    hf = _hf_state(path)
    theirs = titan.reference("gpt_oss", path)
    model = titan.build("gpt_oss", device="cpu")
    tt.load_hf_checkpoint(model, str(path))
    experts = "moe.routed_experts.inner_experts"
    for layer in range(titan.LAYERS):
        ours = {name: getattr(model.layers[str(layer)].moe.routed_experts.inner_experts, name)
                for name in ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")}
        source = f"model.layers.{layer}.mlp.experts"
        assert torch.equal(ours["mlp1_weight_EGD"], hf[f"{source}.gate_up_proj"].transpose(1, 2))
        assert torch.equal(ours["mlp2_weight_EDF"], hf[f"{source}.down_proj"].transpose(1, 2))
        assert torch.equal(ours["mlp1_bias_EG"], hf[f"{source}.gate_up_proj_bias"])
        assert torch.equal(ours["mlp2_bias_ED"], hf[f"{source}.down_proj_bias"])
        for name in ours:  # torchtitan's: the sentinel its reference filled in, untouched
            assert bool((theirs[f"layers.{layer}.{experts}.{name}"] == -7.0).all())


def test_fused_qkv_is_a_recorded_rewrite_of_the_stock_layout(tmp_path):
    """``wqkv`` is made of q/k/v by one recorded stage, so the load writes the parameter itself
    (the state dict's ``wq``/``wk``/``wv`` are hook-made copies) and ``state_dict()`` after the
    load hands out the checkpoint's values, permuted for complex RoPE as torchtitan's adapter does."""
    from hp_dcp_hf.integrations import torchtitan as tt
    from hp_dcp_hf.mapping.stages import recorded_stages

    path = titan.make_checkpoint("llama3", tmp_path / "hf")
    model = titan.build("llama3", device="cpu")
    tt.load_hf_checkpoint(model, str(path))
    tt.record_fused_qkv(model)  # idempotent: one stage however often it is called
    assert len(recorded_stages(model)) == 1
    fresh = titan.build("llama3", device="cpu")
    fresh.load_state_dict(titan.adapter("llama3", fresh).from_hf(_hf_state(path)), strict=False)
    assert torch.equal(model.layers["0"].attention.qkv_linear.wqkv.weight,
                       fresh.layers["0"].attention.qkv_linear.wqkv.weight)
    assert torch.equal(model.state_dict()["layers.1.attention.qkv_linear.wk.weight"],
                       fresh.state_dict()["layers.1.attention.qkv_linear.wk.weight"])


def test_errors_name_what_is_wrong(tmp_path):
    from torch import nn

    from hp_dcp_hf.errors import ArgumentError
    from hp_dcp_hf.integrations import torchtitan as tt

    with pytest.raises(ArgumentError, match="Linear is not one of torchtitan's models"):
        tt.hf_weights_mapping(nn.Linear(2, 2))
    model = titan.build("qwen3", device="cpu")
    with pytest.raises(ArgumentError, match="hf_config="):
        tt.save_hf_checkpoint(model, tmp_path / "out")
    with pytest.raises(ArgumentError, match="supplies weights_mapping"):
        tt.load_hf_checkpoint(model, str(tmp_path), weights_mapping=[])


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_quantized_checkpoints_load_as_their_values(family, tmp_path):
    """DeepSeek-V3's FP8 (block-scaled ``weight_scale_inv``) and GPT-OSS's MXFP4 experts dequantize on
    load as for transformers models: the same values as the dequantized twin, which torchtitan's own
    ``from_hf`` loads (DeepSeek-V3; its GPT-OSS adapter loads no experts, see above)."""
    from hp_dcp_hf.integrations import torchtitan as tt
    from hp_dcp_hf.load.written import own_state_dict

    quantized, twin = titan.quantize_checkpoint(family, titan.make_checkpoint(family, tmp_path / "hf"), tmp_path)
    ours, values = titan.build(family, device="cpu"), titan.build(family, device="cpu")
    tt.load_hf_checkpoint(ours, str(quantized), unexpected="raise", check_written=True)
    tt.load_hf_checkpoint(values, str(twin))
    expected = titan.reference(family, twin) if family == "deepseek_v3" else own_state_dict(values)
    for key, value in own_state_dict(ours).items():
        assert torch.equal(value, own_state_dict(values)[key]), key
        if key in tt.model_tensors(ours):
            assert torch.equal(value, expected[key]), key


def test_a_checkpoint_without_config_json_loads_and_its_save_asks_for_hf_config(tmp_path):
    """The config is only what the save writes back: loading does not need it, and the reader's own
    options are the ones it is read with."""
    from hp_dcp_hf import HFStorageReader
    from hp_dcp_hf.errors import ArgumentError
    from hp_dcp_hf.integrations import torchtitan as tt

    path = titan.make_checkpoint("llama3", tmp_path / "hf")
    (path / "config.json").unlink()
    model = titan.build("llama3", device="cpu")
    reader = HFStorageReader(str(path), num_threads=2)
    report = tt.load_hf_checkpoint(model, str(path), reader=reader, unexpected="raise", check_written=True)
    assert set(report.loaded_keys) == set(tt.model_tensors(model)) and reader.stats.total().bytes_read > 0
    with pytest.raises(ArgumentError, match="hf_config="):
        tt.save_hf_checkpoint(model, tmp_path / "out")
    tt.save_hf_checkpoint(model, tmp_path / "out", hf_config=titan.hf_config("llama3"), max_shard_size="200KB")
    assert sorted(load_file(tmp_path / "out" / "model-00001-of-00002.safetensors")) == sorted(
        load_file(path / "model-00001-of-00002.safetensors"))


"""The performance rewrites: same logits, the right recorded stage, and exact loads through it.

Three independent checks per rewrite: (1) the rewritten model computes what the original does
(its values are carried over and its forward is right); (2) the stage it records is the one
expected; (3) loading the original checkpoint through that stage into a rewritten meta model
gives bit for bit the rewritten ``from_pretrained`` model, reading exactly the bytes needed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.core_model_loading import Concatenate, Transpose, WeightConverter

import hp_dcp_hf.transforms.experts as experts_mod
from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import recorded_stages
from hp_dcp_hf.transforms import FusedSlice, GroupedGemmExperts, fuse_gate_up, fuse_qkv, grouped_gemm_experts
from hp_dcp_hf.transforms._fusion import scoped_stage
from tests.models import build_model, model_class, tiny_config

QKV, GATE_UP, EXPERTS = fuse_qkv, fuse_gate_up, grouped_gemm_experts
NAMES = {QKV: "qkv", GATE_UP: "gate_up", EXPERTS: "experts"}

# Tiny models the rewrites apply to: llama with biases everywhere, mixtral (no dense MLP), qwen3_moe
# whose layer 0 is dense (so all three rewrites apply to one model), sarvam_moe (Glm4Moe: dense
# layer 0, shared experts next to the stacked ones; its checkpoint ``Split`` asks the model for the
# shapes of the q/k/v a later rewrite fuses), qwen3_vl_moe (its checkpoint ``Transpose(check_dims)``
# asks for the shapes of the experts a later rewrite transposes).
MODELS = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0])),
    "sarvam_moe": ("sarvam_moe", {}),
    "qwen3_vl_moe": ("qwen3_vl_moe", {}),
}
CASES = [
    ("llama", (QKV,)), ("llama", (GATE_UP,)), ("llama", (QKV, GATE_UP)),
    ("mixtral", (QKV,)), ("mixtral", (EXPERTS,)), ("mixtral", (EXPERTS, QKV)),
    ("qwen3_moe", (GATE_UP,)), ("qwen3_moe", (EXPERTS,)), ("qwen3_moe", (QKV, EXPERTS, GATE_UP)),
]


def _case_id(case) -> str:
    return f"{case[0]}-{'+'.join(NAMES[f] for f in case[1])}"


def _build(name: str, dtype=torch.float32) -> nn.Module:
    model_type, overrides = MODELS[name]
    model = build_model(model_type, dtype=dtype, **overrides)
    if model_type != "llama":
        # transformers' default "grouped_mm" experts fail on CPU for odd sizes (strides not 16-byte
        # multiples); eager is the reference math anyway.
        model.set_experts_implementation("eager")
    return model


# --- (1) same logits ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", [*CASES, ("sarvam_moe", (QKV, GATE_UP, EXPERTS))], ids=_case_id)
def test_rewrite_keeps_logits(case):
    name, rewrites = case
    reference = _build(name)
    model = _build(name)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        for rewrite in rewrites:
            assert rewrite(model) is model
        calls = []
        fused = [m for n, m in model.named_modules() if n.endswith(("qkv_proj", "gate_up_proj"))]
        for linear in fused:  # one matmul per fused Linear and forward
            linear.register_forward_hook(lambda *_: calls.append(1))
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(calls) == len(fused)
    assert fused or rewrites == (EXPERTS,)
    assert not any(isinstance(m, FusedSlice) and m._fed is not None for m in model.modules())
    if QKV in rewrites:
        assert not any(hasattr(m, "q_proj") and isinstance(m.q_proj, nn.Linear) for m in model.modules())
    if EXPERTS in rewrites:
        assert sum(isinstance(m, GroupedGemmExperts) for m in model.modules()) == (2 if name == "mixtral" else 1)
        assert not any(isinstance(m, nn.Parameter) and m.dim() == 3 and n.endswith("gate_up_proj")
                       for n, m in model.named_parameters())


def test_fused_slices_answer_only_inside_their_forward():
    model = _build("llama")
    fuse_qkv(model)
    attention = model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match=r"rows 40:60 of the fused 'qkv_proj'"):
        attention.k_proj(torch.zeros(1, 3, 44))


# --- (2) the recorded stage ----------------------------------------------------------------------


def _describe(stage):
    out = []
    for t in stage:
        ops = [(type(op).__name__, op.__dict__) for op in getattr(t, "operations", [])]
        out.append((type(t).__name__, t.source_patterns, t.target_patterns, ops))
    return out


def test_recorded_stages():
    model = _build("qwen3_moe")
    expected = []
    fuse_qkv(model)
    expected.append([WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight"], "self_attn.qkv_proj.weight", [Concatenate(dim=0)])])
    grouped_gemm_experts(model)
    expected.append([WeightConverter("experts.gate_up_proj", "experts.w13", [Transpose(1, 2)]),
                     WeightConverter("experts.down_proj", "experts.w2", [Transpose(1, 2)])])
    fuse_gate_up(model)
    expected.append([WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight",
                                     [Concatenate(dim=0)])])
    assert [_describe(s) for s in recorded_stages(model)] == [_describe(s) for s in expected]


def test_recorded_stage_covers_biases():
    model = _build("llama")
    fuse_qkv(model)
    fuse_gate_up(model)
    (qkv_w, qkv_b), (gate_up_w, gate_up_b) = recorded_stages(model)
    assert qkv_b.source_patterns == ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    assert qkv_b.target_patterns == ["self_attn.qkv_proj.bias"]
    assert gate_up_b.source_patterns == ["mlp.gate_proj.bias", "mlp.up_proj.bias"]
    assert gate_up_b.target_patterns == ["mlp.gate_up_proj.bias"]
    bias = model.model.layers[1].self_attn.qkv_proj.bias
    reference = _build("llama").model.layers[1].self_attn
    assert torch.equal(bias, torch.cat([reference.q_proj.bias, reference.k_proj.bias, reference.v_proj.bias]))


# --- errors: nothing changes when a rewrite refuses -------------------------------------------------


def _unchanged(model, action, match):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stages = len(recorded_stages(model))
    with pytest.raises(MappingError, match=match):
        action(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert len(recorded_stages(model)) == stages


def test_nothing_to_rewrite_raises():
    _unchanged(_build("mixtral"), fuse_gate_up, r"fuse_gate_up: MixtralForCausalLM has no module")
    _unchanged(_build("llama"), grouped_gemm_experts, r"grouped_gemm_experts: LlamaForCausalLM has no stacked")
    twice = fuse_qkv(_build("llama"))
    _unchanged(twice, fuse_qkv, r"already rewritten")
    twice = grouped_gemm_experts(_build("mixtral"))
    _unchanged(twice, grouped_gemm_experts, r"already rewritten")


def test_scope_grows_where_a_name_alone_would_match_other_tensors():
    # Glm4Moe: once the shared experts' MLP is fused, `experts.gate_up_proj` also matches
    # `shared_experts.gate_up_proj.weight`; the experts stage must scope itself `mlp.experts`.
    model = _build("sarvam_moe")
    fuse_gate_up(model)
    grouped_gemm_experts(model)
    gate_up, experts = recorded_stages(model)
    assert [t.source_patterns for t in gate_up] == [["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                                                    ["shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"]]
    assert [(t.source_patterns, t.target_patterns) for t in experts] == [
        (["mlp.experts.gate_up_proj"], ["mlp.experts.w13"]), (["mlp.experts.down_proj"], ["mlp.experts.w2"])]
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in model.state_dict()


def test_modules_that_do_not_fit_are_left_alone_and_unmatched():
    # Layer 1's k projection reads another input size: only layer 0 fuses, and `self_attn.q_proj`
    # would also match layer 1, so the pattern scope grows to `layers.0.self_attn` (never `0.self_attn`,
    # which would match layer 10 too).
    model = _build("llama")
    model.model.layers[1].self_attn.k_proj = nn.Linear(30, 20, bias=True)
    fuse_qkv(model)
    ((weight, bias),) = recorded_stages(model)
    assert weight.target_patterns == ["layers.0.self_attn.qkv_proj.weight"]
    assert bias.target_patterns == ["layers.0.self_attn.qkv_proj.bias"]
    assert isinstance(model.model.layers[1].self_attn.q_proj, nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, FusedSlice)


def test_no_scope_that_renames_exactly_the_rewritten_tensors_raises():
    model = _build("llama")
    owners = {"model.layers.0.mlp": model.model.layers[0].mlp}
    converters = lambda scope, _: [WeightConverter(f"{scope}.gate_proj.weight", f"{scope}.g.weight",  # noqa: E731
                                                   [Transpose(0, 1)])]
    with pytest.raises(MappingError, match=r"(?s)no pattern scope.*layers\.0\.mlp\.gate_proj\.weight -> "):
        scoped_stage(model, owners, converters, renamed={})  # claims nothing is renamed


def test_mixed_dtypes_raise():
    model = _build("llama")
    model.model.layers[0].mlp.up_proj.to(torch.bfloat16)
    _unchanged(model, fuse_gate_up, r"differ in device or dtype")


# --- the grouped GEMM ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_kernel_path_matches_eager_and_loop(monkeypatch, dtype):
    # Sizes whose strides are 16-byte multiples, so F.grouped_mm takes them; with sentinel ids
    # (== num_experts, as expert parallelism masks foreign experts) that pick no expert.
    model = build_model("qwen3_moe", dtype=dtype, hidden_size=48, moe_intermediate_size=24)
    model.set_experts_implementation("eager")
    eager = model.model.layers[0].mlp.experts
    grouped = copy.deepcopy(model)
    grouped_gemm_experts(grouped)
    experts = grouped.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 48, generator=gen).to(dtype)
    index = torch.randint(0, 5, (11, 2), generator=gen)  # 4 experts + the sentinel 4
    weights = torch.rand(11, 2, generator=gen)
    calls = []
    kernel = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        expected = eager(hidden, index, weights)
        got = experts(hidden, index, weights)
        assert len(calls) == 2
        monkeypatch.setattr(experts_mod, "_kernel_fits", lambda x, w: False)
        looped = experts(hidden, index, weights)
    assert len(calls) == 2
    torch.testing.assert_close(got, expected, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))
    assert torch.equal(looped, got)


def test_odd_sizes_take_the_loop(monkeypatch):
    model = _build("mixtral")
    grouped_gemm_experts(model)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: pytest.fail("kernel on odd sizes"))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


# --- (3) loads through the recorded stages -----------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints):
    return {name: tiny_checkpoints(model_type, torch.bfloat16, **overrides)
            for name, (model_type, overrides) in MODELS.items()}


@pytest.fixture(scope="module")
def pretrained(checkpoints):
    """``from_pretrained`` of each checkpoint into float32 (bf16 -> fp32 is exact)."""
    return {name: model_class(ckpt.model_type).from_pretrained(ckpt.path, dtype=torch.float32)
            for name, ckpt in checkpoints.items()}


LOAD_CASES = [*CASES, ("sarvam_moe", (QKV, GATE_UP, EXPERTS)), ("qwen3_vl_moe", (EXPERTS,))]


@pytest.mark.parametrize("case", LOAD_CASES, ids=_case_id)
def test_load_into_rewritten_meta_model_is_exact(case, checkpoints, pretrained):
    name, rewrites = case
    ckpt = checkpoints[name]
    reference = copy.deepcopy(pretrained[name])
    for rewrite in rewrites:
        rewrite(reference)
    with torch.device("meta"):
        model = model_class(ckpt.model_type)(tiny_config(ckpt.model_type, **ckpt.overrides)).float()
    for rewrite in rewrites:
        rewrite(model)
    model.to_empty(device="cpu")
    model.tie_weights()
    reader = HFStorageReader(str(ckpt.path), coalesce_gap=0)
    planner = HFMappingPlanner(model)
    report = load_hf_checkpoint(model, str(ckpt.path), reader=reader, planner=planner)
    state, expected = model.state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    assert not [k for k in state if not torch.equal(state[k], expected[k])]
    assert not report.missing_keys and not report.unexpected_keys
    assert planner.stats.deferred_targets == 0
    own = sum(state[k].numel() * reader.entries[next(iter(planner.composition.source_keys(k)))].itemsize
              for k in planner.filled)
    assert reader.stats.total().bytes_read == planner.stats.bytes_needed == own

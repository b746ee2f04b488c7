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
from transformers import DistributedConfig
from transformers.core_model_loading import Transpose, WeightConverter
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

import hp_dcp_hf.transforms.experts as experts_mod
from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import recorded_stages
from hp_dcp_hf.transforms import FusedSlice, GroupedGemmExperts, fuse_gate_up, fuse_qkv, grouped_gemm_experts
from hp_dcp_hf.transforms._fusion import scoped_stage
from hp_dcp_hf.transforms.tp import (
    AFTER_FUSED_STYLE,
    FUSED_STYLE,
    ConcatenateByRank,
    fused_without_tp_layout,
    rank_major,
)
from tests.support.models import build_model, model_class, tiny_config

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
    layouts = {f"model.layers.{i}.self_attn.qkv_proj.weight": layer.self_attn.qkv_proj._hp_layout
               for i, layer in enumerate(model.model.layers)}
    expected.append([WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight"], "self_attn.qkv_proj.weight",
                                     [ConcatenateByRank(dim=0, layouts=layouts)])])
    grouped_gemm_experts(model)
    expected.append([WeightConverter("experts.gate_up_proj", "experts.w13", [Transpose(1, 2)]),
                     WeightConverter("experts.down_proj", "experts.w2", [Transpose(1, 2)])])
    fuse_gate_up(model)
    dense = {"model.layers.0.mlp.gate_up_proj.weight": model.model.layers[0].mlp.gate_up_proj._hp_layout}
    expected.append([WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight",
                                     [ConcatenateByRank(dim=0, layouts=dense)])])
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


# --- tensor-parallel layouts: the TP plan follows the fusion ------------------------------------------


def test_tp_plans_name_the_fused_linears():
    model = _build("llama")
    fuse_qkv(model)
    fuse_gate_up(model)
    assert model._tp_plan == {
        "lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.self_attn.qkv_proj": FUSED_STYLE, "model.layers.*.self_attn.o_proj": AFTER_FUSED_STYLE,
        "model.layers.*.mlp.gate_up_proj": FUSED_STYLE, "model.layers.*.mlp.down_proj": AFTER_FUSED_STYLE,
    }
    assert model.model._tp_plan == {  # the base model's own plan (keys relative to it) follows too
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": FUSED_STYLE, "layers.*.self_attn.o_proj": AFTER_FUSED_STYLE,
        "layers.*.mlp.gate_up_proj": FUSED_STYLE, "layers.*.mlp.down_proj": AFTER_FUSED_STYLE,
    }
    attention = model.model.layers[1].self_attn
    assert attention.o_proj._hp_after is attention.qkv_proj._hp_layout
    # transformers resolves it to concrete parameters, every style known to it
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    assert tp_plan["model.layers.1.self_attn.qkv_proj.bias"] == FUSED_STYLE
    assert tp_plan["model.layers.1.mlp.gate_up_proj.weight"] == FUSED_STYLE
    assert not [k for k in tp_plan if k.endswith((".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"))]
    assert fused_without_tp_layout(model) == []
    # a deep copy shares its layouts between its modules and its recorded stage, not with the original
    twin = copy.deepcopy(model)
    layout = twin.model.layers[1].self_attn.qkv_proj._hp_layout
    assert layout is not attention.qkv_proj._hp_layout and twin.model.layers[1].self_attn.o_proj._hp_after is layout
    (op,) = recorded_stages(twin)[0][0].operations
    assert op.layouts["model.layers.1.self_attn.qkv_proj.weight"] is layout


def test_tp_rules_stay_for_modules_a_fusion_left_alone():
    model = _build("llama")
    model.model.layers[1].self_attn.k_proj = nn.Linear(30, 20, bias=True)
    fuse_qkv(model)
    plan = model._tp_plan
    assert plan["model.layers.*.self_attn.qkv_proj"] == FUSED_STYLE
    # layer 1 keeps colwise q/k/v; the same wildcard names layer 0's slices, which the style skips
    skip = {plan[f"model.layers.*.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")}
    assert skip == {"colwise_hp_skip_fused_slices"}
    style = ALL_PARALLEL_STYLES["colwise_hp_skip_fused_slices"]
    fused_slice = model.model.layers[0].self_attn.q_proj
    assert style.install_forward(fused_slice, mesh=None) is fused_slice and "forward" not in vars(fused_slice)
    assert model.model.layers[1].self_attn.o_proj.__dict__.get("_hp_after") is None  # plain rowwise there


def test_parts_sharded_otherwise_leave_the_fused_linear_whole():
    model = _build("llama")
    model._tp_plan = {"model.layers.*.mlp.gate_proj": "colwise_rep", "model.layers.*.mlp.up_proj": "colwise",
                      "model.layers.*.mlp.down_proj": "rowwise"}
    fuse_gate_up(model)
    assert model._tp_plan == {"model.layers.*.mlp.down_proj": AFTER_FUSED_STYLE}
    reason = ("the TP plan shards its parts by {'model.layers.*.mlp.gate_proj': 'colwise_rep', "
              "'model.layers.*.mlp.up_proj': 'colwise'}, which the fusion cannot follow")
    assert fused_without_tp_layout(model) == [(f"model.layers.{i}.mlp.gate_up_proj", reason) for i in (0, 1)]
    assert model.model.layers[0].mlp.gate_up_proj._hp_layout.decide(2).tp == 1


@pytest.mark.parametrize(("rewrite", "overrides", "tp", "reason"), [
    (QKV, {}, 2, None),
    (QKV, {}, 4, "2 key/value heads not divisible by tp=4"),
    (QKV, dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=45), 2, "3 query heads not divisible by tp=2"),
    (GATE_UP, {}, 2, "intermediate size 43 not divisible by tp=2"),
    (GATE_UP, dict(intermediate_size=42), 3, None),
], ids=["qkv-tp2", "qkv-kv-tp4", "qkv-3heads-tp2", "gate_up-43-tp2", "gate_up-42-tp3"])
def test_fused_layout_decides_by_whole_heads(rewrite, overrides, tp, reason):
    model = build_model("llama", dtype=torch.float32, **overrides)
    rewrite(model)
    name = "qkv_proj" if rewrite is QKV else "gate_up_proj"
    layout = getattr(model.model.layers[0], "self_attn" if rewrite is QKV else "mlp").get_submodule(name)._hp_layout
    assert layout.decide(tp) is layout and layout.decide(tp).reason == reason
    assert layout.tp == (1 if reason else tp)
    total = sum(layout.rows)
    assert layout.local_rows(total) == list(layout.rows)
    if not reason:
        assert layout.local_rows(total // tp) == [rows // tp for rows in layout.rows]
    with pytest.raises(ValueError, match=f"laid out for tp={tp} already"):
        layout.decide(tp + 1)


def test_rank_major_order():
    q, k, v = torch.arange(8), torch.arange(8, 12), torch.arange(12, 16)
    fused = torch.cat([q, k, v])
    assert rank_major(fused, (8, 4, 4), 1) is fused
    assert rank_major(fused, (8, 4, 4), 2).tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]


def test_load_in_rank_major_order_is_exact(checkpoints, pretrained):
    # What a TP plan settles (rows grouped by rank, tp=2) without the sharding: the recorded stage
    # makes the rank-major order, traced (no deferred group), bit for bit, reading each byte once.
    ckpt = checkpoints["llama"]
    with torch.device("meta"):
        model = model_class("llama")(tiny_config("llama", **ckpt.overrides)).float()
    fuse_qkv(model)
    fuse_gate_up(model)
    layouts = [m._hp_layout.decide(2) for m in model.modules() if hasattr(m, "_hp_layout")]
    assert [layout.tp for layout in layouts] == [2, 1, 2, 1]  # gate/up: 43 rows each
    model.to_empty(device="cpu")
    model.tie_weights()
    reader = HFStorageReader(str(ckpt.path), coalesce_gap=0)
    planner = HFMappingPlanner(model)
    load_hf_checkpoint(model, str(ckpt.path), reader=reader, planner=planner)
    reference = pretrained["llama"].state_dict()
    state = model.state_dict()
    for name, value in state.items():
        if ".qkv_proj." in name:
            parts = [reference[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            expected = torch.cat([t.chunk(2)[rank] for rank in range(2) for t in parts])
        elif ".gate_up_proj." in name:
            expected = torch.cat([reference[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")])
        else:
            expected = reference[name]
        assert torch.equal(value, expected), name
    assert planner.stats.deferred_targets == 0
    assert reader.stats.total().bytes_read == planner.stats.bytes_needed

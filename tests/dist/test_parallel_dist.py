"""transformers' plans through ``from_pretrained(distributed_config=...)`` on 2 gloo ranks: what a
requested dim leaves whole is reported exactly then (and only then), and scalar and zero-element
parameters load under FSDP2 and TP.

One spawn runs every case; the oracle is transformers' single-process ``from_pretrained``.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import _randomize_, model_class, tiny_config

IDS = torch.arange(14).reshape(2, 7) * 7 % 101


class LlamaWithExtras(LlamaForCausalLM):
    """Tiny llama plus a learned scalar ``temperature`` (0-d) and an empty ``memory`` bank
    ``[1, 0, hidden]``: FSDP2 cannot shard the first, and shards the second to nothing."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.memory = nn.Parameter(torch.zeros(1, 0, config.hidden_size))

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.temperature
        return out


# name -> (checkpoint, distributed config as a mesh spec)
CASES = {
    "llama-tp": ("llama", "tp=2"),
    "llama-dp": ("llama", "dp=2"),
    "llama-1kv-tp": ("llama-1kv", "tp=2"),
    "gte-tp": ("gte", "tp=2"),
    "gte-dp": ("gte", "dp=2"),
    "extras-dp": ("extras", "dp=2"),
    "extras-tp": ("extras", "tp=2"),
    # a detection model whose class refuses get_input_embeddings, with tied heads (weight and bias)
    "doclayout-tp": ("doclayout", "tp=2"),
    "doclayout-dp": ("doclayout", "dp=2"),
}
NO_FORWARD = ("gte", "doclayout")  # checkpoints whose model the test does not run (no token input)


def _write_tiny_doclayout(path) -> None:
    """A ~1 MB pp_doclayout_v3 (transformers 5.24's smallest consistent config), random weights."""
    from transformers import PPDocLayoutV3Config, PPDocLayoutV3ForObjectDetection

    backbone = {"model_type": "hgnet_v2", "embedding_size": 8, "depths": [1, 1, 1, 1],
                "hidden_sizes": [16, 32, 64, 128], "stem_channels": [3, 8, 8],
                "stage_in_channels": [8, 16, 32, 64], "stage_mid_channels": [8, 8, 16, 32],
                "stage_out_channels": [16, 32, 64, 128], "stage_numb_of_layers": [1, 1, 1, 1],
                "stage_num_blocks": [1, 1, 1, 1], "out_features": ["stage1", "stage2", "stage3", "stage4"],
                "out_indices": [1, 2, 3, 4]}
    config = PPDocLayoutV3Config(
        backbone_config=backbone, encoder_hidden_dim=32, encoder_in_channels=[32, 64, 128], encoder_ffn_dim=32,
        encoder_attention_heads=2, d_model=32, decoder_in_channels=[32, 32, 32], decoder_ffn_dim=32,
        decoder_layers=1, decoder_attention_heads=2, x4_feat_dim=16, mask_feature_channels=[16, 16],
        num_queries=10, num_prototypes=8, global_pointer_head_size=16, num_denoising=0,
    )
    torch.manual_seed(0)
    model = PPDocLayoutV3ForObjectDetection(config)
    _randomize_(model, seed=5)
    model.save_pretrained(path)


class _Recorded(logging.Handler):
    """The messages of the records it handles (the warnings hp_dcp_hf logs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(rank: int, world: int, paths: dict[str, str]) -> dict:
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf import from_pretrained

    out = {}
    for name, (ckpt, spec) in CASES.items():
        model_cls = LlamaWithExtras if ckpt == "extras" else None
        caught = _Recorded()
        logging.getLogger("hp_dcp_hf").addHandler(caught)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, report = from_pretrained(paths[ckpt], dtype=torch.float32, model_cls=model_cls,
                                                distributed_config=spec)
        finally:
            logging.getLogger("hp_dcp_hf").removeHandler(caught)
        params = dict(model.named_parameters())
        state = {k: _full(v) for k, v in model.state_dict().items()}
        logits = None
        if ckpt not in NO_FORWARD:
            with torch.no_grad():
                logits = _full(model(input_ids=IDS).logits)
        out[name] = {
            "state": state, "logits": logits, "unsharded": [str(u) for u in report.unsharded],
            "warnings": [m for m in caught.messages if "parallelism left modules whole" in m],
            "unexpected": report.unexpected_keys, "missing": report.missing_keys, "loaded": report.loaded_keys,
            "sharded": sorted(k for k, v in params.items() if isinstance(v, DTensor)),
            "plain": sorted(k for k, v in params.items() if not isinstance(v, DTensor)),
        }
    return out


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    extras = tmp_path_factory.mktemp("extras") / "llama-extras"
    torch.manual_seed(0)
    model = LlamaWithExtras._from_config(tiny_config("llama", intermediate_size=42), dtype=torch.float32)
    _randomize_(model, seed=3)
    model.save_pretrained(extras)
    doclayout = tmp_path_factory.mktemp("doclayout") / "pp_doclayout_v3"
    _write_tiny_doclayout(doclayout)
    paths = {
        "llama": str(tiny_checkpoints("llama", torch.float32, intermediate_size=42).path),
        "llama-1kv": str(tiny_checkpoints("llama", torch.float32, intermediate_size=42, num_key_value_heads=1).path),
        "gte": str(tiny_checkpoints("gte", torch.float32).path),
        "extras": str(extras),
        "doclayout": str(doclayout),
    }
    per_rank = run_ranks(2, _run, paths, timeout=300)
    references = {}
    for ckpt, path in paths.items():
        from transformers import PPDocLayoutV3ForObjectDetection

        classes = {"extras": LlamaWithExtras, "doclayout": PPDocLayoutV3ForObjectDetection}
        cls = classes.get(ckpt) or model_class(ckpt.split("-")[0])
        reference = cls.from_pretrained(path, dtype=torch.float32).eval()
        logits = None
        if ckpt not in NO_FORWARD:
            with torch.no_grad():
                logits = reference(input_ids=IDS).logits
        references[ckpt] = {"state": reference.state_dict(), "logits": logits}
    return per_rank, references


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_from_pretrained(run, case):
    per_rank, references = run
    reference = references[CASES[case][0]]
    for rank, result in enumerate(per_rank):
        r = result[case]
        assert r["missing"] == () and r["unexpected"] == (), (rank, r["unexpected"])
        assert set(r["state"]) == set(reference["state"])
        bad = sorted(k for k, v in r["state"].items() if not torch.equal(v, reference["state"][k]))
        assert not bad, (rank, bad)
        if reference["logits"] is not None:
            torch.testing.assert_close(r["logits"], reference["logits"], rtol=1e-4, atol=1e-5)


def test_no_warning_when_every_requested_dim_shards(run):
    per_rank, _ = run
    for name in ("llama-tp", "llama-dp", "gte-dp"):
        for result in per_rank:
            assert result[name]["unsharded"] == [] and result[name]["warnings"] == [], name
        assert "model.layers.0.self_attn.k_proj.weight" in per_rank[0][name]["sharded"] or name == "gte-dp"


def test_indivisible_heads_leave_attention_whole_with_a_warning(run):
    per_rank, _ = run
    expected = ["tp: model.layers.*.self_attn not sharded: head counts (num_attention_heads=4, "
                "num_key_value_heads=1) not divisible by tp=2"]
    for rank, result in enumerate(per_rank):
        r = result["llama-1kv-tp"]
        assert r["unsharded"] == expected
        assert r["warnings"] == ([f"parallelism left modules whole:\n  {expected[0]}"] if rank == 0 else [])
        assert "model.layers.0.self_attn.k_proj.weight" in r["plain"]
        assert "model.layers.0.mlp.down_proj.weight" in r["sharded"]  # the MLP still is TP


@pytest.mark.parametrize("case, cls", [("gte-tp", "GteModel"), ("doclayout-tp", "PPDocLayoutV3ForObjectDetection")])
def test_no_tp_plan_is_reported(run, case, cls):
    per_rank, _ = run
    for rank, result in enumerate(per_rank):
        r = result[case]
        assert r["unsharded"] == [f"tp: * not sharded: {cls} has no tp plan (base_model_tp_plan); "
                                  "pass tp_plan= to shard it"]
        assert r["sharded"] == [] and bool(r["warnings"]) == (rank == 0)


def test_a_model_without_embeddings_is_fully_sharded(run):
    """transformers' plan resolution asks for the input embeddings, which pp_doclayout_v3 refuses."""
    per_rank, _ = run
    for result in per_rank:
        r = result["doclayout-dp"]
        assert r["unsharded"] == [] and "model.enc_score_head.weight" in r["sharded"], r["plain"][:5]


def test_scalar_and_empty_parameters(run):
    per_rank, _ = run
    for result in per_rank:
        dp, tp = result["extras-dp"], result["extras-tp"]
        assert dp["unsharded"] == ["dp: temperature not sharded: scalar (0-d) parameters: FSDP2 cannot shard "
                                   "them, every rank holds them"]
        assert "temperature" in dp["plain"] and "memory" in dp["sharded"]
        assert {"temperature", "memory"} <= set(dp["loaded"]) and {"temperature", "memory"} <= set(tp["loaded"])
        assert tp["unsharded"] == []
        assert dp["state"]["memory"].shape == (1, 0, 44)

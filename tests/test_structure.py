"""Structure sharing: the plan traced once per structure equals the plan traced group by group.

The shared path renames once per key family, traces each structurally identical group once and
caches each structure's blocks per shard box; ``share_structure=False`` does every key and group
on its own. Both must give the same ReadItems, in the same order, with the same destinations.
"""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf import HFStorageReader
from hp_dcp_hf.tools.fake_ranks import fake_rank, register_fake_backend
from hp_dcp_hf.transforms import fuse_qkv, grouped_gemm_experts
from tests.support.layouts import apply_layout
from tests.support.models import MODEL_TYPES, build_model
from tests.support.symbolic_check import assert_same_plans

WORLD = 4
LAYOUTS = ("shard0", "shard_last", "strided", "fsdp_tp")


@pytest.fixture(scope="module")
def fake_world():
    register_fake_backend()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sharded_plans_item_by_item(model_type, layout, tiny_checkpoints, fake_world):
    metadata = HFStorageReader(tiny_checkpoints(model_type, torch.float32).path).read_metadata()
    for rank in (0, WORLD - 1):
        with fake_rank(rank, WORLD):
            model = build_model(model_type)
            apply_layout(model, layout, WORLD)
            assert_same_plans(model, metadata)


@pytest.mark.parametrize("rewrites", [(fuse_qkv,), (fuse_qkv, grouped_gemm_experts)], ids=["qkv", "qkv+experts"])
def test_rewritten_plans_item_by_item(rewrites, tiny_checkpoints, fake_world):
    metadata = HFStorageReader(tiny_checkpoints("mixtral", torch.float32).path).read_metadata()
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            model = build_model("mixtral")
            for rewrite in rewrites:
                rewrite(model)
            apply_layout(model, "fsdp_tp", WORLD)
            shared, per_group = assert_same_plans(model, metadata)
            assert shared < per_group  # every layer's experts and fused qkv: one structure each

"""Bugs of peer loaders that this project does not have, shown side by side on the same ranks.

- torch DCP's ``DefaultLoadPlanner`` describes a non-contiguous ``_StridedShard`` as one box and
  loads wrong values silently; ``HFMappingPlanner`` loads the right ones.
- transformers 5.24 shard-on-read (``DtensorShardOperation`` inside
  ``convert_and_load_state_dict_in_model``) gets ``Chunk`` (GTE's fused qkv) and
  ``PermuteForRope`` under TP wrong; the same layout through our planner is bit-exact.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from hp_dcp_hf import HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.layouts import apply_layout
from tests.support.models import checkpoint_files, load_reference, model_class, tiny_config


def _wrong_keys(model, reference) -> list[str]:
    return sorted(k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), reference[k]))


def _transformers_shard_on_read(model, path: str) -> None:
    handles = [safe_open(str(f), "pt") for f in checkpoint_files(path)]
    slices = {key: handle.get_slice(key) for handle in handles for key in handle.keys()}  # noqa: SIM118
    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=torch.float32)
    convert_and_load_state_dict_in_model(model, slices, config)


def _peers(rank: int, world: int, strided_file: str, paths: dict[str, str]) -> dict:
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    with safe_open(strided_file, "pt") as f:
        truth = f.get_tensor("w")
    for planner_name in ("torch", "ours"):
        param = nn.Parameter(distribute_tensor(torch.zeros_like(truth), mesh, [_StridedShard(0, split_factor=2)],
                                               src_data_rank=None), requires_grad=False)
        module = nn.Module()
        module.register_parameter("w", param)
        if planner_name == "torch":
            dcp.load(module.state_dict(), storage_reader=HFStorageReader(strided_file))
        else:
            load_hf_checkpoint(module, strided_file, weights_mapping=[])
        out[f"strided-{planner_name}"] = torch.equal(param.full_tensor(), truth)
    for model_type, path in paths.items():
        reference = load_reference(path, model_type, torch.float32)
        for loader in ("transformers", "ours"):
            model = model_class(model_type)(tiny_config(model_type)).float()
            apply_layout(model, "shard0", world)
            if loader == "transformers":
                try:
                    _transformers_shard_on_read(model, path)
                except Exception as error:  # a peer failing loudly is also a finding
                    out[f"{model_type}-{loader}"] = f"raised {type(error).__name__}"
                    continue
            else:
                load_hf_checkpoint(model, path)
            out[f"{model_type}-{loader}"] = _wrong_keys(model, reference)
    return out


def test_peers_load_wrong_values_where_we_load_right_ones(tmp_path, tiny_checkpoints):
    strided_file = tmp_path / "strided.safetensors"
    save_file({"w": torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)}, strided_file)
    paths = {m: str(tiny_checkpoints(m, torch.float32).path) for m in ("gte", "gradium_phonon_tts")}
    results = run_ranks(2, _peers, str(strided_file), paths, timeout=180)
    for r in results:
        assert r["strided-torch"] is False and r["strided-ours"] is True
        assert r["gte-ours"] == [] and r["gradium_phonon_tts-ours"] == []
        assert r["gte-transformers"] and r["gradium_phonon_tts-transformers"]

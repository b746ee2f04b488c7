"""Real FSDP2: ``fully_shard`` renames classes (``FSDPGteModel``), the checkpoint mapping still holds."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hp_dcp_hf import load_hf_checkpoint
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import load_reference, model_class, tiny_config


def _fully_sharded_loads(rank: int, world: int, paths: dict[str, str]) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for model_type, path in paths.items():
        with torch.device("meta"):
            model = model_class(model_type)(tiny_config(model_type)).float()
        for layer in model.layers if hasattr(model, "layers") else model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model).__name__.startswith("FSDP")
        model.to_empty(device="cpu")
        load_hf_checkpoint(model, path)
        reference = load_reference(path, model_type, torch.float32)
        out[model_type] = sorted(
            k for k, v in model.state_dict().items()
            if k in reference and not torch.equal(v.full_tensor(), reference[k])
        )
    return out


def test_fully_sharded_models_keep_their_class_name_mappings(tiny_checkpoints):
    paths = {m: str(tiny_checkpoints(m, torch.float32).path) for m in ("gte", "gradium_phonon_tts", "mixtral")}
    for result in run_ranks(2, _fully_sharded_loads, paths, timeout=180):
        assert result == {m: [] for m in paths}

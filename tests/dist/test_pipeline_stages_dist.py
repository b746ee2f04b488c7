"""Pipeline stages on 4 gloo ranks (2 stages x 2 FSDP ranks): each stage holds only its layers,
under their names in the whole model (as torchtitan's pipeline split keeps them), reads only its
own bytes, and the stages together save one checkpoint equal to ``save_pretrained`` of the whole
model, published once.

Stage ranks lay their layers out on meshes of one kind (each stage's ``dp`` submesh): the replica
groups of a save or a cooperative load must not take rank 0 of one stage for a copy of rank 0 of
the other (:func:`hp_dcp_hf.geometry.replicas.model_part`).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.checkpoints import assert_same_checkpoint
from tests.support.models import checkpoint_files, load_reference, model_class

LAYERS, STAGES = 4, 2


def _stage_model(config, stage: int):
    """The whole model's class on meta, cut to stage ``stage``: its layers (a ModuleDict keeps their
    names), the embeddings on the first, the final norm and head on the last."""
    from torch import nn

    with torch.device("meta"):
        model = model_class("llama")._from_config(config, dtype=torch.float32)
    per = LAYERS // STAGES
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in range(stage * per, (stage + 1) * per)})
    if stage != 0:
        model.model.embed_tokens = None
    if stage != STAGES - 1:
        model.model.norm = None
        model.lm_head = None
    return model


def _run(rank: int, world: int, path: str, out: str, refused: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf import HFStorageReader, load_hf_checkpoint, save_hf_checkpoint
    from hp_dcp_hf.errors import MappingError
    from hp_dcp_hf.model.config import read_config

    mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
    model = _stage_model(read_config(path), mesh["pp"].get_local_rank())
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    reader = HFStorageReader(path, cooperate="always")  # the ranks of both stages cooperate
    report = load_hf_checkpoint(model, path, unexpected="ignore", reader=reader)
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    try:  # without pipeline_stage=True, another stage's tensors are a hole in this rank's inverse
        save_hf_checkpoint(model, refused, max_shard_size="20KB")
        without = None
    except MappingError as e:
        without = str(e)
    save_hf_checkpoint(model, out, max_shard_size="20KB", pipeline_stage=True)
    stats = reader.stats.total()
    return {"state": state, "loaded": report.loaded_keys, "unexpected": report.unexpected_keys,
            "read": stats.bytes_read, "needed": stats.bytes_needed, "without": without}


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    ckpt = tiny_checkpoints("llama", torch.float32, tie_word_embeddings=False, num_hidden_layers=LAYERS)
    root = tmp_path_factory.mktemp("stages")
    results = run_ranks(4, _run, str(ckpt.path), str(root / "saved"), str(root / "refused"), timeout=300)
    return ckpt, results, root


def test_each_stage_loads_its_layers_and_reads_only_their_bytes(run):
    ckpt, results, _ = run
    reference = load_reference(ckpt.path, "llama", torch.float32)
    stored = {k: v for f in checkpoint_files(ckpt.path) for k, v in load_file(f).items()}
    for rank, result in enumerate(results):
        assert result["state"] and all(torch.equal(v, reference[k]) for k, v in result["state"].items()), rank
        assert set(result["loaded"]) == set(result["state"])
        assert set(result["loaded"]) | set(result["unexpected"]) == set(stored)  # the others': other stages'
        assert result["read"] == result["needed"], rank
    stage_keys = [set(results[0]["state"]), set(results[2]["state"])]
    assert not stage_keys[0] & stage_keys[1] and "model.layers.1.mlp.up_proj.weight" in stage_keys[0]
    # every stored byte read once in all: stages hold disjoint tensors, FSDP ranks disjoint rows
    assert sum(r["read"] for r in results) == sum(t.numel() * t.element_size() for t in stored.values())
    assert math.prod(stored["lm_head.weight"].shape) > 0


def test_the_stages_save_one_checkpoint_equal_to_save_pretrained(run):
    ckpt, results, root = run
    assert_same_checkpoint(root / "saved", ckpt.path)
    for result in results:  # refused on every rank, nothing published
        assert result["without"] is not None and "elements come from the model" in result["without"]
    assert not (root / "refused").exists() or not any((root / "refused").glob("*.safetensors"))

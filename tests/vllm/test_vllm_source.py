"""VLLMWeightSource is vLLM's own trainer-side ``WeightSource``: on 2 gloo ranks over DTensor
layouts (rows, columns, a non-contiguous ``_StridedShard``, replicated) of a tiny llama, rank 0
yields every checkpoint tensor whole, bit for bit the checkpoint's (``save_pretrained``), in an
order vLLM's default ``iter_groups()`` accepts; rank 1 yields ``(name, None)`` after sending rank 0
its part, and sends exactly the bytes it holds that rank 0 does not (counted on both sides).

Plain DTensor layouts (tests/support/layouts.py), not transformers' TP plans: vLLM's venv has
transformers 5.19, which lacks them. vLLM's ``nccl`` trainer engine, the consumer on GPU, cannot
run here (no NCCL on CPU); this is the protocol it iterates, driven as it drives it.
"""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import make_checkpoint, read_checkpoint

LAYOUTS = ("shard0", "shard_last", "strided", "replicate")


def _ranks(rank: int, world: int, path: str) -> dict:
    from hp_dcp_hf import load_hf_checkpoint
    from hp_dcp_hf.geometry.shards import local_shard_pieces
    from hp_dcp_hf.integrations.vllm.source import VLLMWeightSource
    from hp_dcp_hf.sync.source import HFWeightSource
    from tests.support.layouts import apply_layout
    from tests.support.models import build_model

    out = {}
    for layout in LAYOUTS:
        model = build_model("llama", dtype=torch.bfloat16, seed=7)
        apply_layout(model, layout, world)  # NaN everywhere: the load below gives the values
        load_hf_checkpoint(model, path)
        source = VLLMWeightSource(HFWeightSource(model, lowest_replica_holds=True))
        groups = [(names, [None if t is None else t.clone() for t in tensors])
                  for names, tensors in source.iter_groups()]  # vLLM's default, checking the order
        out[layout] = {
            "metadata": [(m.name, m.dtype, m.shape) for m in source.metadata()], "groups": groups,
            "held_names": source.held_names(), "sent": source.bytes_sent, "received": source.bytes_received,
            "held": {name: [p.global_box for p in local_shard_pieces(t, key=name)]
                     for name, t in model.state_dict().items()}}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("vllm-source") / "ckpt", dtype=torch.bfloat16, seed=3)
    return read_checkpoint(path), run_ranks(2, _ranks, str(path), timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank0_yields_the_checkpoint_and_rank1_sends_only_what_rank0_lacks(ranks, layout):
    from vllm.distributed.weight_transfer.base import layerwise_groups

    checkpoint, results = ranks
    first, second = results[0][layout], results[1][layout]
    names = [name for name, _, _ in first["metadata"]]
    assert first["metadata"] == second["metadata"]  # the whole model on every rank
    assert sorted(names) == sorted(checkpoint)
    assert all(dtype == checkpoint[n].dtype and shape == tuple(checkpoint[n].shape)
               for n, dtype, shape in first["metadata"])
    assert [n for group in layerwise_groups(names) for n in group] == names
    assert first["held_names"] == names
    yielded = {n: t for group, tensors in first["groups"] for n, t in zip(group, tensors)}
    assert [n for group, _ in first["groups"] for n in group] == names
    assert not [n for n in names if not torch.equal(yielded[n].view(torch.uint8), checkpoint[n].view(torch.uint8))]
    assert all(t is None for _, tensors in second["groups"] for t in tensors)
    assert set(second["held_names"]) <= set(names)

    def numel(boxes):
        return sum(b.numel for b in boxes)

    lacking = sum(numel(second["held"][n]) - numel([p for a in second["held"][n] for b in first["held"][n]
                                                    if (p := a.intersect(b)) is not None])
                  for n in names) * 2  # bf16
    assert second["sent"] == first["received"] == lacking
    assert (lacking == 0) == (layout == "replicate")

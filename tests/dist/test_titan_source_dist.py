"""A torchtitan llama3's weight source (:func:`hp_dcp_hf.integrations.torchtitan.weight_source`) on 2
gloo ranks, under torchtitan's own TP and FSDP2: the ranks' slices assemble to the checkpoint
(``save_pretrained``) bit for bit, and after an in-place training step on the local shards (of
parameters that require grad, as torchtitan's do) they read the new values.
"""

from __future__ import annotations

import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support import titan
from tests.support.engine import ENGINE_CONFIG
from tests.support.models import make_checkpoint, read_checkpoint

LAYOUTS = {"tp": {"tp": 2}, "fsdp": {"dp_shard": 2}}


def _slices(rank: int, world: int, path: str) -> dict:
    from hp_dcp_hf.geometry.shards import local_tensor
    from hp_dcp_hf.integrations import torchtitan as tt

    out = {}
    for layout, degrees in LAYOUTS.items():
        model = titan.parallelized(titan.ENGINE_LLAMA3, titan.Layout(layout, **degrees))
        tt.load_hf_checkpoint(model, path)
        source = tt.weight_source(model)
        before = [(held.name, held.box, values.clone()) for held, values in source]
        with torch.no_grad():
            for param in model.parameters():
                local_tensor(param).add_(1.0)
        after = [values.clone() for _, values in source]
        out[layout] = {"before": before, "after": after,
                       "metadata": [(m.name, m.dtype, m.shape) for m in source.metadata()]}
    return out


def test_titan_weight_source_slices_are_the_checkpoint_and_read_the_live_weights(tmp_path):
    path = make_checkpoint("llama", tmp_path / "ckpt", dtype=torch.float32, seed=1,
                           **{**ENGINE_CONFIG, "hidden_size": 128, "tie_word_embeddings": False})
    checkpoint = read_checkpoint(path)
    results = run_ranks(2, _slices, str(path), timeout=300)
    for layout in LAYOUTS:
        full = {n: torch.full(s, float("nan"), dtype=d) for n, d, s in results[0][layout]["metadata"]}
        for rank in results:
            for (name, box, values), stepped in zip(rank[layout]["before"], rank[layout]["after"]):
                full[name][box.slices()] = values
                assert torch.equal(stepped, values + 1.0), (layout, name)
        assert sorted(full) == sorted(checkpoint)
        assert not [n for n in checkpoint if not torch.equal(full[n], checkpoint[n])], layout

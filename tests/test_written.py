"""A load writes the model's own tensors, or says why it cannot: modules whose ``state_dict()``
hands out hook-made copies (as torchtitan's fused attention does), conversion ops that need model
facts the config lacks (``PermuteForRope``'s heads), and the sentinel check that proves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import PermuteForRope, WeightConverter, WeightRenaming

from hp_dcp_hf import load_hf_checkpoint
from hp_dcp_hf.errors import MappingError, PlanningError

Q, KV, HIDDEN = 8, 4, 6  # rows of q and of each of k, v; columns


class FusedAttention(nn.Module):
    """One ``wqkv`` parameter; ``state_dict()`` hands out fresh ``wq`` / ``wk`` / ``wv`` tensors that
    only the load hook merges back (torchtitan's ``FusedQKVLinear`` pattern)."""

    def __init__(self, *, merge: bool = True) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.zeros(Q + 2 * KV, HIDDEN))
        self._register_state_dict_hook(self._split)
        self._register_load_state_dict_pre_hook(self._merge if merge else self._drop, with_module=False)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), fused.split([Q, KV, KV])):
            state_dict[f"{prefix}{name}.weight"] = part.clone()
        return state_dict

    @staticmethod
    def _merge(state_dict, prefix, *args):
        parts = [state_dict.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
        state_dict[prefix + "wqkv"] = torch.cat(parts)

    @staticmethod
    def _drop(state_dict, prefix, *args):  # takes the entries and writes nothing: a broken hook
        for name in ("wq", "wk", "wv"):
            state_dict.pop(f"{prefix}{name}.weight")


class Tiny(nn.Module):
    def __init__(self, *, merge: bool = True) -> None:
        super().__init__()
        self.attn = FusedAttention(merge=merge)
        self.norm = nn.Parameter(torch.zeros(HIDDEN))


def _checkpoint(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {"layer.q_proj.weight": torch.randn(Q, HIDDEN), "layer.k_proj.weight": torch.randn(KV, HIDDEN),
               "layer.v_proj.weight": torch.randn(KV, HIDDEN), "layer.norm": torch.randn(HIDDEN)}
    save_file(tensors, tmp_path / "model.safetensors")
    return str(tmp_path), tensors


RENAMES = [WeightRenaming(r"layer\.q_proj", "attn.wq"), WeightRenaming(r"layer\.k_proj", "attn.wk"),
           WeightRenaming(r"layer\.v_proj", "attn.wv"), WeightRenaming(r"layer\.norm", "norm")]


@pytest.mark.parametrize("check_written", [False, True])
def test_hook_made_state_dict_entries_reach_the_model_through_its_load_state_dict(tmp_path, check_written):
    path, tensors = _checkpoint(tmp_path)
    model = Tiny()
    report = load_hf_checkpoint(model, path, weights_mapping=RENAMES, check_written=check_written)
    assert set(report.loaded_keys) == {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "norm"}
    expected = torch.cat([tensors[f"layer.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(model.attn.wqkv.detach(), expected)  # before the fix: zeros, and "all loaded"
    assert torch.equal(model.norm.detach(), tensors["layer.norm"])


def test_the_sentinel_check_catches_a_hook_that_takes_the_values_and_writes_nothing(tmp_path):
    path, _ = _checkpoint(tmp_path)
    model = Tiny(merge=False)
    with torch.no_grad():
        model.attn.wqkv.fill_(3)
    with pytest.raises(PlanningError, match=r"left 1 model tensors unwritten: \['attn.wqkv'\]"):
        load_hf_checkpoint(model, path, weights_mapping=RENAMES, check_written=True)
    assert bool((model.attn.wqkv == 3).all()) and bool((model.norm == 0).all())  # as it was


def test_a_hook_made_entry_nothing_takes_back_is_refused(tmp_path):
    path, tensors = _checkpoint(tmp_path)

    class Extra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.Parameter(torch.zeros(HIDDEN))
            self._register_state_dict_hook(lambda m, sd, prefix, meta: sd.update({prefix + "copy": sd[prefix + "norm"].clone()}))

    save_file({"norm": tensors["layer.norm"], "copy": tensors["layer.norm"].clone()}, tmp_path / "model.safetensors")
    with pytest.raises(PlanningError, match=r"not the model's own and load_state_dict does not take back: \['copy'\]"):
        load_hf_checkpoint(Extra(), path, weights_mapping=[])


def _rope_checkpoint(tmp_path) -> tuple[str, torch.Tensor]:
    torch.manual_seed(1)
    weight = torch.randn(Q, HIDDEN)
    save_file({"q.weight": weight}, tmp_path / "model.safetensors")
    return str(tmp_path), weight


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, Q, bias=False)


ROPE = [WeightConverter("q.weight", "q.weight", operations=[PermuteForRope()])]


def test_permute_for_rope_without_a_head_count_is_refused_not_guessed(tmp_path):
    path, _ = _rope_checkpoint(tmp_path)
    model = Projection()  # no .config: transformers' op would permute as one head
    before = model.q.weight.detach().clone()
    with pytest.raises(MappingError, match=r"PermuteForRope needs the head count \(config.num_attention_heads\)"):
        load_hf_checkpoint(model, path, weights_mapping=ROPE)
    assert torch.equal(model.q.weight.detach(), before)


def test_permute_for_rope_with_an_explicit_config_loads_what_transformers_op_computes(tmp_path):
    path, weight = _rope_checkpoint(tmp_path)
    config = SimpleNamespace(num_attention_heads=2)
    model = Projection()
    load_hf_checkpoint(model, path, weights_mapping=ROPE, config=config)
    expected = PermuteForRope()._permute_for_rope(weight.clone(), config)
    assert not torch.equal(expected, weight) and torch.equal(model.q.weight.detach(), expected)

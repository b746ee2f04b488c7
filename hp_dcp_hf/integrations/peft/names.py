"""The adapter's tensor names: peft's file names (``adapter_model.safetensors``) of the model's
adapter tensors, as ``get_peft_model_state_dict`` saves them and ``set_peft_model_state_dict`` loads
them back, and :class:`AdapterTensors`, the view of the model under those names that the planners
load into and save from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hp_dcp_hf.errors import PlanningError
from hp_dcp_hf.integrations.peft.config import lora_config, require_peft
from hp_dcp_hf.mapping.families import natural_sorted


@contextmanager
def _tp_marker_hidden(model: nn.Module) -> Iterator[None]:
    """For the block, no module of ``model`` carries transformers' ``_tp_size`` (set by
    ``distributed_config=``): with it, peft's ``get_peft_model_state_dict`` gathers every tensor
    of the state dict it is given (transformers' ``gather_state_dict_for_save``), and the names are
    all it is asked for here."""
    marked = [(module, module.__dict__["_tp_size"]) for module in model.modules()
              if module.__dict__.get("_tp_size")]
    for module, _ in marked:
        module.__dict__["_tp_size"] = None
    try:
        yield
    finally:
        for module, size in marked:
            module.__dict__["_tp_size"] = size


def adapter_names_and_dropped(model: nn.Module, adapter_name: str,
                   save_embedding_layers: bool | str) -> tuple[dict[str, str], frozenset[str]]:
    """peft's file names of the adapter's tensors -> the model keys they are saved from, and the
    file names peft's load drops (it loads them into no tensor of the model)."""
    peft = require_peft()
    lora_config(model, adapter_name)
    state = model.state_dict()
    placeholders = {key: torch.empty(0, device="meta") for key in state}
    by_id = {id(t): key for key, t in placeholders.items()}
    with _tp_marker_hidden(model):
        selected = peft.get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter_name,
                                                  save_embedding_layers=save_embedding_layers)
    names = {}
    for file_key, tensor in selected.items():
        model_key = by_id.get(id(tensor))
        if model_key is None:  # a tensor peft made rather than selected: no byte range of the model holds it
            raise PlanningError("peft's adapter state dict holds a tensor that is none of the model's",
                                key=file_key)
        names[file_key] = model_key
    loaded = _peft_load_keys(model, list(names), adapter_name)
    dropped = frozenset(f for f in names if loaded.get(f) not in state)
    wrong = [(f, names[f], loaded[f]) for f in names if f not in dropped and loaded[f] != names[f]]
    if wrong:
        file_key, saved_from, loaded_into = wrong[0]
        raise PlanningError(f"peft saves {saved_from!r} under this name but loads the name into {loaded_into!r}",
                            key=file_key)
    return {key: names[key] for key in natural_sorted(names)}, dropped


def adapter_keys(model: nn.Module, adapter_name: str = "default", *,
                 save_embedding_layers: bool | str = "auto") -> dict[str, str]:
    """The adapter's tensors as ``peft`` names them in ``adapter_model.safetensors``, each mapped to
    the key of the model's state dict that holds it, in the file's natural order.

    The names are peft's own: ``get_peft_model_state_dict`` (what ``save_pretrained`` writes) runs
    over placeholders of the model's state dict, so no tensor is touched or gathered (also not on a
    model that ``distributed_config=`` marked tensor-parallel), and every name is checked against
    what ``set_peft_model_state_dict`` maps it back to. A disagreement is a :class:`PlanningError`:
    loading and saving would not be inverses. A name peft's load puts into no tensor of the model is
    kept (``save_pretrained`` writes it): with ``save_embedding_layers=True`` and an embedding in
    ``modules_to_save``, peft also writes ``lm_head.modules_to_save.weight``, which its load drops.
    """
    return adapter_names_and_dropped(model, adapter_name, save_embedding_layers)[0]


def _peft_load_keys(model: nn.Module, file_keys: list[str], adapter_name: str) -> dict[str, str]:
    """Where ``set_peft_model_state_dict`` puts each of ``file_keys`` (its key steps only: the
    auxiliary wrappers' load maps, then the tuner's remap, then the prefix rule)."""
    require_peft()
    from peft.utils.other import AuxiliaryTrainingWrapper
    from peft.utils.save_and_load import PEFT_TYPE_TO_TUNER_MAPPING

    config = model.peft_config[adapter_name]
    state = {key: key for key in file_keys}
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            key_map = module.adapter_state_dict_load_map(adapter_name)
            for k, stored in key_map.items():
                lookup = f"{name}.{k}"
                if lookup in state:
                    state[f"{name}.{stored}"] = state.pop(lookup)
    tuner = PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type]
    placeholders = {key: torch.empty(0, device="meta") for key in state}
    remapped = tuner._remap_adapter_state_dict_for_load(model=model, config=config, adapter_name=adapter_name,
                                                        state_dict=placeholders)
    by_id = {id(t): key for key, t in placeholders.items()}
    prefix = "base_model.model."
    requires_prefix = any(n.startswith(prefix) for n, _ in model.named_parameters())
    out = {}
    for model_key, tensor in remapped.items():
        if not requires_prefix:
            model_key = model_key.removeprefix(prefix)
        out[state[by_id[id(tensor)]]] = model_key
    return out


class AdapterTensors(nn.Module):
    """The adapter's tensors of ``model`` under their ``adapter_model.safetensors`` names: what the
    planners load into and save from, so that their checkpoint mapping is the identity.

    Not a copy: ``state_dict()`` hands out the model's own tensors (its DTensors, as sharded), and
    ``named_parameters()`` its parameters, under the file's names.
    """

    def __init__(self, model: nn.Module, names: Mapping[str, str]) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: its state is not this module's
        self.names = dict(names)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        full = self._model.state_dict()
        return {file_key: full[model_key] for file_key, model_key in self.names.items()}

    def _own(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # Each tensor under its first name only: peft writes tied tensors (a tied lm_head saved with
        # the embeddings) under every name, so here they are not aliases of one another, and each
        # name is a tensor of the file of its own.
        by_key, seen = dict(tensors), set()
        for file_key, model_key in self.names.items():
            if model_key in by_key and id(by_key[model_key]) not in seen:
                seen.add(id(by_key[model_key]))
                yield file_key, by_key[model_key]

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._own(self._model.named_parameters(remove_duplicate=False))

    def named_buffers(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._own(self._model.named_buffers(remove_duplicate=False))

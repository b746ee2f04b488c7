"""The checkpoint's ``config.json`` and the model class it names: read through the storage layer
(size-capped), and refused up front when the class is of another model type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hp_dcp_hf.errors import ArchitectureMismatchError, CheckpointFormatError, PipelineError
from hp_dcp_hf.storage import filesystem, locate
from hp_dcp_hf.storage.format.catalog import CONFIG_FILE
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES
from hp_dcp_hf.storage.format.json_file import read_json


def read_config(path: str, storage_options: Mapping[str, Any] | None = None):
    """The ``PretrainedConfig`` of the checkpoint at ``path`` (its directory's ``config.json``).

    Read through :mod:`hp_dcp_hf.storage`, so local paths and fsspec URLs work alike.
    """
    from transformers import CONFIG_MAPPING

    location, _ = locate(*filesystem(path, storage_options))
    data = read_json(location, CONFIG_FILE, cap=MAX_HEADER_BYTES, missing=(
        "the checkpoint has no config.json; pass from_pretrained(..., config=<a PretrainedConfig>)"))
    if not isinstance(data.get("model_type"), str):
        raise CheckpointFormatError("config.json has no model_type", file=CONFIG_FILE)
    if data["model_type"] not in CONFIG_MAPPING:
        raise CheckpointFormatError(
            f"model_type {data['model_type']!r} is unknown to transformers", file=CONFIG_FILE
        )
    config_class = CONFIG_MAPPING[data["model_type"]]
    # As AutoConfig reads it: floats JSON cannot hold are stored as {"__float__": "Infinity"}.
    config = config_class.from_dict(config_class._decode_special_floats(data))
    config.name_or_path = path  # as from_pretrained names it (model.name_or_path; peft's base_model_name_or_path)
    return config


def resolve_model_class(config, model_cls: type[nn.Module] | None = None) -> type[nn.Module]:
    """``model_cls``, else the first of ``config.architectures`` transformers has, else the
    ``AutoModelForCausalLM`` then ``AutoModel`` class of the config."""
    if model_cls is not None:
        return model_cls
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except (KeyError, ValueError):
            continue
    raise PipelineError(
        f"no model class for {type(config).__name__} (architectures={getattr(config, 'architectures', None)}); "
        "pass model_cls="
    )


def check_architecture(config, model_cls: type[nn.Module]) -> None:
    """Refuse a class of another model type than ``config``'s (a Llama class for a Mixtral
    checkpoint), naming both, instead of failing later in the constructor or as missing keys."""
    expected = getattr(getattr(model_cls, "config_class", None), "model_type", "")
    types = {config.model_type} | {getattr(getattr(config, name, None), "model_type", None)
                                   for name in getattr(config, "sub_configs", {})}
    if expected and expected not in types and model_cls.__name__ not in _classes_for(config):
        raise ArchitectureMismatchError(
            f"the checkpoint is a {config.model_type!r} model (architectures "
            f"{getattr(config, 'architectures', None)}), {model_cls.__name__} a {expected!r} one; pass a "
            f"{config.model_type!r} class as model_cls=, or none to use the config's",
            file=CONFIG_FILE,
        )


def _classes_for(config) -> set[str]:
    """The class names transformers itself builds for ``config``: its ``architectures`` and the
    auto mappings' classes for its model type (``exaone`` is served by ``LlamaForCausalLM``)."""
    from transformers.models.auto import modeling_auto

    names = set(getattr(config, "architectures", None) or ())
    for attribute in dir(modeling_auto):
        if attribute.startswith("MODEL_") and attribute.endswith("_MAPPING_NAMES"):
            served = getattr(modeling_auto, attribute).get(config.model_type, ())
            names.update((served,) if isinstance(served, str) else served)
    return names

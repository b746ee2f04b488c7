"""PEFT adapters made, loaded and compared as peft itself does, for the one-process and multi-rank tests."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from hp_dcp_hf.integrations.peft import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_keys,
)
from tests.support.models import build_model, make_checkpoint, model_class

_SET_FIELDS = ("target_modules", "target_parameters", "exclude_modules", "modules_to_save")


# LoRA on attention and on the dense MLP Linears (llama), on attention and on the stacked experts'
# parameters (qwen3_moe: its MLP is experts only, which peft targets as parameters, ParamWrapper).
TARGETS = {
    "llama": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3_moe": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


RANK = 6  # rows of lora_A: 6 over 4 ranks is uneven (2, 2, 1, 1)


def _normalized_config(path: Path) -> dict:
    """adapter_config.json with the fields peft keeps as sets sorted (their JSON order is the set's
    iteration order, which differs between processes)."""
    data = json.loads((path / ADAPTER_CONFIG).read_text())
    return {key: sorted(value) if key in _SET_FIELDS and isinstance(value, list) else value
            for key, value in data.items()}


def _data_section(file: Path) -> bytes:
    raw = file.read_bytes()
    return raw[8 + struct.unpack("<Q", raw[:8])[0]:]


def make_adapter(family: str, root: Path, *, seed: int = 1, name: str | None = None, lora: dict | None = None,
                 **config_overrides) -> tuple[Path, Path]:
    """A tiny float32 base checkpoint of ``family`` and a LoRA adapter of it with random values
    (``init_lora_weights=False``: lora_B is not zero), both written by their libraries'
    ``save_pretrained``. ``lora``: more ``LoraConfig`` fields (``modules_to_save``: the copies are
    scaled by 1.5, so that they differ from the base modules they copy)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import ModulesToSaveWrapper

    name = name or family
    base = make_checkpoint(family, root / f"{name}-base", dtype=torch.float32, **config_overrides)
    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=12, init_lora_weights=False, base_model_name_or_path=str(base),
                        **TARGETS[family], **(lora or {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(build_model(family, dtype=torch.float32, **config_overrides), config)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, ModulesToSaveWrapper):
                    for param in module.modules_to_save.parameters():
                        param.mul_(1.5)
        model.save_pretrained(root / f"{name}-adapter")
    return base, root / f"{name}-adapter"


def peft_reference(family: str, base: Path, adapter: Path, out: Path):
    """peft's own, in one process: ``PeftModel.from_pretrained`` of the base and the adapter, and its
    ``save_pretrained`` into ``out``."""
    model = peft_load(family, base, adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    return model


def peft_load(family: str, base: Path, adapter: Path, *, is_trainable: bool = False):
    """``PeftModel.from_pretrained`` of the base and the adapter, as peft users load one."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(model_class(family).from_pretrained(base, dtype=torch.float32), adapter,
                                         is_trainable=is_trainable)


def assert_same_adapter(ours: Path, reference: Path) -> None:
    """The two files peft's save_pretrained writes for an adapter: the same safetensors keys,
    dtypes, shapes and bits (the tensor data byte for byte; our header adds the save id), and the
    same adapter_config.json."""
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= {p.name for p in reference.iterdir()}
    assert sorted(p.name for p in ours.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    expected, actual = load_file(reference / ADAPTER_WEIGHTS), load_file(ours / ADAPTER_WEIGHTS)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
    assert _data_section(ours / ADAPTER_WEIGHTS) == _data_section(reference / ADAPTER_WEIGHTS)
    assert _normalized_config(ours) == _normalized_config(reference)


def adapter_values(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors of ``model`` under their model keys, whole (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    return {key: (state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]).detach().clone()
            for key in adapter_keys(model).values()}

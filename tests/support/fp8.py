"""FP8 saves checked against transformers' own FP8 model and checkpoint."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from safetensors.torch import load_file

from hp_dcp_hf.quant.grid import whole_blocks
from tests.support.families import (
    family_model_class,
    save_family_model,
    tiny_family_config,
)
from tests.support.quantized import is_projection

FP8 = torch.float8_e4m3fn


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that FP8 (no ``==`` on CPU) and NaN compare."""
    return tensor.contiguous().view(torch.uint8)


@contextlib.contextmanager
def quantizing_on_cpu():
    """transformers' FP8 quantizer refuses to quantize on the fly without a GPU (its
    ``validate_environment``); what it runs to quantize and save is plain torch, so here it may."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kwargs: None):
        yield


BLOCK16 = {"quant_method": "fp8", "weight_block_size": [16, 16]}


#: llama sizes with projections that are and are not whole blocks: of 128 x 128, q/k/v/o are and the
#: MLP's 352 is not; of 32 x 64, gate/up [352, 256] are and down [256, 352] is not
MIXED = {"hidden_size": 256, "intermediate_size": 352, "head_dim": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_is_transformers_own(saved: Path, theirs: Path) -> tuple[set[str], set[str]]:
    """Every tensor of transformers' own FP8 checkpoint at ``theirs`` is one of ``saved`` bit for bit,
    the same weights FP8 and the same kept in the model's dtype, but for the scale it writes beside
    each kept weight (its ``FP8Linear``'s, never initialized), which ``saved`` does not hold; the
    FP8 keys and the kept projections, both there."""
    ours, stored = tensors(saved), tensors(theirs)
    fp8 = {k for k, v in ours.items() if v.dtype == FP8}
    kept = {k for k, v in ours.items() if is_projection(k, v) and v.dtype != FP8}
    assert fp8 and kept and {k for k, v in stored.items() if v.dtype == FP8} == fp8
    assert set(stored) - set(ours) == {k.removesuffix("weight") + "weight_scale_inv" for k in kept}
    assert not [k for k, v in ours.items() if v.dtype != stored[k].dtype or not torch.equal(bits(v), bits(stored[k]))]
    return fp8, kept


def transformers_fp8_model(model, quantization_config, directory: Path):
    """transformers' FP8 model of ``model``'s weights: ``from_pretrained(quantization_config=)`` of
    its ``save_pretrained`` checkpoint (written to ``directory``)."""
    source = save_family_model(model, directory)
    with quantizing_on_cpu():
        return type(model).from_pretrained(source, quantization_config=copy.deepcopy(quantization_config),
                                           dtype=model.dtype)


def llama(dtype: torch.dtype = torch.bfloat16, **sizes):
    config = tiny_family_config("llama", **sizes)
    torch.manual_seed(0)
    model = family_model_class("llama")._from_config(config, dtype=dtype)
    from tests.support.models import _randomize_

    _randomize_(model, 0)
    return model.eval()


def fp8quantize(tensor: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Fp8Quantize`` of ``tensor`` zero-padded to whole blocks, the weight cropped back."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    rows, cols = (-(-n // b) * b for n, b in zip(tensor.shape[-2:], block))
    padded = torch.zeros(*tensor.shape[:-2], rows, cols, dtype=tensor.dtype)
    padded[..., : tensor.shape[-2], : tensor.shape[-1]] = tensor
    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
    out = op.convert({"w.weight": padded})
    return out["w.weight"][..., : tensor.shape[-2], : tensor.shape[-1]].contiguous(), out["w.weight_scale_inv"]


def assert_fp8_of(saved: Path, reference: Path, block: tuple[int, int], ceil_grids: bool) -> set[str]:
    """``saved`` is the checkpoint at ``reference`` (save_pretrained's, unquantized) with every
    projection weight that is whole blocks (every one, ``ceil_grids``) replaced by ``Fp8Quantize``'s
    FP8 tensor and scales; the quantized keys."""
    ours, theirs = tensors(saved), tensors(reference)
    quantized = {k for k, v in ours.items() if v.dtype == FP8}
    assert quantized == {k for k, v in theirs.items() if is_projection(k, v) and (ceil_grids or whole_blocks(v.shape, block))}
    expected = {}
    for key, value in theirs.items():
        if key in quantized:
            expected[key], expected[key.removesuffix("weight") + "weight_scale_inv"] = fp8quantize(value, block)
        else:
            expected[key] = value
    assert sorted(ours) == sorted(expected)
    assert not [k for k, v in expected.items() if ours[k].dtype != v.dtype or not torch.equal(bits(ours[k]), bits(v))]
    return quantized

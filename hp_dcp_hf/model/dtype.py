"""The model's dtype, as transformers 5's ``from_pretrained`` chooses it.

``dtype="auto"`` is transformers 5's default: a bf16 checkpoint makes a bf16 model. "auto" takes
the config's ``dtype`` (``torch_dtype`` in older ``config.json`` files); without one, the first
floating-point tensor of the checkpoint whose dtype a model can be built in (not a float8 /
float4 one, as transformers skips them). Names are the ones transformers accepts (any
``torch.<name>`` dtype, ``"float32"``, ``"bfloat16"``) plus the short ``fp32`` / ``bf16`` /
``fp16`` the CLI has always taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hp_dcp_hf.errors import ArgumentError

AUTO = "auto"
"""Take the dtype from the config or the checkpoint (transformers 5's default)."""

_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

DtypeSpec = torch.dtype | str
"""A ``torch.dtype``, its name (``"bfloat16"``, ``"bf16"``) or ``"auto"``."""


def parse_dtype(spec: DtypeSpec) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(spec, torch.dtype):
        return spec
    name = str(spec).removeprefix("torch.")
    dtype = getattr(torch, _ALIASES.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ArgumentError(f"unknown dtype {spec!r}: pass 'auto', a torch.dtype or its name (bfloat16, float32, ...)")
    return dtype


def buildable(dtype: torch.dtype) -> bool:
    """Whether a model can be built in ``dtype``: floating point, and wider than a byte."""
    return dtype.is_floating_point and dtype.itemsize > 1


def resolve_dtype(spec: DtypeSpec, config: Any, checkpoint_dtypes: Callable[[], Iterable[torch.dtype]]) -> torch.dtype:
    """The dtype to build the model in. ``checkpoint_dtypes`` (the checkpoint's tensors' dtypes, in
    file order) is called only when "auto" finds no dtype in the config."""
    if spec != AUTO:
        return parse_dtype(spec)
    configured = getattr(config, "dtype", None)
    if configured is not None:
        return parse_dtype(configured)
    return next((d for d in checkpoint_dtypes() if buildable(d)), torch.get_default_dtype())


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``save_pretrained`` names a model by: its first floating-point parameter's
    (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)

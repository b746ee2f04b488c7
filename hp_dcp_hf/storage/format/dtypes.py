"""safetensors dtype names and their torch equivalents.

torch's own ``_get_dtype`` maps every name it does not know (F8, BOOL, unsigned ints) to the default
dtype, which loads garbage without a word. Here every name safetensors defines is listed with its
width in bits; a name that is unknown, or that torch 2.13 cannot represent, raises
:class:`UnsupportedDtypeError` naming the file and key instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hp_dcp_hf.errors import UnsupportedDtypeError


@dataclass(frozen=True)
class SafetensorsDtype:
    """One safetensors dtype: its name, its width in bits and the torch dtype that holds it."""

    name: str
    bits: int
    torch_dtype: torch.dtype

    @property
    def pack(self) -> int:
        """How many checkpoint elements one torch element holds (2 for F4 in ``float4_e2m1fn_x2``)."""
        return self.torch_dtype.itemsize * 8 // self.bits

    def nbytes(self, shape: Sequence[int]) -> int | None:
        """Bytes of a tensor of ``shape`` (checkpoint elements); None when not a whole number of bytes."""
        bits = math.prod(shape) * self.bits
        return bits // 8 if bits % 8 == 0 else None

    def torch_shape(self, shape: Sequence[int]) -> tuple[int, ...] | None:
        """The shape of the torch tensor holding ``shape``, or None when the last dim does not pack."""
        if self.pack == 1:
            return tuple(shape)
        if not shape or shape[-1] % self.pack:
            return None
        return (*shape[:-1], shape[-1] // self.pack)


# Every dtype of the safetensors format (Rust ``Dtype`` enum and the Python package's names), its
# width in bits, and the torch attribute holding it (None where torch has no such dtype).
_FORMAT: tuple[tuple[str, int, str | None], ...] = (
    ("BOOL", 8, "bool"),
    ("F4", 4, "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, "uint8"),
    ("I8", 8, "int8"),
    ("F8_E5M2", 8, "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    ("F8_E8M0", 8, "float8_e8m0fnu"),
    ("I16", 16, "int16"),
    ("U16", 16, "uint16"),
    ("F16", 16, "float16"),
    ("BF16", 16, "bfloat16"),
    ("I32", 32, "int32"),
    ("U32", 32, "uint32"),
    ("F32", 32, "float32"),
    ("C64", 64, "complex64"),
    ("F64", 64, "float64"),
    ("I64", 64, "int64"),
    ("U64", 64, "uint64"),
)

SAFETENSORS_DTYPES: dict[str, SafetensorsDtype] = {
    name: SafetensorsDtype(name, bits, getattr(torch, attr))
    for name, bits, attr in _FORMAT
    if attr is not None and hasattr(torch, attr)
}
"""The dtypes this torch can load, by safetensors name."""

_FORMAT_NAMES = frozenset(name for name, _, _ in _FORMAT)


def lookup_dtype(name: object, *, file: str | None = None, key: str | None = None) -> SafetensorsDtype:
    """The dtype called ``name``; raises :class:`UnsupportedDtypeError` rather than guessing."""
    if isinstance(name, str) and name in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[name]
    if isinstance(name, str) and name in _FORMAT_NAMES:
        reason = f"safetensors dtype {name!r} has no torch {torch.__version__} equivalent"
    else:
        reason = f"unknown safetensors dtype {name!r}"
    raise UnsupportedDtypeError(reason, file=file, key=key)

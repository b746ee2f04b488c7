"""Benchmark checkpoints: real transformers architectures, random bf16 weights, written once.

Two workloads, each sized by one number (bytes of bf16 weights):

* ``dense``: ``LlamaForCausalLM`` (GQA, untied embeddings), TinyLlama widths at full size;
* ``moe``: ``Qwen3MoeForCausalLM`` (per-expert checkpoint keys, stacked experts in the model).

The number of layers is chosen to hit the size; widths come from one of two families (small below
500 MB, so a smoke checkpoint of ~50 MB still has several layers and experts).

**Why not ``save_pretrained``.** It needs the whole model in memory, and for the MoE model its
conversion revert (stacked experts -> per-expert tensors) holds a second copy. Instead the
*layout* (every checkpoint key with its shape and dtype, in the original format) is taken from
transformers itself, on the meta device: ``revert_weight_conversion`` of the meta state dict,
minus tied weights, split into files by ``huggingface_hub.split_torch_state_dict_into_shards``;
these are exactly the steps ``save_pretrained`` runs. Then each file is streamed to disk one tensor
at a time (header first, then data generated per key from a seed), so peak memory is one tensor.
:func:`verify_layout` checks the result against a real ``save_pretrained`` of the same
architecture shrunk to tiny widths (same layers and experts, so the same keys).

A finished checkpoint directory holds ``bench_workload.json`` (written last); a directory whose
stamp matches the requested workload is reused as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

GENERATOR_VERSION = 1
STAMP = "bench_workload.json"
KINDS = ("dense", "moe")
SIZES = {"smoke": 50 * 10**6, "full": 2 * 10**9}
_SMALL_BELOW = 500 * 10**6
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def parse_size(text: str | int) -> int:
    """``"smoke"`` / ``"full"`` / ``"200MB"`` / ``"2GB"`` / ``12345`` -> bytes (decimal units)."""
    if isinstance(text, int):
        return text
    if text in SIZES:
        return SIZES[text]
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not match:
        raise ValueError(f"size {text!r}: expected smoke, full, or a number with an optional KB/MB/GB unit")
    return int(float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()])


def size_tag(size: int) -> str:
    """A short stable name for a size: ``50MB``, ``2GB``."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale and size % (scale // 10 or 1) == 0:
            return f"{size / scale:g}{unit}"
    return f"{size}B"


@dataclass(frozen=True)
class Workload:
    """One generated checkpoint: which architecture, how big, and where."""

    kind: str
    size: int
    path: Path
    model_class: str
    num_layers: int
    checkpoint_bytes: int
    files: int
    tensors: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


# -- configs -------------------------------------------------------------------------------------


def _dense_widths(small: bool) -> dict[str, Any]:
    if small:
        return dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                    num_key_value_heads=4)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                num_key_value_heads=4)


def _moe_widths(small: bool) -> dict[str, Any]:
    if small:
        return dict(vocab_size=8192, hidden_size=256, intermediate_size=704, moe_intermediate_size=128,
                    num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=32)
    return dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                num_experts=32, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4,
                head_dim=64)


def make_config(kind: str, size: int, *, num_layers: int | None = None):
    """The transformers config of workload ``kind`` with about ``size`` bytes of bf16 weights."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    small = size < _SMALL_BELOW
    if kind == "dense":
        cls, widths, name = LlamaConfig, _dense_widths(small), "LlamaForCausalLM"
    elif kind == "moe":
        cls, widths, name = Qwen3MoeConfig, _moe_widths(small), "Qwen3MoeForCausalLM"
    else:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(KINDS)}")
    common = dict(tie_word_embeddings=False, max_position_embeddings=4096, architectures=[name])
    if num_layers is None:
        one = param_count(cls(**widths, **common, num_hidden_layers=1))
        two = param_count(cls(**widths, **common, num_hidden_layers=2))
        per_layer, fixed = two - one, 2 * one - two
        num_layers = max(2, round((size / 2 - fixed) / per_layer))
    config = cls(**widths, **common, num_hidden_layers=num_layers)
    config.dtype = torch.bfloat16
    return config


def model_class(config):
    import transformers

    return getattr(transformers, config.architectures[0])


def meta_model(config, dtype: torch.dtype = torch.bfloat16):
    """The model of ``config`` on the meta device (no memory), weights tied as configured."""
    with torch.device("meta"):
        model = model_class(config)._from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def param_count(config) -> int:
    return sum(t.numel() for t in checkpoint_layout(config).values())


def checkpoint_layout(config) -> dict[str, torch.Tensor]:
    """Every key ``save_pretrained`` writes for ``config``, as meta tensors (shape, dtype), in order.

    The same steps as ``PreTrainedModel.save_pretrained``: the state dict, tied weights removed,
    the checkpoint conversion reverted (original key format), all on the meta device.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = meta_model(config)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return dict(revert_weight_conversion(model, state))


def split_files(layout: Mapping[str, torch.Tensor], max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> keys, as ``save_pretrained(max_shard_size=...)`` splits them."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    # huggingface_hub's torch splitter counts views of one storage once and keeps them together (the
    # per-expert tensors of a reverted stacked tensor are such views). On the meta device every tensor
    # reports the same null storage, so the storage is named here by the view's base tensor instead.
    def base(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    split = split_state_dict_into_shards_factory(
        dict(layout), get_storage_size=lambda t: base(t).numel() * t.dtype.itemsize,
        get_storage_id=lambda t: id(base(t)), filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_bytes,
    )
    return {name: list(keys) for name, keys in split.filename_to_tensors.items()}


# -- writing -------------------------------------------------------------------------------------


def tensor_values(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic random values of one checkpoint tensor (a function of key and seed only).

    Matrices ~ N(0, 0.02); vectors (norms) ~ 1 + N(0, 0.1): finite, distinct everywhere, so a
    misplaced slice cannot hide behind a constant.
    """
    generator = torch.Generator().manual_seed((zlib.crc32(key.encode()) ^ seed) & 0x7FFF_FFFF)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    values = values.mul_(0.1).add_(1.0) if len(shape) == 1 else values.mul_(0.02)
    return values.to(dtype)


def _file_order(layout: Mapping[str, torch.Tensor], keys: list[str]) -> list[str]:
    """Tensor order inside a file as ``safetensors.torch.save_file`` writes it (by dtype size, name)."""
    return sorted(keys, key=lambda k: (-layout[k].dtype.itemsize, k))


def write_file(path: Path, layout: Mapping[str, torch.Tensor], keys: list[str], seed: int) -> int:
    """Stream one safetensors file: header from the layout, then each tensor's bytes as generated."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    order = _file_order(layout, keys)
    for key in order:
        meta = layout[key]
        nbytes = meta.numel() * meta.dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[meta.dtype], "shape": list(meta.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key in order:
            meta = layout[key]
            values = tensor_values(key, tuple(meta.shape), meta.dtype, seed)
            f.write(values.reshape(-1).view(torch.uint8).numpy())
            del values
    return 8 + len(raw) + offset


def write_checkpoint(config, directory: Path, *, max_shard_bytes: int, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write config.json, every shard and the index of ``config``'s checkpoint into ``directory``,
    its tensors in ``dtype`` (a vLLM CPU engine runs float32 only, on this machine)."""
    directory.mkdir(parents=True, exist_ok=True)
    layout = checkpoint_layout(config)
    if dtype != torch.bfloat16:
        layout = {key: meta.to(dtype) for key, meta in layout.items()}
        config.dtype = dtype
    files = split_files(layout, max_shard_bytes)
    for name, keys in files.items():
        write_file(directory / name, layout, keys, seed)
    total = sum(t.numel() * t.dtype.itemsize for t in layout.values())
    if len(files) > 1:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in layout.values()), "total_size": total},
                 "weight_map": {key: name for name, keys in files.items() for key in keys}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(directory)
    return {"checkpoint_bytes": total, "files": len(files), "tensors": len(layout)}


# -- verification --------------------------------------------------------------------------------


def shrunk_config(config):
    """``config`` with tiny widths but the same layers, heads and experts: the same checkpoint keys."""
    data = config.to_dict()
    heads = data["num_attention_heads"]
    data.update(hidden_size=2 * heads, intermediate_size=8, vocab_size=64, head_dim=2)
    if "moe_intermediate_size" in data:
        data["moe_intermediate_size"] = 4
    return type(config).from_dict(data)


def saved_layout(directory: Path) -> dict[str, tuple[Any, ...]]:
    """key -> (file, dtype name, shape, data offsets) of every tensor in the safetensors files of
    ``directory``, plus ``__metadata__`` per file: everything but the values."""
    out: dict[str, tuple[Any, ...]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out[f"{file.name}:__metadata__"] = (header.pop("__metadata__", None),)
        out.update({k: (file.name, v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in header.items()})
    return out


def verify_layout(config) -> None:
    """Raise unless our writer produces exactly what ``save_pretrained`` writes for ``config``'s
    architecture: same keys (checked at the real layer/expert counts); same files, shapes, dtypes
    and byte offsets (checked on the shrunk widths, where ``save_pretrained`` is cheap)."""
    tiny = shrunk_config(config)
    torch.manual_seed(0)
    model = model_class(tiny)._from_config(tiny, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        real_dir, ours_dir = Path(tmp, "real"), Path(tmp, "ours")
        model.save_pretrained(real_dir, max_shard_size="50KB")
        write_checkpoint(tiny, ours_dir, max_shard_bytes=50_000)
        real, ours = saved_layout(real_dir), saved_layout(ours_dir)
    if real != ours:
        only_real, only_ours = sorted(set(real) - set(ours)), sorted(set(ours) - set(real))
        shapes = sorted(k for k in set(real) & set(ours) if real[k] != ours[k])
        raise AssertionError(f"generated layout differs from save_pretrained: only in save_pretrained "
                             f"{only_real[:5]}, only ours {only_ours[:5]}, different {shapes[:5]}")
    full_keys = set(checkpoint_layout(config))
    if full_keys != {k for k in real if not k.endswith(":__metadata__")}:
        raise AssertionError(f"{type(config).__name__}: full-size keys differ from the shrunk save_pretrained keys: "
                             f"{sorted(full_keys ^ set(real))[:5]}")


# -- cache ---------------------------------------------------------------------------------------


def ensure_workload(kind: str, size: int, cache_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    log=print) -> Workload:
    """The checkpoint of ``kind`` x ``size`` under ``cache_dir``, generated (and verified) if missing.

    ``size`` counts bytes of ``dtype`` weights; another seed or dtype than the default is a
    directory of its own (the weight sync benchmark's engine starts on one, its trainers load another).
    """
    config = make_config(kind, size * torch.bfloat16.itemsize // dtype.itemsize)
    variant = ("" if dtype == torch.bfloat16 else f"-{_ST_DTYPES[dtype].lower()}") + (f"-seed{seed}" if seed else "")
    path = Path(cache_dir) / f"{kind}-{size_tag(size)}{variant}"
    wanted = {"version": GENERATOR_VERSION, "kind": kind, "size": size, "seed": seed, "dtype": str(dtype),
              "config": config.to_diff_dict() if hasattr(config, "to_diff_dict") else config.to_dict()}
    stamp = path / STAMP
    if stamp.exists():
        found = json.loads(stamp.read_text())
        if {k: found.get(k, str(torch.bfloat16)) if k == "dtype" else found.get(k) for k in _STAMPED} == {
                k: wanted[k] for k in _STAMPED}:
            return Workload(**found["workload"], path=path)
    log(f"generating {kind} checkpoint of ~{size_tag(size)} in {path} (verifying the layout first)")
    verify_layout(config)
    if path.exists():
        shutil.rmtree(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    written = write_checkpoint(config, tmp, max_shard_bytes=max(4 * 10**6, size // 4), seed=seed, dtype=dtype)
    info = {"kind": kind, "size": size, "model_class": config.architectures[0],
            "num_layers": config.num_hidden_layers, **written}
    (tmp / STAMP).write_text(json.dumps({**wanted, "workload": info}, indent=2, default=str))
    os.replace(tmp, path)
    return Workload(**info, path=path)


_STAMPED = ("version", "kind", "size", "seed", "dtype")


def warm_page_cache(path: Path, block: int = 16 * 2**20) -> int:
    """Read every file of the checkpoint once so that every contender starts from a warm page cache."""
    total = 0
    buffer = bytearray(block)
    for file in sorted(Path(path).iterdir()):
        if file.is_file():
            with open(file, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    total += n
    return total


def human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


__all__ = ["KINDS", "SIZES", "Workload", "checkpoint_layout", "ensure_workload", "human", "make_config",
           "parse_size", "verify_layout", "warm_page_cache"]

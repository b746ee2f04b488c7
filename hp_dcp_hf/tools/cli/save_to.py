"""``load --save-to DIR``: the loaded model saved as a Hugging Face checkpoint, in the dtype, file
layout and store options its arguments choose, one parallel write pass."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from hp_dcp_hf.tools.cli.arguments import DTYPE_CHOICES
from hp_dcp_hf.tools.cli.storage_options import StorageOptions

SAVE_QUANTIZE_CHOICES = ("fp8",)
"""``--save-quantize`` values: :data:`hp_dcp_hf.quant.encode.FORMATS`, not imported so that ``--help`` imports no torch."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``load``'s ``--save-to`` and the options of the save."""
    parser.add_argument("--save-to", default=None, metavar="DIR",
                        help="then save the loaded model to DIR as a Hugging Face checkpoint (one parallel write "
                             "pass, published atomically)")
    parser.add_argument("--max-shard-size", default=None,
                        help="with --save-to: the file size limit (default: the source's layout, its largest file's "
                             "tensor bytes: the same files with the same tensors; one file stays one)")
    parser.add_argument("--save-dtype", default="checkpoint", choices=("checkpoint", "model", *DTYPE_CHOICES[1:]),
                        help="with --save-to: checkpoint writes the checkpoint's floating-point dtype (a bf16 "
                             "checkpoint saves back byte for byte), model the model's (--dtype)")
    parser.add_argument("--save-quantize", default=None, choices=SAVE_QUANTIZE_CHOICES,
                        help="with --save-to: write a block-scaled FP8 checkpoint (quant_method fp8, 128x128 blocks) "
                             "of the modules transformers' FP8 quantizer converts, quantized in the same pass")
    parser.add_argument("--save-storage-option", action=StorageOptions, dest="save_storage_options", default=None,
                        metavar="KEY=VALUE", help="with --save-to: an option of DIR's store, as --storage-option, "
                                                  "repeatable (default: those of --storage-option)")


@dataclass(frozen=True)
class Saved:
    """What this rank's save wrote, and how long it took."""

    bytes_written: int
    seconds: float


def save(args: argparse.Namespace, model: Any, reader: Any, rank: int) -> Saved:
    """Save ``model`` to ``args.save_to``; ``reader`` (the load's) tells the checkpoint's dtypes and files."""
    from hp_dcp_hf.save.api import save_hf_checkpoint
    from hp_dcp_hf.storage import HFStorageWriter
    from hp_dcp_hf.storage.format.files import source_shard_size
    from hp_dcp_hf.tools.progress import SaveProgress

    dtype = save_dtype(args.save_dtype, reader.entries.values(), quantized=args.save_quantize is not None)
    max_shard_size = args.max_shard_size or source_shard_size(reader.entries.values(), dtype)
    writer = HFStorageWriter(args.save_to, max_shard_size=max_shard_size, dtype=dtype,
                             progress=SaveProgress() if rank == 0 else None, **save_options(args))
    start = time.perf_counter()
    save_hf_checkpoint(model, args.save_to, writer=writer, quantize=args.save_quantize)
    return Saved(writer.bytes_written, time.perf_counter() - start)


def save_options(args: argparse.Namespace) -> dict[str, Any]:
    """The storage options of ``--save-to``: ``--save-storage-option``'s, else ``--storage-option``'s."""
    return args.storage_options if args.save_storage_options is None else args.save_storage_options


def save_dtype(choice: str, entries: Any, quantized: bool = False) -> Any:
    """The dtype ``--save-to`` writes: ``checkpoint`` is the one floating-point dtype of the
    checkpoint's unquantized tensors (a bf16 checkpoint saves back as bf16 whatever ``--dtype``
    loaded it as; a mixed or quantized one keeps the model's dtypes), ``model`` the model's. A save
    that quantizes again (``quantized``) looks past an FP8 checkpoint's own weights and scales, so
    one loaded into float32 is quantized from the bf16 values it was loaded from."""
    from hp_dcp_hf.model.dtype import parse_dtype

    if choice == "model":
        return None
    if choice != "checkpoint":
        return parse_dtype(choice)
    if quantized:
        entries = [e for e in entries if e.dtype.itemsize > 1 and not e.key.endswith("_scale_inv")]
    dtypes = {e.dtype for e in entries}
    floating = [d for d in dtypes if d.is_floating_point]
    return floating[0] if len(floating) == 1 and floating[0].itemsize > 1 else None

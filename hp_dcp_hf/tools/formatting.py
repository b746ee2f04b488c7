"""The numbers and tables the ``hp-dcp-hf`` commands and the demo print (no torch: ``--help`` and
``inspect`` stay light)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned, a rule under the header."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_quantization(quantization_config: Mapping[str, Any] | None) -> str | None:
    """``"fp8, blocks 128x128"`` or ``"compressed-tensors: float-quantized, pack-quantized"``: the
    checkpoint's quantization in a few words (None when plain)."""
    if not quantization_config:
        return None
    block = quantization_config.get("weight_block_size")
    blocks = f", blocks {'x'.join(map(str, block))}" if isinstance(block, (list, tuple)) else ""
    groups = quantization_config.get("config_groups")
    formats = sorted({str(g.get("format") or quantization_config.get("format")) for g in groups.values()
                      if isinstance(g, Mapping)}) if isinstance(groups, Mapping) else []
    return f"{quantization_config.get('quant_method')}{blocks}" + (f": {', '.join(formats)}" if formats else "")


RUNS_NOTE = ("(runs: contiguous byte runs copied out of the files' memory mappings, one per row of a "
             "row-sharded box, large ones read with preadv: not requests to storage; --no-map reads by requests)")


def requests_column(mapped: bool) -> str:
    """The name of the requests figure: mapped reads make no requests, they copy runs (:data:`RUNS_NOTE`)."""
    return "runs" if mapped else "requests"

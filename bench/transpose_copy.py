"""Transposing copies of MoE expert boxes: plain ``copy_`` against ``hp_dcp_hf.storage.read.copy.copy_into``.

``python -m bench.transpose_copy [--reps 7] [--slabs 64K,256K,1M] [--name NAME]``

The grouped-GEMM rewrite stores ``w13 [E, H, 2I]`` and ``w2 [E, I, H]``, so every per-expert box of
the checkpoint (``gate_proj``/``up_proj [I, H]``, ``down_proj [H, I]``, bf16) lands in a transposed
view: ``w13[e, :, :I].t()``, ``w13[e, :, I:].t()``, ``w2[e].t()``. Each case copies the experts of
one layer (widths of the 2 GB MoE workload: H 1024, I 512, 32 experts, 96 MiB) from a source in
memory and from fresh mappings of a file (what the reader does: one mapping per box, page faults
included), with ``torch.set_num_threads(1)`` (the reader copies on its own threads). Contenders run
interleaved, every repetition in turn, and are checked bit for bit against ``copy_``. The floor:
the same bytes copied into a destination in the source's order. Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hp_dcp_hf.storage.read import copy as tiled

HIDDEN, INTERMEDIATE, EXPERTS = 1024, 512, 32


def _parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _sources(path: str, dtype: torch.dtype, mapped: bool) -> Callable[[int, int], torch.Tensor]:
    """``source(expert, k)``: gate (0), up (1) or down (2) of an expert, from memory or a fresh mapping."""
    box = HIDDEN * INTERMEDIATE * dtype.itemsize
    shapes = [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
    memory = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=dtype)
    fd = os.open(path, os.O_RDONLY)

    def source(expert: int, k: int) -> torch.Tensor:
        offset = (expert * 3 + k) * box
        if mapped:
            view = mmap.mmap(fd, box, access=mmap.ACCESS_COPY, offset=offset)
            return torch.frombuffer(view, dtype=dtype).view(shapes[k])
        return memory[offset // dtype.itemsize : (offset + box) // dtype.itemsize].view(shapes[k])

    return source


def run(reps: int, slabs: list[int], cast: bool) -> list[dict]:
    """One table row per (source, contender): median seconds and MiB/s over ``reps`` interleaved runs."""
    torch.set_num_threads(1)
    dtype, dest_dtype = torch.bfloat16, torch.float32 if cast else torch.bfloat16
    w13 = torch.zeros(EXPERTS, HIDDEN, 2 * INTERMEDIATE, dtype=dest_dtype)
    w2 = torch.zeros(EXPERTS, INTERMEDIATE, HIDDEN, dtype=dest_dtype)
    floor = torch.zeros(EXPERTS * 3 * HIDDEN * INTERMEDIATE, dtype=dest_dtype)
    mib = EXPERTS * 3 * HIDDEN * INTERMEDIATE * dtype.itemsize / 2**20

    def dests(expert: int) -> list[torch.Tensor]:
        return [w13[expert, :, :INTERMEDIATE].t(), w13[expert, :, INTERMEDIATE:].t(), w2[expert].t()]

    def with_slab(size: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def copy(dest: torch.Tensor, source: torch.Tensor) -> None:
            tiled._SLAB_BYTES = size
            tiled.copy_into(dest, source)
        return copy

    contenders: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "copy_": lambda dest, source: dest.copy_(source),
        **{f"copy_into (slab {size >> 10} KiB)": with_slab(size) for size in slabs},
    }
    default_slab = tiled._SLAB_BYTES
    rows = []
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(torch.randn(EXPERTS * 3 * HIDDEN * INTERMEDIATE).to(dtype).view(torch.uint8).numpy().tobytes())
        f.flush()
        for mapped in (False, True):
            source = _sources(f.name, dtype, mapped)
            times: dict[str, list[float]] = {"floor (source order)": [], **{name: [] for name in contenders}}
            reference = None
            for _ in range(reps):
                start = time.perf_counter()
                for e in range(EXPERTS):
                    for k in range(3):
                        at = (e * 3 + k) * HIDDEN * INTERMEDIATE
                        src = source(e, k)
                        floor[at : at + src.numel()].view(src.shape).copy_(src)
                times["floor (source order)"].append(time.perf_counter() - start)
                for name, copy in contenders.items():
                    w13.zero_(), w2.zero_()
                    start = time.perf_counter()
                    for e in range(EXPERTS):
                        for k, dest in enumerate(dests(e)):
                            copy(dest, source(e, k))
                    times[name].append(time.perf_counter() - start)
                    if reference is None:
                        reference = (w13.clone(), w2.clone())
                    elif not (torch.equal(reference[0], w13) and torch.equal(reference[1], w2)):
                        raise AssertionError(f"{name} differs from copy_")
            tiled._SLAB_BYTES = default_slab
            base = statistics.median(times["copy_"])
            for name, ts in times.items():
                median = statistics.median(ts)
                rows.append({"source": "mapped" if mapped else "memory", "contender": name, "median_s": median,
                             "mib_s": mib / median, "speedup_vs_copy_": base / median, "runs": ts})
    return rows


def markdown(rows: list[dict], cast: bool) -> str:
    dest = "float32 (cast)" if cast else "bfloat16"
    lines = [f"experts of one layer, bf16 boxes -> transposed {dest} views, "
             f"{EXPERTS * 3} boxes of {HIDDEN}x{INTERMEDIATE}, 1 thread", "",
             "| source | contender | median | MiB/s | vs copy_ |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['source']} | {r['contender']} | {r['median_s'] * 1e3:.1f} ms | {r['mib_s']:.0f} | "
              f"{r['speedup_vs_copy_']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transpose_copy", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--slabs", default="64K,256K,1M", help="slab sizes of copy_into to compare")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default=None, help="write <out>/<name>.md and .json")
    args = p.parse_args(argv)
    slabs = [_parse_bytes(s) for s in args.slabs.split(",")]
    load_start = os.getloadavg()
    doc = {}
    text = []
    for cast in (False, True):
        rows = run(args.reps, slabs, cast)
        doc["cast" if cast else "same_dtype"] = rows
        text.append(markdown(rows, cast))
        print(text[-1] + "\n", flush=True)
    doc["load_average"] = [load_start, os.getloadavg()]
    if args.name:
        stem = Path(args.out) / args.name
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
        stem.with_suffix(".md").write_text("# transposing copies of MoE expert boxes\n\n" + "\n\n".join(text)
                                           + f"\n\nload average {load_start} at the start, {os.getloadavg()} at the end\n")
        print(f"wrote {stem}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

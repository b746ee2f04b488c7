"""The metadata phase at cluster scale: DeepSeek-V3's catalog (45,395 tensors in 175 files, the
simulation's layout) encoded on rank 0 and decoded on every rank, with the cyclic collector
running and paused, side by side in one process that holds the meta model (as a loading process
holds its model); and ``metadata``: what every rank but the scanning one does with the broadcast
payload, decoding it and building DCP's ``Metadata`` (collection paused, as ``read_metadata`` runs).

``python -m bench.catalog [--reps 3]``: prints the payload size and the seconds of each.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence

from hp_dcp_hf.storage.format.catalog import Catalog, CheckpointTensor
from hp_dcp_hf.storage.read.reader import dcp_metadata
from hp_dcp_hf.util.perf import paused_gc


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    from bench.simulate import build_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="deepseek-v3")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    ckpt = build_checkpoint(args.arch)  # keeps its meta model alive, as a load does
    entries = {k: CheckpointTensor(k, e.dtype_name, e.dtype, e.shape, (e,)) for k, e in ckpt.entries.items()}
    catalog = Catalog(f"s3://bench/{args.arch}", tuple(sorted({e.file for e in ckpt.entries.values()})), entries)
    raw = catalog.to_json()
    print(f"{args.arch}: {len(entries)} tensors, catalog payload {len(raw) / 2**20:.2f} MiB, "
          f"{len(gc.get_objects())} objects tracked by the collector")
    seconds: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for paused in (False, True):
            for step, call in (("encode", catalog.to_json), ("decode", lambda: Catalog.from_json(raw))):
                if paused:
                    with paused_gc():
                        spent = _timed(call)
                else:
                    spent = _timed(call)
                seconds.setdefault(f"{step} ({'paused' if paused else 'collecting'})", []).append(spent)

    def metadata() -> None:
        decoded = Catalog.from_json(raw)
        dcp_metadata(decoded.entries, decoded.quantization_config, checkpoint_id=decoded.root, load_id="bench")

    for _ in range(args.reps):
        with paused_gc():
            seconds.setdefault("metadata (paused)", []).append(_timed(metadata))
    for name, values in seconds.items():
        print(f"  {name}: median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

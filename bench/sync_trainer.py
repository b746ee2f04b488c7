"""The trainer ranks of the weight-sync benchmark (:mod:`bench.sync`): ``torchrun --nproc-per-node 4
-m bench.sync_trainer ...`` in the project's main venv (no vLLM there).

Every rank loads ``--checkpoint`` into a Qwen3-MoE model under expert parallelism (``ep=WORLD``:
experts split over the ranks, every other weight sharded too) and pushes it into the engine at
``--engine`` once per contender and repetition:

* ``hp_dcp_hf``: :class:`~hp_dcp_hf.sync.trainer.TrainerWeightSync`, each rank sends the boxes it holds;
* ``gather``: vLLM's ``ModuleSource`` recipe: every rank materializes every full parameter
  (``DTensor.full_tensor()``), rank 0 converts them to the checkpoint's tensors (transformers'
  ``revert_weight_conversion``) and alone sends them all (over this project's wire: the engine's
  backend is ``hp_dcp_hf``, so only the gather differs);
* ``files`` / ``files-vllm``: ``save_hf_checkpoint`` on every rank, then the engine reloads the
  directory (through this project's reload fixes, or through vLLM's own ``reload_weights``).

Before each run the engine is put back on its initial checkpoint (untimed), after it the engine
records what it computes with (:mod:`bench.sync` compares the runs). Each rank writes its figures
(wall time, bytes, peak RSS growth sampled every few milliseconds) to ``--workdir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.client import HTTPEngineClient
from hp_dcp_hf.sync.source import HeldSlice, HFWeightSource, TensorMeta
from hp_dcp_hf.sync.trainer import TrainerWeightSync


class PeakRSS:
    """This process's peak resident set size since :meth:`start`, sampled in a thread (the kernel's
    high-water mark, VmHWM, cannot be reset between runs)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self._process = psutil.Process()
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self.baseline = self.peak = self._process.memory_info().rss
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = self._process.memory_info().rss
            with self._lock:
                self.peak = max(self.peak, rss)
            time.sleep(self._interval_s)

    def start(self) -> None:
        gc.collect()
        with self._lock:
            self.baseline = self.peak = self._process.memory_info().rss

    def growth(self) -> int:
        with self._lock:
            return max(self.peak, self._process.memory_info().rss) - self.baseline


class GatheredSource:
    """The ``gather`` contender's weights, in :class:`HFWeightSource`'s interface so that the same
    wire carries them: :meth:`snapshot` (collective, at the start of each send) all-gathers every
    parameter on every rank; rank 0 keeps the checkpoint's tensors and holds all of them, the other
    ranks hold nothing."""

    def __init__(self, model: torch.nn.Module, metadata: list[TensorMeta]) -> None:
        self.model = model
        self._metadata = metadata
        self._rank = dist.get_rank()
        self._tensors: dict[str, torch.Tensor] = {}
        self.gathered_bytes = 0  # what this rank received: each tensor's bytes it did not hold
        self.gather_seconds = 0.0

    def snapshot(self) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        start = time.perf_counter()
        full: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            value = param.detach()
            if isinstance(value, DTensor):
                local = value.to_local()
                value = value.full_tensor()
                self.gathered_bytes += (value.numel() - local.numel()) * value.element_size()
            if self._rank == 0:
                full[name] = value
            del value
        if self._rank == 0:
            self._tensors = dict(revert_weight_conversion(self.model, full))
        self.gather_seconds = time.perf_counter() - start

    def metadata(self) -> list[TensorMeta]:
        return list(self._metadata)

    def meta(self, name: str) -> TensorMeta:
        return next(m for m in self._metadata if m.name == name)

    def slices(self) -> list[HeldSlice]:
        return [HeldSlice(m.name, Box.full(m.shape)) for m in self._metadata] if self._rank == 0 else []

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        meta = self._metadata[index]
        values = self._tensors[meta.name]
        return (values if box is None else values[box.slices()]).to(meta.dtype)

    @property
    def held_bytes(self) -> int:
        return sum(s.numel * self._metadata[i].dtype.itemsize for i, s in enumerate(self.slices()))

    def release(self) -> None:
        self._tensors = {}


def _post(engine: str, route: str, body: dict[str, Any] | None = None) -> None:
    """One of the benchmark's own engine routes (reset, reload, snapshot: :class:`bench.sync.BenchServer`)."""
    request = urllib.request.Request(f"{engine}/{route}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=1800) as response:
        response.read()


def _written_bytes() -> int:
    """Bytes this process has passed to write calls so far (``/proc/self/io`` ``wchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def _send(model, source, args, client) -> dict[str, Any]:
    """One update through TrainerWeightSync (set-up untimed, the update timed on every rank)."""
    sync = TrainerWeightSync(source, client, timeout_s=600, bucket_bytes=args.bucket_bytes)
    try:
        dist.barrier()
        start = time.perf_counter()
        stats = sync.send_weights()
        dist.barrier()
        return {"seconds": time.perf_counter() - start, "bytes_sent": stats.bytes_sent,
                "held_bytes": source.held_bytes, "send_seconds": stats.seconds}
    finally:
        sync.shutdown()


def _files(model, args, run: str, how: str) -> dict[str, Any]:
    from hp_dcp_hf.save.api import save_hf_checkpoint

    directory = Path(args.workdir, run)
    dist.barrier()
    start, written = time.perf_counter(), _written_bytes()
    save_hf_checkpoint(model, directory)
    saved = time.perf_counter()
    written = _written_bytes() - written
    if dist.get_rank() == 0:
        _post(args.engine, "reload", {"path": str(directory), "how": how, "run": run})
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "save_seconds": saved - start, "bytes_written": written}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--contenders", default="hp_dcp_hf,gather,files")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.parallel.plans import TransformersPlans

    # No rewrites: transformers' own modules (stacked experts), which the gather contender converts
    # back to the checkpoint's tensors with transformers' own revert_weight_conversion.
    model, _ = from_pretrained(args.checkpoint, dtype=torch.float32, parallelize=TransformersPlans(f"ep={world}", warn=False))
    source = HFWeightSource(model)
    client = HTTPEngineClient(args.engine, timeout_s=1800)
    memory = PeakRSS()
    workdir = Path(args.workdir)
    for rep in range(args.reps):
        for contender in args.contenders.split(","):
            run = f"{contender}-{rep}"
            if rank == 0:
                _post(args.engine, "reset", {"run": run})
            dist.barrier()
            memory.start()
            if contender == "hp_dcp_hf":
                figures = _send(model, source, args, client)
            elif contender == "gather":
                gathered = GatheredSource(model, source.metadata())
                figures = _send(model, gathered, args, client)
                figures.update(gathered_bytes=gathered.gathered_bytes, gather_seconds=gathered.gather_seconds)
                gathered.release()
            elif contender in ("files", "files-vllm"):
                figures = _files(model, args, run, "hp_dcp_hf" if contender == "files" else "vllm")
            else:
                raise SystemExit(f"unknown contender {contender!r}")
            figures.update(rank=rank, contender=contender, rep=rep, rss_growth=memory.growth(),
                           rss_baseline=memory.baseline)
            (workdir / f"{run}-rank{rank}.json").write_text(json.dumps(figures))
            dist.barrier()
            if rank == 0:
                _post(args.engine, "snapshot", {"run": run, "contender": contender})
                shutil.rmtree(workdir / run, ignore_errors=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

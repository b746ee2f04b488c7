"""GPU destinations (issue 15): are loads into CUDA DTensors right, and how close to the host-to-device
copy rate do they get? One short script for a machine with one GPU::

    torchrun --nproc-per-node 1 bench/gpu_check.py --out gpu_check.json

1. Correctness: the tiny llama of the tests (bf16, several shards) loaded by
   :func:`hp_dcp_hf.from_pretrained` into an fp32 model sharded with FSDP2 on a 1-rank CUDA mesh
   (casts on the device), and by ``dcp.load`` into transposed fp32 CUDA tensors (strided
   destinations), out of a mapping and with ranged reads, each compared bit for bit with
   transformers' ``from_pretrained`` on the GPU.
2. Throughput: a ~1.5 GB random bf16 file (warm page cache) loaded into CUDA tensors, bf16 and fp32,
   against a non-blocking copy of the same bytes from pinned memory to the GPU; the GB/s into
   HBM and their ratio, printed and written to ``--out`` as JSON.

Without a GPU it stops with a message (exit 2); ``--device cpu`` runs the same steps on CPU
tensors, a dry run of the script itself (no copy to a device is measured then).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This checkout's hp_dcp_hf and test helpers, whichever copy the environment installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hp_dcp_hf import HFStorageReader, from_pretrained  # noqa: E402
from tests.support.models import make_checkpoint, model_class  # noqa: E402

ROWS, COLS = 8192, 8192  # 128 MiB per bf16 tensor


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor):
        a = a.full_tensor()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _staging(reader: HFStorageReader) -> dict[str, Any]:
    s = reader.staging
    return {"bytes_staged": s.bytes_staged, "device_bytes": s.device_bytes, "peak_bytes": s.peak_bytes,
            "capacity": s.capacity, "wait_s": s.wait_seconds}


def correctness(workdir: Path, device: torch.device, mesh: DeviceMesh) -> dict[str, Any]:
    """Every load of the tiny llama, bit for bit against transformers on ``device``."""
    path = make_checkpoint("llama", workdir / "llama", dtype=torch.bfloat16, max_shard_size="20KB")
    reference = model_class("llama").from_pretrained(path, dtype=torch.float32, device_map=device).state_dict()

    def fsdp(model: torch.nn.Module) -> None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    cases: dict[str, Any] = {}
    for mapped in (True, False):
        reader = HFStorageReader(str(path), map_local_files=mapped)
        model, report = from_pretrained(str(path), dtype=torch.float32, parallelize=fsdp, device=device, reader=reader)
        state = model.state_dict()
        cases[f"fsdp_{'mapped' if mapped else 'preadv'}"] = {
            "mismatched": sorted(k for k, v in state.items() if not _same_bits(v, reference[k])),
            "dtensors": sum(isinstance(v, DTensor) for v in state.values()), "seconds": dict(report.seconds),
            "staging": _staging(reader)}

        # strided destinations: each 2-D tensor into the transpose of an fp32 buffer
        keys = [k for k in reader.entries]
        strided = {k: torch.zeros(reference[k].shape[::-1], device=device).t() if reference[k].ndim == 2
                   else torch.zeros_like(reference[k]) for k in keys}
        reader = HFStorageReader(str(path), map_local_files=mapped)
        dcp.load(strided, storage_reader=reader, no_dist=True)
        cases[f"strided_{'mapped' if mapped else 'preadv'}"] = {
            "mismatched": sorted(k for k in keys if not _same_bits(strided[k], reference[k])),
            "staging": _staging(reader)}
    return cases


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _timed_load(path: Path, state: dict[str, torch.Tensor], device: torch.device) -> tuple[float, HFStorageReader]:
    reader = HFStorageReader(str(path))
    return _timed(lambda: dcp.load(state, storage_reader=reader, no_dist=True), device), reader


def throughput(workdir: Path, device: torch.device, size_gb: float, repeats: int) -> dict[str, Any]:
    """GB/s into ``device`` memory of loads through the ring, against pinned host-to-device copies."""
    count = max(1, round(size_gb * 1e9 / (ROWS * COLS * 2)))
    source = {f"w{i}": torch.randn(ROWS, COLS, device=device, dtype=torch.bfloat16).cpu() for i in range(count)}
    file = workdir / "big" / "model.safetensors"
    file.parent.mkdir()
    save_file(source, str(file))  # just written: in the page cache
    nbytes = count * ROWS * COLS * 2
    rows: dict[str, Any] = {"bytes": nbytes}
    for dtype in (torch.bfloat16, torch.float32):
        state = {k: torch.empty(ROWS, COLS, dtype=dtype, device=device) for k in source}
        loads = [_timed_load(file.parent, state, device) for _ in range(repeats)]
        times, reader = [t for t, _ in loads], loads[-1][1]
        equal = all(_same_bits(state[k], v.to(device).to(dtype)) for k, v in source.items())
        rows[str(dtype).removeprefix("torch.")] = {
            "best_s": min(times), "gb_per_s": nbytes / min(times) / 1e9, "times_s": times, "equal": equal,
            "seconds": dict(reader.seconds), "staging": _staging(reader)}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = [_timed(lambda: target.copy_(pinned, non_blocking=True), device) for _ in range(repeats + 1)][1:]
    rows["pinned_copy"] = {"best_s": min(times), "gb_per_s": nbytes / min(times) / 1e9, "times_s": times}
    rows["ratio"] = rows["bfloat16"]["gb_per_s"] / rows["pinned_copy"]["gb_per_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node 1 bench/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file of the results")
    parser.add_argument("--size-gb", type=float, default=1.5, help="size of the throughput checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one,"
              " or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
            result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "correctness": correctness(Path(tmp), device, mesh),
                      "throughput": throughput(Path(tmp), device, args.size_gb, args.repeats)}
    finally:
        dist.destroy_process_group()
    correct = not any(case["mismatched"] for case in result["correctness"].values()) and all(
        row["equal"] for key, row in result["throughput"].items() if key in ("bfloat16", "float32"))
    result["correct"] = correct
    Path(args.out).write_text(json.dumps(result, indent=2))
    t = result["throughput"]
    for name, case in result["correctness"].items():
        print(f"{name}: {'ok' if not case['mismatched'] else 'MISMATCHED ' + ', '.join(case['mismatched'])}")
    for key in ("bfloat16", "float32", "pinned_copy"):
        print(f"{key}: {t[key]['gb_per_s']:.2f} GB/s ({t['bytes'] / 1e9:.2f} GB in {t[key]['best_s']:.3f} s)")
    print(f"ring / pinned copy: {t['ratio']:.2f}; correct: {correct}; written to {args.out}")
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A trainer that sends its weights to a vLLM engine: ``torchrun --nproc-per-node N -m
tests.support.sync_trainer ...``, in the main venv (no vLLM installed; transformers' own TP plans).

It loads ``--checkpoint`` into a parallelized model, then runs ``--updates`` weight updates through
the engine at ``--engine`` (its HTTP weight-sync routes). Between updates it takes a "training step"
that changes exactly the tensors of layer 0's attention. After each update every rank writes its
figures, the ranks save the model (``save_hf_checkpoint``, the oracle's files), and the trainer
waits for the test to have compared the engine (a ``continue-K`` file) before the next step.
``--die-rank R`` makes rank R exit without a word just before update 2.

``--quantize Q`` (``fp8`` or a ``quantization_config`` as JSON: an FP8 engine's own) sends and saves
the FP8 tensors of ``save_hf_checkpoint(quantize=Q)``; the model stays float32, the precision the
FP8 save of the engine's checkpoint was quantized from. ``--titan FAMILY`` trains a torchtitan
model of :mod:`tests.support.titan` (parallelized by torchtitan, ``--layout`` ``tp`` or ``fsdp``)
instead of a transformers one, loaded, sent and saved through
:mod:`hp_dcp_hf.integrations.torchtitan`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHANGED = {"transformers": "layers.0.self_attn.", "titan": "layers.0.attention."}


def _parallelize(layout: str):
    from hp_dcp_hf.parallel.plans import TransformersPlans

    spec = {"fsdp": "dp=WORLD", "tp": "tp=WORLD", "fsdp_tp": "dp=2,tp=2", "ep": "ep=WORLD"}[layout]
    return TransformersPlans(spec.replace("WORLD", str(dist.get_world_size())), warn=False)


def _quantize(value: str | None) -> Any:
    return json.loads(value) if value and value.lstrip().startswith("{") else value


def _transformers_model(args: argparse.Namespace, quantize: Any):
    """The transformers model on ``--checkpoint``, its weight source and its save."""
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.save.api import save_hf_checkpoint
    from hp_dcp_hf.sync.source import HFWeightSource

    config = json.loads(Path(args.checkpoint, "config.json").read_text())
    moe = config.get("num_experts") or config.get("num_local_experts")  # transformers 5.19 writes the latter
    transforms = ("grouped_gemm_experts",) if moe else ("fuse_qkv", "fuse_gate_up")
    model, _ = from_pretrained(args.checkpoint, dtype=torch.float32, transforms=transforms,
                               parallelize=_parallelize(args.layout))
    return model, HFWeightSource(model, quantize=quantize), lambda path: save_hf_checkpoint(
        model, path, quantize=quantize)


def _titan_model(args: argparse.Namespace, quantize: Any):
    """torchtitan's model of ``--titan`` on ``--checkpoint``, its weight source and its save."""
    from hp_dcp_hf.integrations import torchtitan as tt
    from tests.support import titan

    world = dist.get_world_size()
    degrees = {"tp": {"tp": world}, "fsdp": {"dp_shard": world}}[args.layout]
    model = titan.parallelized(args.titan, titan.Layout(args.layout, **degrees))
    tt.load_hf_checkpoint(model, args.checkpoint)
    return model, tt.weight_source(model, quantize=quantize), lambda path: tt.save_hf_checkpoint(
        model, path, quantize=quantize)


def _wait_for(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--layout", default="tp")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--delta", action="store_true")
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--quantize")
    parser.add_argument("--titan")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from hp_dcp_hf.geometry.shards import local_tensor
    from hp_dcp_hf.sync.client import HTTPEngineClient
    from hp_dcp_hf.sync.trainer import TrainerWeightSync

    build = _titan_model if args.titan else _transformers_model
    model, source, save = build(args, _quantize(args.quantize))
    changed = CHANGED["titan" if args.titan else "transformers"]
    workdir = Path(args.workdir)
    sync = TrainerWeightSync(source, HTTPEngineClient(args.engine), timeout_s=30, delta=args.delta, verify=True,
                             bucket_bytes=1 << 15)
    for update in range(1, args.updates + 1):
        if update > 1:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if changed in name:
                        local_tensor(param).add_(0.5)
            if rank == args.die_rank:
                os._exit(3)
        try:
            stats = sync.send_weights()
            result = {"bytes_sent": stats.bytes_sent, "pieces_unchanged": stats.pieces_unchanged,
                      "held_bytes": source.held_bytes, "seconds": stats.seconds}
        except Exception as error:
            result = {"error": type(error).__name__, "reason": str(error), "key": getattr(error, "key", None)}
        Path(workdir, f"rank{rank}-update{update}.json").write_text(json.dumps(result))
        if "error" in result:
            return
        save(workdir / f"update{update}")
        if rank == 0:
            Path(workdir, f"saved{update}").touch()
        _wait_for(workdir / f"continue{update}")
    sync.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

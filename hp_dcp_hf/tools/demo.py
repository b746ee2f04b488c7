"""``hp-dcp-hf demo`` (``make demo``): a real multi-rank load of a small MoE checkpoint.

1. Generates a Mixtral-shaped checkpoint with random weights from a transformers config (about
   210 MB of bf16 in several shards plus an index; written once into a cache directory, then reused;
   ``--quantized fp8``: its layer weights FP8 block-quantized, as DeepSeek-V3 ships).
2. Plans every rank's reads without a process group (``hp-dcp-hf plan``).
3. Launches the ranks (gloo, spawned processes). Each builds the model on the meta device,
   applies the rewrites (default: ``grouped_gemm_experts``), lays it out on a 2-D ``dp x tp`` mesh
   (TP attention, FSDP2 blocks, experts FSDP-sharded over all ranks) and loads it with the
   planner, recording every byte range it reads; then loads a second copy with the legacy loader
   (whole tensors, converted in memory), checks every parameter shard is bit-identical, and runs a
   forward pass through both (rank 0 also against transformers' single-process ``from_pretrained``);
   then saves the model back (``save_hf_checkpoint``, same layout) and loads that again.
4. Prints the per-rank table, the read amplification (bytes read / bytes needed) of both loaders,
   each against the same need (the bytes the ranks' shards need), whether the plan predicted the
   reads exactly, and draws which byte ranges of each file each rank read (``reads.png``; ``reads_legacy.png`` for the legacy loader).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hp_dcp_hf.tools.formatting import fmt_bytes, table
from hp_dcp_hf.tools.inspection import inspect_checkpoint

DEMO_VERSION = 1
DEMO_CONFIG: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SHARD_SIZE = "48MB"
MARKER = "hp_dcp_hf_demo.json"
DEMO_DTYPE = "float32"
"""The dtype the demo's models are built in, not the default's (``auto``: a bf16 checkpoint makes a
bf16 model): the forward is compared with transformers' float32 one, and an FP8 checkpoint's values
need float32 to be compared exactly."""


def _cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("HP_DCP_HF_CACHE"):
        return Path(os.environ["HP_DCP_HF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hp_dcp_hf"


FP8_CONFIG: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}


def ensure_checkpoint(cache_dir: Path, regenerate: bool = False, quantized: str = "none") -> tuple[Path, float | None]:
    """The demo checkpoint directory and how long generating it took (``None``: reused).

    ``quantized="fp8"``: the same model with every layer weight but the routers quantized to FP8 by
    transformers' own ``Fp8Quantize`` (blocks of 128 x 128, float32 ``weight_scale_inv``).
    """
    suffix = "" if quantized == "none" else f"-{quantized}"
    path = cache_dir / f"demo-mixtral{suffix}-v{DEMO_VERSION}"
    marker = path / MARKER
    if not regenerate and marker.exists():
        try:
            if json.loads(marker.read_text()).get("config") == DEMO_CONFIG:
                return path, None
        except (OSError, json.JSONDecodeError):
            pass
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    start = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{path.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    model = MixtralForCausalLM._from_config(MixtralConfig(**DEMO_CONFIG), dtype=torch.bfloat16)
    model.save_pretrained(tmp, max_shard_size=SHARD_SIZE)
    if quantized == "fp8":
        _quantize_fp8(tmp)
    (tmp / MARKER).write_text(json.dumps({"version": DEMO_VERSION, "config": DEMO_CONFIG}, indent=2))
    del model
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path, time.perf_counter() - start


def _quantize_fp8(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` as an FP8 block-scaled one (in place, file by file)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(FP8_CONFIG), pre_quantized=True)
    quantize = Fp8Quantize(quantizer)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for key, value in load_file(path / file).items():
            layer_weight = ".layers." in key and key.endswith(".weight") and value.ndim == 2
            router = key.endswith(".gate.weight")
            tensors.update(quantize.convert({key: value}) if layer_weight and not router else {key: value})
        save_file(tensors, path / file, metadata={"format": "pt"})
        index["weight_map"].update({key: file for key in tensors})
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for f in set(index["weight_map"].values())
                                          for t in load_file(path / f).values())
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))


# -- ranks -------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, ckpt: str, mesh_spec: str, transforms: list[str],
               reference: bool, out_dir: str, timeout: float = 900) -> None:
    """One rank of the demo: both loaders' loads, the save and its reload, the forwards; its results
    in ``rank{N}.json`` of ``out_dir``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        models, loads, layout, coordinate = _load_both(rank, ckpt, mesh_spec, transforms)
        save = _save_and_reload(models["dcp"], ckpt, mesh_spec, transforms, out_dir)
        ids = torch.randint(DEMO_CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = models["dcp"](input_ids=ids).logits
            legacy_logits = models["legacy"](input_ids=ids).logits
        state = models["dcp"].state_dict()
        result = {
            "rank": rank, "coordinate": list(coordinate), "layout": layout,
            "dcp": loads["dcp"], "legacy": loads["legacy"], "save": save, "tensors": len(state),
            "mismatched": _mismatched(state, models["legacy"].state_dict()),
            "logits_equal": bool(torch.equal(logits, legacy_logits)),
            "logits_finite": bool(logits.isfinite().all()),
        }
    finally:
        dist.destroy_process_group()
    if reference and rank == 0:
        result["reference"] = _reference(ckpt, ids, logits)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _load_both(rank: int, ckpt: str, mesh_spec: str, transforms: list[str]):
    """The model loaded by each loader (``dcp``, ``legacy``), what each load measured (with every
    byte range it read), and the layout and this rank's coordinate on the mesh."""
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.storage.read.recording import RecordingReader
    from hp_dcp_hf.tools.progress import progress_planner
    from hp_dcp_hf.tools.rank_plans import parallelize_for

    loads: dict[str, Any] = {}
    models = {}
    for loader in ("dcp", "legacy"):
        parallelize = parallelize_for(mesh_spec)
        reader = RecordingReader(ckpt)
        start = time.perf_counter()
        model, report = from_pretrained(
            ckpt, dtype=DEMO_DTYPE, transforms=transforms, parallelize=parallelize, loader=loader,
            reader=reader, planner_cls=progress_planner(rank == 0, desc=f"rank 0, {loader} loader"),
        )
        models[loader] = model
        loads[loader] = {
            "bytes_needed": report.plan.bytes_needed, "bytes_read": report.read.bytes_read,
            "requests": report.read.requests, "ranges": report.read.ranges,
            "header_bytes": report.read.header_bytes, "load_s": report.seconds["load"],
            "read_s": report.seconds["read"],
            "total_s": time.perf_counter() - start, "reads": sorted(reader.reads),
            "loaded": len(report.loaded_keys), "missing": list(report.missing_keys),
            "unexpected": list(report.unexpected_keys), "initialized": list(report.initialized_keys),
        }
    return models, loads, parallelize.describe(), parallelize.coordinate


def _save_and_reload(model: Any, ckpt: str, mesh_spec: str, transforms: list[str], out_dir: str) -> dict[str, Any]:
    """Save ``model`` under the same layout (one parallel write pass) into ``out_dir/saved``, load it
    back: the bytes this rank wrote, the seconds, the tensors that differ after the reload."""
    import torch

    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.save.api import save_hf_checkpoint
    from hp_dcp_hf.storage import HFStorageWriter
    from hp_dcp_hf.tools.rank_plans import parallelize_for

    saved_path = str(Path(out_dir) / "saved")
    # bf16 as the checkpoint holds its values (an FP8 checkpoint's values need the model's float32)
    quantized = "quantization_config" in json.loads(Path(ckpt, "config.json").read_text())
    writer = HFStorageWriter(saved_path, max_shard_size=SHARD_SIZE, dtype=None if quantized else torch.bfloat16)
    start = time.perf_counter()
    save_hf_checkpoint(model, saved_path, writer=writer)
    save = {"bytes_written": writer.bytes_written, "save_s": time.perf_counter() - start}
    reloaded, _ = from_pretrained(saved_path, dtype=DEMO_DTYPE, transforms=transforms,
                                  parallelize=parallelize_for(mesh_spec))
    save["mismatched"] = _mismatched(model.state_dict(), reloaded.state_dict())
    return save


def _mismatched(state: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The keys of ``state`` whose local shards are not bit-identical to ``other``'s."""
    import torch

    from hp_dcp_hf.geometry.shards import local_tensor

    return sorted(k for k, v in state.items() if not torch.equal(local_tensor(v), local_tensor(other[k])))


def _reference(ckpt: str, ids: Any, logits: Any) -> dict[str, float]:
    """Rank 0's logits against transformers' single-process ``from_pretrained`` of the checkpoint."""
    import torch
    from transformers import MixtralForCausalLM

    ref = MixtralForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, DEMO_DTYPE)).eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    return {"max_abs_diff": float((logits - ref_logits).abs().max()), "max_abs": float(ref_logits.abs().max())}


# -- picture -----------------------------------------------------------------------------------


def draw_reads(path: Path, title: str, files: dict[str, int], tensors: dict[str, list[tuple[int, int]]],
               reads: dict[int, list[tuple[str, int, int]]]) -> None:
    """One row per checkpoint file; per rank, a lane with the byte ranges it read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(files)
    ranks = sorted(reads)
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(names), 1, figsize=(13, 1.2 + 0.55 * (len(ranks) + 1) * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        size = files[name]
        spans = sorted(tensors.get(name, []))
        ax.broken_barh([(s / 2**20, (e - s) / 2**20) for s, e in spans[0::2]], (len(ranks) - 0.4, 0.8),
                       facecolors="0.75")
        ax.broken_barh([(s / 2**20, (e - s) / 2**20) for s, e in spans[1::2]], (len(ranks) - 0.4, 0.8),
                       facecolors="0.55")
        for lane, rank in enumerate(ranks):
            runs = [(s / 2**20, max(e - s, 1) / 2**20) for f, s, e in reads[rank] if f == name]
            if runs:
                ax.broken_barh(runs, (lane - 0.4, 0.8), facecolors=colors(rank % 10))
        ax.set_xlim(0, size / 2**20)
        ax.set_ylim(-0.6, len(ranks) + 0.6)
        ax.set_yticks([*range(len(ranks)), len(ranks)], [*(f"rank {r}" for r in ranks), "tensors"])
        ax.invert_yaxis()
        ax.set_title(f"{name}  ({size / 2**20:.1f} MiB)", fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("byte offset in file (MiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver ------------------------------------------------------------------------------------


def _launch(world: int, args: tuple, debug: bool) -> None:
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_rank_main, args=(world, *args), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        if debug:
            print(str(e), file=sys.stderr)
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        raise RuntimeError(f"rank {e.error_index} failed: {last.strip()}") from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(f"rank {e.error_index} died (exit code {e.exit_code})") from None


@dataclass(frozen=True)
class _Setup:
    """What the demo's steps share: the checkpoint (``made_s``: how long generating it took, None
    when reused), the layout and where the results go."""

    ckpt: Path
    made_s: float | None
    mesh: str
    sizes: dict[str, int]
    transforms: list[str]
    out: Path

    @property
    def world(self) -> int:
        from hp_dcp_hf.parallel.mesh import mesh_world_size

        return mesh_world_size(self.sizes)

    @property
    def layout_words(self) -> str:
        return f"mesh {self.mesh}, transforms {','.join(self.transforms) or 'none'}"


@dataclass(frozen=True)
class _Totals:
    """All ranks' bytes: what their shards need, what each loader read, what the save wrote."""

    needed: int
    read: int
    legacy_read: int
    written: int

    @classmethod
    def of(cls, results: list[dict[str, Any]]) -> _Totals:
        return cls(needed=sum(r["dcp"]["bytes_needed"] for r in results),
                   read=sum(r["dcp"]["bytes_read"] for r in results),
                   legacy_read=sum(r["legacy"]["bytes_read"] for r in results),
                   written=sum(r["save"]["bytes_written"] for r in results))

    def amplification(self, loader: str) -> float:
        return (self.read if loader == "dcp" else self.legacy_read) / max(self.needed, 1)


@dataclass(frozen=True)
class _Check:
    name: str
    ok: bool
    text: str


def run(args: argparse.Namespace) -> int:
    """The demo; returns 0 when every check passed."""
    wall = time.perf_counter()
    _quiet_libraries()
    setup = _prepare(args)
    info = _print_checkpoint(setup)
    plan = _plan(setup)
    results = _run_ranks(setup, not args.no_reference, args.timeout, getattr(args, "debug", False))
    totals = _Totals.of(results)
    _print_table(results, totals)
    print(f"read amplification      {totals.amplification('dcp'):.3f}  (dcp loader: bytes read / bytes the ranks' "
          "shards need, all ranks)")
    print(f"legacy loader           {totals.amplification('legacy'):.3f}  (read {fmt_bytes(totals.legacy_read)} for "
          f"the same {fmt_bytes(totals.needed)} the ranks' shards need; checkpoint: {fmt_bytes(info['tensor_bytes'])})")
    checks = [_plan_check(plan, results), _save_check(setup, info, results, totals), _parameters_check(results),
              _report_check(results), _forward_check(results)]
    for check in checks:
        print(f"{check.name:<23} {'ok  ' if check.ok else 'FAIL'} {check.text}")
    pictures = _draw_pictures(setup, info, results, totals)
    _write_summary(setup, plan, results, totals, checks)
    print(f"{'picture':<23}      {pictures[0]} (legacy: {pictures[1].name})")
    print(f"{'output':<23}      {setup.out}  ({time.perf_counter() - wall:.0f} s in all)")
    return 0 if all(check.ok for check in checks) else 1


def _quiet_libraries() -> None:
    """One thread per rank, no transformers warnings or progress bars between the demo's lines."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)


def _prepare(args: argparse.Namespace) -> _Setup:
    """The output directory emptied of a previous run's results, and the checkpoint (generated once,
    then reused)."""
    from hp_dcp_hf.parallel.mesh import parse_mesh

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    shutil.rmtree(out / "saved", ignore_errors=True)  # saved anew: under the checkpoint's own file names
    ckpt, made_s = ensure_checkpoint(_cache_dir(args.cache_dir), args.regenerate, getattr(args, "quantized", "none"))
    transforms = [t.strip() for t in args.transforms.split(",") if t.strip()]
    return _Setup(ckpt, made_s, args.mesh, parse_mesh(args.mesh), transforms, out)


def _print_checkpoint(setup: _Setup) -> dict[str, Any]:
    """What the checkpoint holds and the model the ranks build; the checkpoint's inspection."""
    import math

    info = inspect_checkpoint(str(setup.ckpt))
    n_params = sum(math.prod(e.shape) for e in _catalog(setup.ckpt).entries.values())
    how = f"generated in {setup.made_s:.1f} s" if setup.made_s is not None else "reused"
    print(f"checkpoint   {setup.ckpt} ({how})")
    print(f"             MixtralForCausalLM, {n_params / 1e6:.1f}M parameters, {info['tensors']} tensors in "
          f"{len(info['files'])} files + index, {fmt_bytes(info['tensor_bytes'])} of "
          + ", ".join(info["dtypes"]))
    quantized = info["quantization"]
    if quantized:
        print(f"             quantized {quantized['format']}: {quantized.get('weights', 0)} weights "
              f"({fmt_bytes(quantized.get('weight_bytes', 0))}) and their scales "
              f"({fmt_bytes(quantized.get('scale_bytes', 0))}), loaded as values")
    print(f"model        {setup.world} ranks (gloo), mesh " + " x ".join(f"{k}={v}" for k, v in setup.sizes.items())
          + f", transforms {','.join(setup.transforms) or 'none'}, {dtype_line(str(setup.ckpt))}")
    return info


def _plan(setup: _Setup) -> dict[str, Any]:
    """Every rank's reads, planned without a process group (``hp-dcp-hf plan``)."""
    from hp_dcp_hf.tools.rank_plans import plan_ranks

    start = time.perf_counter()
    plan = plan_ranks(str(setup.ckpt), setup.sizes, transforms=setup.transforms, dtype=DEMO_DTYPE)
    print(f"plan         every rank's reads planned in {time.perf_counter() - start:.1f} s, no process group")
    for line in plan["layout"]:
        print(f"layout       {line}")
    return plan


def _run_ranks(setup: _Setup, reference: bool, timeout: float, debug: bool) -> list[dict[str, Any]]:
    """The ranks' loads, save and forwards (:func:`_rank_main`); each rank's results."""
    from hp_dcp_hf.tools.launch import free_port

    start = time.perf_counter()
    _launch(setup.world, (free_port(), str(setup.ckpt), setup.mesh, setup.transforms, reference, str(setup.out),
                          timeout), debug)
    results = [json.loads((setup.out / f"rank{r}.json").read_text()) for r in range(setup.world)]
    print(f"ranks        {setup.world} processes finished in {time.perf_counter() - start:.1f} s (spawn, imports, "
          "two loads, forwards)")
    print()
    return results


def _print_table(results: list[dict[str, Any]], totals: _Totals) -> None:
    """Per rank: both loaders' bytes, requests and seconds, and the save's."""
    rows = []
    for r in results:
        d, lg = r["dcp"], r["legacy"]
        rows.append((r["rank"], ",".join(map(str, r["coordinate"])), fmt_bytes(d["bytes_needed"]),
                     fmt_bytes(d["bytes_read"]), d["requests"], f"{d['load_s']:.2f}", f"{d['read_s']:.2f}",
                     f"{d['bytes_read'] / max(d['read_s'], 1e-9) / 1e9:.2f}",
                     fmt_bytes(lg["bytes_read"]), lg["requests"], f"{lg['load_s']:.2f}",
                     fmt_bytes(r["save"]["bytes_written"]), f"{r['save']['save_s']:.2f}"))
    rows.append(("all", "", fmt_bytes(totals.needed), fmt_bytes(totals.read),
                 sum(r["dcp"]["requests"] for r in results), "", "", "", fmt_bytes(totals.legacy_read),
                 sum(r["legacy"]["requests"] for r in results), "", fmt_bytes(totals.written), ""))
    print(table(("rank", "coord", "bytes needed", "bytes read", "requests", "load s", "read s", "GB/s",
                 "legacy read", "legacy req", "legacy load s", "saved", "save s"), rows))
    print("(load s: the whole dcp.load, metadata and plan exchange included; read s and GB/s: its reads; "
          "saved: the bytes each rank wrote saving the model back)")
    print()


def _plan_check(plan: dict[str, Any], results: list[dict[str, Any]]) -> _Check:
    predicted = all(
        (p.bytes_needed, p.bytes_to_read, p.requests) == (r["dcp"]["bytes_needed"], r["dcp"]["bytes_read"],
                                                          r["dcp"]["requests"])
        and sorted(map(tuple, p.reads)) == sorted(map(tuple, r["dcp"]["reads"]))
        for p, r in zip(plan["ranks"], results)
    )
    return _Check("plan", predicted, "the plan (no process group) predicted every rank's byte ranges exactly"
                  if predicted else "the plan and the measured reads DIFFER")


def _save_check(setup: _Setup, info: dict[str, Any], results: list[dict[str, Any]], totals: _Totals) -> _Check:
    resaved = {r["rank"]: r["save"]["mismatched"] for r in results if r["save"]["mismatched"]}
    saved_bytes = inspect_checkpoint(str(setup.out / "saved"))["tensor_bytes"]
    same_files = info["quantization"] is not None or _same_tensors(setup.out / "saved", setup.ckpt)
    ok = not resaved and totals.written == saved_bytes and same_files
    if not ok:
        return _Check("save", ok, f"save DIFFERS: {fmt_bytes(totals.written)} written for {fmt_bytes(saved_bytes)} "
                      f"of tensor data; same files as the checkpoint: {same_files}; mismatched after reload {resaved}")
    return _Check("save", ok, f"saved back in one parallel pass as save_pretrained lays it out "
                  f"({fmt_bytes(totals.written)} written, each byte of the files once; "
                  + ("the same files, keys and bits as the checkpoint" if info["quantization"] is None else
                     "dequantized values, float32") + ") and reloaded bit-identical on every rank")


def _parameters_check(results: list[dict[str, Any]]) -> _Check:
    mismatched = {r["rank"]: r["mismatched"] for r in results if r["mismatched"]}
    return _Check("parameters", not mismatched,
                  f"all {results[0]['tensors']} state-dict tensors bit-identical to the legacy loader on every rank"
                  if not mismatched else f"DIFFER from the legacy loader: {mismatched}")


def _report_check(results: list[dict[str, Any]]) -> _Check:
    problems = [f"rank {r['rank']}: missing {r['dcp']['missing']}, unexpected {r['dcp']['unexpected']}"
                for r in results if r["dcp"]["missing"] or r["dcp"]["unexpected"]]
    return _Check("report", not problems,
                  f"{results[0]['dcp']['loaded']} tensors loaded, none missing or unexpected; initialized by the "
                  f"model's own init: {', '.join(results[0]['dcp']['initialized']) or 'nothing'}"
                  if not problems else "; ".join(problems))


def _forward_check(results: list[dict[str, Any]]) -> _Check:
    same = all(r["logits_equal"] and r["logits_finite"] for r in results)
    line = "logits identical to the legacy-loaded model on every rank" if same else "logits DIFFER from legacy"
    ok_ref = True
    ref = results[0].get("reference")
    if ref:
        ok_ref = ref["max_abs_diff"] <= 1e-4 * max(1.0, ref["max_abs"])
        line += (f"; max |logits - transformers from_pretrained| = {ref['max_abs_diff']:.2e} "
                 f"(max |logit| {ref['max_abs']:.2f})")
    return _Check("forward", same and ok_ref, line)


def _draw_pictures(setup: _Setup, info: dict[str, Any], results: list[dict[str, Any]], totals: _Totals) -> list[Path]:
    """``reads.png`` and ``reads_legacy.png``: the byte ranges each rank read with each loader."""
    files = {f: d["file_bytes"] for f, d in info["files"].items()}
    spans: dict[str, list[tuple[int, int]]] = {}
    for entry in _catalog(setup.ckpt).entries.values():
        spans.setdefault(entry.file, []).append((entry.data_start, entry.data_end))
    pictures = []
    for loader in ("dcp", "legacy"):
        name = "reads.png" if loader == "dcp" else "reads_legacy.png"
        draw_reads(setup.out / name, f"{loader} loader: byte ranges each rank read ({setup.world} ranks, "
                   f"{setup.layout_words}); bytes read / bytes needed = {totals.amplification(loader):.2f}",
                   files, spans, {r["rank"]: [tuple(x) for x in r[loader]["reads"]] for r in results})
        pictures.append(setup.out / name)
    return pictures


def _write_summary(setup: _Setup, plan: dict[str, Any], results: list[dict[str, Any]], totals: _Totals,
                   checks: list[_Check]) -> None:
    """``summary.json``: the layout, each rank's results (less the byte ranges), the amplifications, the checks."""
    (setup.out / "summary.json").write_text(json.dumps({
        "checkpoint": str(setup.ckpt), "mesh": setup.sizes, "transforms": setup.transforms, "layout": plan["layout"],
        "ranks": [{k: v for k, v in r.items() if k not in ("dcp", "legacy")}
                  | {loader: {k: v for k, v in r[loader].items() if k != "reads"} for loader in ("dcp", "legacy")}
                  for r in results],
        "read_amplification": totals.amplification("dcp"), "legacy_bytes_read": totals.legacy_read,
        "legacy_read_amplification": totals.amplification("legacy"),
        "checks": {check.name: check.ok for check in checks},
    }, indent=2))


def dtype_line(ckpt: str) -> str:
    """The demo's dtype, and the one ``dtype="auto"`` (the default of ``from_pretrained`` and the
    CLI) builds the checkpoint at ``ckpt`` in, so the demo's choice is not taken for the default."""
    from hp_dcp_hf.model.config import read_config
    from hp_dcp_hf.model.dtype import AUTO, resolve_dtype

    entries = lambda: (e.dtype for e in _catalog(Path(ckpt)).entries.values())  # noqa: E731
    default = str(resolve_dtype(AUTO, read_config(ckpt), entries)).removeprefix("torch.")
    if default == DEMO_DTYPE:
        return DEMO_DTYPE
    return (f"{DEMO_DTYPE} (the demo's choice, to compare with transformers' {DEMO_DTYPE} forward; by default, "
            f"dtype='auto', this checkpoint loads as {default}, as in transformers)")


def _same_tensors(saved: Path, original: Path) -> bool:
    """The same safetensors files, each with the same keys and bit-identical tensors."""
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in original.glob("*.safetensors"))
    if sorted(p.name for p in saved.glob("*.safetensors")) != files:
        return False
    for name in files:
        a, b = load_file(saved / name), load_file(original / name)
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def _catalog(ckpt: Path):
    from hp_dcp_hf.storage import ReadStats, filesystem, locate, scan

    location, single = locate(*filesystem(str(ckpt)))
    return scan(location, single, ReadStats())

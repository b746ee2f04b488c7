"""Startup: what a command imports, and ``load --nproc-per-node``.

``inspect`` reads headers only, so it imports neither torch's DCP nor transformers; the planner
imports no transformers modeling stack (nor its FP8 kernels and ``torch._dynamo``) for a model that
is not a transformers one. Checked in fresh interpreters, through their ``sys.modules``. ``load --nproc-per-node N`` checks the mesh, storage options and config
before any rank starts, runs the load on N gloo ranks, and prints one line when it fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.models import checkpoint_keys, read_checkpoint

REPO = Path(__file__).resolve().parents[1]
DCP = "torch.distributed.checkpoint"
MODELING = "transformers.modeling_utils"
FP8_KERNELS = ("transformers.integrations.finegrained_fp8", "transformers.integrations.deepgemm", "torch._dynamo")


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama", torch.bfloat16)


def _run(code: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, set[str], object]:
    """``code`` in a fresh interpreter (from the repository root, as a user runs it): the process,
    the modules in its ``sys.modules`` at the end, and the value of ``code``'s ``result``."""
    tail = "\nimport json as _json, sys as _sys\nprint(_json.dumps([sorted(_sys.modules), result]))\n"
    proc = subprocess.run([sys.executable, "-c", code + tail], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    modules, result = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc, set(modules), result


def _cli_in_process(*argv: str) -> tuple[subprocess.CompletedProcess, set[str], int]:
    """``hp-dcp-hf ARGV`` through :func:`hp_dcp_hf.tools.cli.main` in a fresh interpreter: what it
    printed, the modules it imported, its exit code."""
    return _run(f"from hp_dcp_hf.tools.cli import main\nresult = main({list(argv)!r})")


def test_inspect_imports_neither_dcp_nor_transformers(llama) -> None:
    proc, modules, rc = _cli_in_process("inspect", str(llama.path), "--tensors")
    assert rc == 0, proc.stderr[-2000:]
    assert f"{len(checkpoint_keys(llama.path))} tensors" in proc.stdout  # headers read, tensors listed
    assert "hp_dcp_hf.tools.inspection" in modules and "torch" in modules
    assert not modules & {DCP, MODELING, "transformers"}, sorted(modules & {DCP, MODELING, "transformers"})


def test_the_planner_imports_no_modeling_stack_for_a_plain_model() -> None:
    code = ("import torch\n"
            "from hp_dcp_hf import HFMappingPlanner\n"
            "from hp_dcp_hf.mapping.stages import model_stages\n"
            "result = model_stages(torch.nn.Linear(2, 2), None)\n")
    proc, modules, stages = _run(code)
    assert stages == [[]], proc.stderr[-2000:]
    assert "hp_dcp_hf.load.planner" in modules and DCP in modules
    assert not modules & {MODELING, *FP8_KERNELS}, sorted(modules & {MODELING, *FP8_KERNELS})


def test_a_transformers_model_still_gets_its_conversion_mapping() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from hp_dcp_hf.mapping.stages import model_stages

    config = MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, num_local_experts=2, vocab_size=32)
    with torch.device("meta"):
        (mapping, *_) = model_stages(MixtralForCausalLM(config), None)
    assert mapping  # transformers' mapping of mixtral's per-expert checkpoint


@pytest.mark.parametrize("name", [
    "model.layers.10.mlp.experts.2.w1.weight", "model.layers.2.self_attn.q_proj.weight", "lm_head.weight",
    "shard_2.x", "shard_11.x", "a.007.b", "x.y1z.3", "layers.1.", "", "a..b", "w13", "0.1.2", "e.1e5",
])
def test_the_natural_key_is_transformers_own(name) -> None:
    from transformers.core_model_loading import dot_natural_key as theirs

    from hp_dcp_hf.mapping.families import dot_natural_key, natural_sorted

    assert dot_natural_key(name) == theirs(name)
    names = ["a.10.b", "a.9.b", "a.b", "shard_11", "shard_2", name]
    assert list(natural_sorted(names)) == sorted(names, key=theirs)


# -- load --nproc-per-node ----------------------------------------------------------------------


def _cli(*argv: str, timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hp_dcp_hf", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def test_nproc_per_node_runs_a_real_two_rank_load(llama) -> None:
    proc = _cli("load", str(llama.path), "--mesh", "dp=2", "--nproc-per-node", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    keys = checkpoint_keys(llama.path)
    assert all(r["loaded"] >= len(keys) and r["missing"] == r["unexpected"] == 0 for r in out["ranks"])
    # FSDP over 2 ranks: each reads its own half, together the whole checkpoint
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in read_checkpoint(llama.path).values())
    assert sum(r["bytes_read"] for r in out["ranks"]) == checkpoint_bytes
    assert all(0 < r["bytes_read"] < checkpoint_bytes for r in out["ranks"])


def _one_error_line(proc: subprocess.CompletedProcess, rc: int | None = None) -> str:
    assert (proc.returncode if rc is None else rc) == 1, proc.stderr[-3000:]
    assert rc is not None or proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("hp-dcp-hf: error: "), proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--mesh", "dp=2,tp=2"], "mesh dp=2,tp=2 needs 4 ranks, but 2 processes were launched; pass --nproc-per-node 4"),
    (["--mesh", "fsdp=2"], "mesh spec 'fsdp=2': unknown dim 'fsdp' (did you mean dp?)"),
    (["--storage-option", "endpoint=x"], "unknown storage option 'endpoint' for local files"),
])
def test_nproc_per_node_checks_before_starting_ranks(llama, argv, message) -> None:
    proc, modules, rc = _cli_in_process("load", str(llama.path), *argv, "--nproc-per-node", "2")
    line = _one_error_line(proc, rc)
    assert message in line, line
    assert "torch" not in modules  # refused before torch, let alone ranks, started


def test_nproc_per_node_refuses_a_checkpoint_without_config_before_starting_ranks(llama, tmp_path) -> None:
    for file in llama.path.glob("*.safetensors*"):
        shutil.copy(file, tmp_path / file.name)
    proc, modules, rc = _cli_in_process("load", str(tmp_path), "--nproc-per-node", "2")
    assert "no config.json next to the weights" in _one_error_line(proc, rc)
    assert "hp_dcp_hf.tools.launch" not in modules


def test_nproc_per_node_prints_a_rank_failure_as_one_line(llama, tmp_path) -> None:
    """A checkpoint lacking a tensor fails on every rank (strict load): one line, the first rank's."""
    shutil.copytree(llama.path, tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    dropped = "model.layers.0.mlp.down_proj.weight"
    shard = tmp_path / "ckpt" / index["weight_map"].pop(dropped)
    tensors = load_file(shard)
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = _cli("load", str(tmp_path / "ckpt"), "--mesh", "dp=2", "--nproc-per-node", "2")
    line = _one_error_line(proc)
    assert line == f"hp-dcp-hf: error: on rank 0: the checkpoint makes no value for 1 model tensors: {[dropped]}", line


def test_without_nproc_drops_the_option_alone() -> None:
    from hp_dcp_hf.tools.cli.nproc import without_nproc

    assert without_nproc(["load", "p", "--nproc-per-node", "4", "--mesh", "tp=4"]) == ["load", "p", "--mesh", "tp=4"]
    assert without_nproc(["load", "p", "--nproc-per-node=4", "--json"]) == ["load", "p", "--json"]

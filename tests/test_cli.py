"""The ``hp-dcp-hf`` command line: ``inspect``, ``plan`` (text and ``--json``), errors, ``load``.

``plan`` computes every rank's reads in one process without a process group; here its numbers are
checked against a real 4-rank load (``hp_dcp_hf.launch.run_ranks``) of the same layout, rank by
rank: bytes needed, bytes read, ranges, requests and the byte ranges themselves.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hp_dcp_hf.cli import main, plan_ranks
from hp_dcp_hf.launch import run_ranks
from tests.models import MODEL_TYPES, checkpoint_files, checkpoint_keys

REPO = Path(__file__).resolve().parent.parent
MESH = "tp=2,dp=2"

# Layouts checked against real loads: (checkpoint, transforms, reader options).
CASES = {
    "llama": ("llama", (), {}),
    "llama-preadv": ("llama", (), {"map_local_files": False}),
    # coalescing (preadv only: a mapping copies needed bytes alone): fewer requests than ranges, gap bytes read
    "llama-gap": ("llama", (), {"coalesce_gap": 64, "map_local_files": False}),
    "mixtral-rewritten": ("mixtral", ("fuse_qkv", "grouped_gemm_experts"), {}),
}


def _run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoints):
    return tiny_checkpoints("mixtral", torch.bfloat16, intermediate_size=48)


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_text(capsys, llama):
    code, out, err = _run_cli(capsys, "inspect", str(llama.path))
    assert code == 0, err
    keys = checkpoint_keys(llama.path)
    for file in checkpoint_files(llama.path):
        assert file.name in out
    assert f"{len(keys)} tensors" in out
    assert "BF16" in out
    assert "consistent with the headers" in out
    assert "model_type=llama" in out


def test_inspect_json(capsys, mixtral):
    code, out, _ = _run_cli(capsys, "inspect", str(mixtral.path), "--json")
    assert code == 0
    info = json.loads(out)
    keys = checkpoint_keys(mixtral.path)
    assert info["tensors"] == len(keys)
    assert set(info["files"]) == {f.name for f in checkpoint_files(mixtral.path)}
    assert sum(f["tensors"] for f in info["files"].values()) == len(keys)
    nbytes = sum(torch.Size(shape).numel() * 2 for _, shape in keys.values())
    assert info["tensor_bytes"] == nbytes == info["dtypes"]["BF16"]["bytes"]
    assert info["index"]["consistent"] and info["index"]["keys"] == len(keys)
    assert info["index"]["unlisted_files"] == []
    for name, f in info["files"].items():
        assert f["file_bytes"] == (mixtral.path / name).stat().st_size == f["tensor_bytes"] + f["header_bytes"]


def test_inspect_flags_unlisted_files(capsys, llama, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(llama.path, copy)
    shutil.copy(next(copy.glob("*.safetensors")), copy / "stray.safetensors")
    code, out, _ = _run_cli(capsys, "inspect", str(copy))
    assert code == 0
    assert "WARNING" in out and "stray.safetensors" in out


def test_inspect_inconsistent_index_is_an_error(capsys, llama, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(llama.path, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    key = "model.norm.weight"
    other = next(f.name for f in checkpoint_files(copy) if f.name != index["weight_map"][key])
    index["weight_map"][key] = other
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out, err = _run_cli(capsys, "inspect", str(copy))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("hp-dcp-hf: error: ")
    assert key in err and "Traceback" not in err


# -- errors ------------------------------------------------------------------------------------


def test_bad_path_exits_nonzero_with_one_line():
    # Through ``python -m hp_dcp_hf``, as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "hp_dcp_hf", "inspect", "/nonexistent/checkpoint"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("hp-dcp-hf: error: ") and "/nonexistent/checkpoint" in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["plan", "{llama}", "--mesh", "tp=2,pp=2"], "unknown dims ['pp']"),
    (["plan", "{llama}", "--mesh", "tp=two"], "expected name=size"),
    (["plan", "{llama}", "--transforms", "fuse_everything"], "unknown transform 'fuse_everything'"),
    (["plan", "{llama}", "--transforms", "grouped_gemm_experts"], "no stacked experts module"),
    (["plan", "{missing}"], "no such file or directory"),
])
def test_errors_are_one_line(capsys, llama, argv, words):
    argv = [a.format(llama=llama.path, missing=llama.path / "nope") for a in argv]
    code, out, err = _run_cli(capsys, *argv)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("hp-dcp-hf: error: ")
    assert words in err


def test_debug_shows_the_exception(capsys, llama):
    from hp_dcp_hf.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError):
        main(["inspect", str(llama.path / "nope"), "--debug"])


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the following arguments are required: path" in err


# -- plan --------------------------------------------------------------------------------------


def test_plan_text(capsys, mixtral):
    code, out, err = _run_cli(capsys, "plan", str(mixtral.path), "--mesh", MESH,
                              "--transforms", "fuse_qkv,grouped_gemm_experts", "--items")
    assert code == 0, err
    assert "MixtralForCausalLM on mesh dp=2,tp=2 (4 ranks)" in out
    assert "fsdp: 2 experts modules over 4 ranks" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert [lines[header + 2 + r].split()[0] for r in range(4)] == ["0", "1", "2", "3"]
    assert "rank 3 read items:" in out
    # the rewritten names are the destinations, the checkpoint's original names the sources
    assert "mlp.experts.w13" in out and "block_sparse_moe.experts.0.w1.weight" in out


def test_plan_json_reads_no_data_and_uses_no_process_group(capsys, llama, monkeypatch):
    import torch.distributed as dist

    from hp_dcp_hf.storage import HFStorageReader

    def no_data(*args, **kwargs):
        raise AssertionError("plan must not read tensor data")

    monkeypatch.setattr(HFStorageReader, "read_data", no_data)
    code, out, err = _run_cli(capsys, "plan", str(llama.path), "--mesh", MESH, "--json")
    assert code == 0, err
    assert not dist.is_initialized()
    plan = json.loads(out)
    assert plan["mesh"] == {"dp": 2, "tp": 2} and plan["world_size"] == 4
    assert [r["rank"] for r in plan["ranks"]] == [0, 1, 2, 3]
    assert [r["coordinate"] for r in plan["ranks"]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for r in plan["ranks"]:
        assert r["targets"] == len(checkpoint_keys(llama.path))  # llama: one target per stored key
        assert r["bytes_to_read"] == r["bytes_needed"] > 0  # no coalescing gap: nothing extra
        assert r["requests"] == r["ranges"] >= r["read_items"]
        assert r["deferred_targets"] == 0 and r["deferred_bytes"] == 0
        assert sum(f["bytes"] for f in r["files"].values()) == r["bytes_to_read"]
        assert sum(f["requests"] for f in r["files"].values()) == r["requests"]
    # every byte is needed by some rank; replicated shards are needed by several
    assert sum(r["bytes_needed"] for r in plan["ranks"]) >= plan["checkpoint_bytes"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plan_every_model_type(capsys, tiny_checkpoints, model_type):
    path = tiny_checkpoints(model_type, torch.bfloat16).path
    code, out, err = _run_cli(capsys, "plan", str(path), "--mesh", MESH, "--json")
    assert code == 0, err
    ranks = json.loads(out)["ranks"]
    assert len(ranks) == 4 and all(r["bytes_needed"] > 0 and r["deferred_targets"] == 0 for r in ranks)


def _real_load(rank: int, world: int, cases: dict) -> dict:
    from hp_dcp_hf.cli import RecordingReader
    from hp_dcp_hf.pipeline import FsdpTp, from_pretrained, init_mesh

    out = {}
    for name, (path, transforms, options) in cases.items():
        reader = RecordingReader(path, **options)
        _, report = from_pretrained(path, transforms=transforms, parallelize=FsdpTp(init_mesh(MESH)), reader=reader)
        stats = reader.stats.total()
        out[name] = {"bytes_needed": report.plan.bytes_needed, "bytes_to_read": stats.bytes_read,
                     "ranges": stats.ranges, "requests": stats.requests, "reads": sorted(reader.reads),
                     "needed_by_reader": stats.bytes_needed}
    return out


def test_plan_bytes_equal_a_real_load(llama, mixtral):
    paths = {"llama": str(llama.path), "mixtral": str(mixtral.path)}
    cases = {name: (paths[ckpt], transforms, options) for name, (ckpt, transforms, options) in CASES.items()}
    measured = run_ranks(4, _real_load, cases, timeout=300)
    for name, (path, transforms, options) in cases.items():
        plan = plan_ranks(path, MESH, transforms=transforms, **options)
        for rank, (planned, real) in enumerate(zip(plan["ranks"], measured)):
            got = real[name]
            assert planned.bytes_needed == got["bytes_needed"] == got["needed_by_reader"], (name, rank)
            assert planned.bytes_to_read == got["bytes_to_read"], (name, rank)
            assert planned.ranges == got["ranges"], (name, rank)
            assert planned.requests == got["requests"], (name, rank)
            assert sorted(planned.reads) == [tuple(r) for r in got["reads"]], (name, rank)
    # the gap case really coalesces: fewer requests, a few gap bytes more
    gap_plan = measured[0]["llama-gap"]
    assert gap_plan["requests"] < gap_plan["ranges"]
    assert gap_plan["bytes_to_read"] > gap_plan["bytes_needed"]
    # mapped or read by ranges, the same bytes and the same requests
    for rank in measured:
        assert rank["llama"] == rank["llama-preadv"]


# -- load --------------------------------------------------------------------------------------


def test_load_single_process_json(capsys, llama):
    import torch.distributed as dist

    code, out, err = _run_cli(capsys, "load", str(llama.path), "--forward", "--json")
    assert code == 0, err
    assert not dist.is_initialized()  # the command tears its group down
    result = json.loads(out)
    (row,) = result["ranks"]
    assert row["bytes_needed"] == row["bytes_read"] > 0
    assert row["missing"] == row["unexpected"] == 0
    assert row["initialized"] == 2  # rotary inv_freq and original_inv_freq
    assert result["logits"]["finite"] and result["logits"]["shape"] == [2, 8, 101]

"""The ``hp-dcp-hf`` command line: ``--help``, ``--version``, ``inspect``, ``plan`` (text and ``--json``),
errors, ``load``, the messages and progress lines of a load and a save, ``--unexpected``.

``plan`` computes every rank's reads in one process without a process group; here its numbers are
checked against a real 4-rank load (``hp_dcp_hf.tools.launch.run_ranks``) of the same layout, rank by
rank: bytes needed, bytes read, ranges, requests and the byte ranges themselves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hp_dcp_hf.tools.cli import main
from hp_dcp_hf.tools.formatting import fmt_bytes
from hp_dcp_hf.tools.launch import run_ranks
from hp_dcp_hf.tools.rank_plans import plan_ranks
from tests.support.models import MODEL_TYPES, checkpoint_files, checkpoint_keys

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


# -- help --------------------------------------------------------------------------------------

_HEAVY = ("torch", "transformers", "torch.distributed.checkpoint")


def _light_run(*argv: str) -> str:
    """``python -m hp_dcp_hf ARGV``'s stdout, as a user runs it, checking that it imported neither
    torch nor transformers (``-X importtime`` lists every module imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hp_dcp_hf", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hp_dcp_hf.tools.cli" in imported  # the listing is really there
    assert not imported & set(_HEAVY), sorted(imported & set(_HEAVY))
    return proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["plan", "--help"], ["load", "--help"],
                                  ["demo", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    assert _light_run(*argv).startswith("usage: hp-dcp-hf")


def test_version_imports_neither_torch_nor_transformers():
    import hp_dcp_hf

    assert _light_run("--version") == f"hp-dcp-hf {hp_dcp_hf.__version__}\n"


def test_public_names_are_lazy_and_importable():
    code = ("import sys, hp_dcp_hf\n"
            "assert 'torch' not in sys.modules, 'import hp_dcp_hf imported torch'\n"
            "from hp_dcp_hf import (HFMappingPlanner, HFStorageReader, LoadReport, add_weight_mapping,\n"
            "                       from_pretrained, load_hf_checkpoint)\n"
            "import hp_dcp_hf.load.api, hp_dcp_hf.storage\n"
            "assert load_hf_checkpoint is hp_dcp_hf.load.api.load_hf_checkpoint\n"
            "assert HFStorageReader is hp_dcp_hf.storage.HFStorageReader\n"
            "assert all(callable(getattr(hp_dcp_hf, n)) for n in hp_dcp_hf.__all__)\n"
            "assert set(hp_dcp_hf.__all__) <= set(dir(hp_dcp_hf))\n"
            "assert hp_dcp_hf.integrations.transformers.from_pretrained is from_pretrained\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    import hp_dcp_hf

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        hp_dcp_hf.nothing_here  # noqa: B018


def test_help_documents_every_default():
    from hp_dcp_hf.tools.cli import build_parser
    from hp_dcp_hf.tools.cli.arguments import HelpFormatter

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    formatter = HelpFormatter("hp-dcp-hf")
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action) or ""
            assert action.help, (name, action.dest)
            if action.option_strings:
                assert "(default: " in text, (name, action.option_strings, text)
        assert command.format_help()  # every %(default)s renders


def test_transforms_help_lists_every_transform():
    from hp_dcp_hf import transforms
    from hp_dcp_hf.tools.cli import build_parser
    from hp_dcp_hf.tools.cli.arguments import TRANSFORMS

    available = {n for n in transforms.__all__ if n[:1].islower() and callable(getattr(transforms, n))}
    assert set(TRANSFORMS) == available
    parser = build_parser()
    for command in ("plan", "load", "demo"):
        text = " ".join(parser._subparsers._group_actions[0].choices[command].format_help().split())
        assert f"available: {', '.join(sorted(available))}" in text, command


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


def test_inspect_tensors_lists_every_tensor_from_the_headers(capsys, mixtral, monkeypatch):
    from hp_dcp_hf.storage.transport.location import RangeFile

    keys = checkpoint_keys(mixtral.path)
    headers = {f.name: json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
               for f in checkpoint_files(mixtral.path)}
    real_read = RangeFile.read

    def headers_only(self, start, end):  # a header is a file's first bytes: no tensor data below them
        if self.file.endswith(".safetensors"):
            assert end <= 8 + int.from_bytes(real_read(self, 0, 8), "little"), "inspect read tensor data"
        return real_read(self, start, end)

    monkeypatch.setattr(RangeFile, "read", headers_only)
    code, out, err = _run_cli(capsys, "inspect", str(mixtral.path), "--tensors", "--json")
    assert code == 0, err
    listed = json.loads(out)["tensor_list"]
    assert [t["name"] for t in listed] == sorted(keys, key=lambda k: [int(p) if p.isdigit() else p
                                                                       for p in k.split(".")])
    for tensor in listed:
        info = headers[tensor["file"]][tensor["name"]]
        assert (tensor["dtype"], tuple(tensor["shape"])) == keys[tensor["name"]]
        length = int.from_bytes((mixtral.path / tensor["file"]).read_bytes()[:8], "little")
        assert tensor["file_offsets"] == [8 + length + o for o in info["data_offsets"]]
        assert tensor["bytes"] == info["data_offsets"][1] - info["data_offsets"][0]
    code, out, err = _run_cli(capsys, "inspect", str(mixtral.path), "--match", r"layers\.1\..*(q|k)_proj")
    assert code == 0, err
    lines = out.splitlines()
    table_lines = lines[next(i for i, line in enumerate(lines) if line.split()[:2] == ["tensor", "dtype"]):]
    assert table_lines[0].split() == ["tensor", "dtype", "shape", "file", "bytes"]
    assert [line.split()[0] for line in table_lines[2:-1]] == ["model.layers.1.self_attn.k_proj.weight",
                                                               "model.layers.1.self_attn.q_proj.weight"]
    k_proj = next(t for t in listed if t["name"] == "model.layers.1.self_attn.k_proj.weight")
    assert table_lines[2].split()[1:] == ["BF16", *str(k_proj["shape"]).split(), k_proj["file"],
                                          *fmt_bytes(k_proj["bytes"]).split()]
    assert table_lines[-1] == f"2 of {len(keys)} tensors match layers\\.1\\..*(q|k)_proj"
    code, out, err = _run_cli(capsys, "inspect", str(mixtral.path), "--match", "no such tensor", "--json")
    assert code == 0 and json.loads(out)["tensor_list"] == []
    _, out, _ = _run_cli(capsys, "inspect", str(mixtral.path), "--json")
    assert "tensor_list" not in json.loads(out)  # without --tensors, the summary alone


def test_inspect_bad_regex_is_a_usage_error(capsys, llama):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(llama.path), "--match", "(unclosed"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --match: '(unclosed' is not a regular expression: missing ), unterminated subpattern" in err


def test_inspect_of_one_shard_says_only_it_is_read_and_names_the_directory(capsys, llama):
    shard = checkpoint_files(llama.path)[0]
    code, out, err = _run_cli(capsys, "inspect", str(shard))
    assert code == 0, err
    (index,) = [line for line in out.splitlines() if line.startswith("index ")]
    assert index == (f"index      none: PATH is one file, {shard.name}, and only it is read; its directory has "
                     f"model.safetensors.index.json: the directory ({llama.path}) is the checkpoint, pass it to "
                     "read every shard")


def test_inspect_says_what_is_read_without_an_index(capsys, tiny_checkpoints, tmp_path):
    single = tiny_checkpoints("llama", torch.bfloat16, max_shard_size=None).path
    _, out, _ = _run_cli(capsys, "inspect", str(single / "model.safetensors"))
    assert "index      none: PATH is one file, model.safetensors, and only it is read\n" in out
    _, out, _ = _run_cli(capsys, "inspect", str(single))
    assert "index      none: model.safetensors is read, alone (as transformers reads it first)\n" in out
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(single / "model.safetensors", loose / "weights.safetensors")
    _, out, _ = _run_cli(capsys, "inspect", str(loose))
    assert "index      none: every .safetensors file of the directory is read\n" in out


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
    (["plan", "{llama}", "--mesh", "tp=2,pp=2"], "unknown dim 'pp'"),
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


@pytest.mark.parametrize("path", ["./nope", "../nope", "nope", "a/b/c", "~/hp-dcp-hf-nope", "/nonexistent/x",
                                  "nope.safetensors", "org/model.safetensors"])
def test_missing_local_path_says_so_and_never_asks_the_hub(capsys, tmp_path, monkeypatch, path):
    from hp_dcp_hf.storage.transport import hub

    def no_hub(*args, **kwargs):
        raise AssertionError(f"{path!r} went to the Hub")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub.HubBackend, "__init__", no_hub)
    code, out, err = _run_cli(capsys, "inspect", path)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "does not exist locally" in err, err


def test_missing_bare_repo_id_names_the_local_path_and_the_hub(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, out, err = _run_cli(capsys, "inspect", "some/dir")
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "no local directory 'some/dir', and the Hub answered: HF_HUB_OFFLINE is set" in err, err


def test_bare_repo_id_the_hub_does_not_know(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    from tests.support.servers.fake_hub import FakeHub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    with FakeHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        code, out, err = _run_cli(capsys, "inspect", "org/absent")
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "no local directory 'org/absent', and the Hub answered: not found on the Hub" in err, err


@pytest.mark.parametrize("command", ["plan", "load"])
def test_no_config_says_what_to_do_on_the_command_line(capsys, llama, tmp_path, command):
    weights = tmp_path / "weights"
    weights.mkdir()
    for file in checkpoint_files(llama.path):
        shutil.copy(file, weights / file.name)
    code, out, err = _run_cli(capsys, command, str(weights), "--mesh", "dp=1")
    assert code == 1 and out == ""
    *stages, error = err.splitlines()  # load names its stages first
    assert stages == ([f"hp-dcp-hf: reading the config of {weights}"] if command == "load" else [])
    assert error == (f"hp-dcp-hf: error: file '{weights / 'config.json'}': no config.json next to the weights, and "
                     "plan and load build the model from it: point PATH at the checkpoint's directory that holds its "
                     "config.json (as save_pretrained writes it), or put the model's config.json there")


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
    assert "layout: tp=2: " in out and "layout: fsdp=2: 5 modules of the fsdp plan + root" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert [lines[header + 2 + r].split()[0] for r in range(4)] == ["0", "1", "2", "3"]
    assert "rank 3 read items:" in out
    # the rewritten names are the destinations, the checkpoint's original names the sources
    assert "mlp.experts.w13" in out and "block_sparse_moe.experts.0.w1.weight" in out
    # the closing note: replication and coalescing apart (a memory mapping reads no holes)
    assert "several ranks need some of the same checkpoint bytes and each reads its own copy" in out
    assert "of what they read, 0 B are holes between the ranges a rank needs" in out


def test_plan_closing_note_names_coalescing_holes(capsys, llama):
    code, out, err = _run_cli(capsys, "plan", str(llama.path), "--mesh", MESH, "--no-map", "--coalesce-gap", "64")
    assert code == 0, err
    _, out_json, _ = _run_cli(capsys, "plan", str(llama.path), "--mesh", MESH, "--no-map", "--coalesce-gap", "64",
                              "--json")
    plan = json.loads(out_json)
    holes = sum(r["bytes_to_read"] - r["bytes_needed"] for r in plan["ranks"])
    assert holes > 0 and plan["cluster"]["holes"] == holes
    note, replicas = out.strip().splitlines()[-2:]
    assert note.startswith("the ranks read ") and replicas.startswith("several ranks need some of the same ")
    assert f"of what they read, {fmt_bytes(holes)} are holes between the ranges a rank needs" in note, note


def test_plan_names_the_coordinate_dims_and_speaks_of_replicas_only_where_there_are(capsys, llama):
    code, out, err = _run_cli(capsys, "plan", str(llama.path), "--mesh", "dp=2")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("rank "))
    assert header.split()[:3] == ["rank", "coord", "(dp)"]
    assert not any("replicas" in line for line in lines), out  # FSDP alone: each byte needed by one rank
    _, out, _ = _run_cli(capsys, "plan", str(llama.path), "--mesh", "dp_replicate=2", "--no-map")
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert header.split()[:3] == ["rank", "coord", "(dp_replicate)"]
    _, checkpoint, _ = _run_cli(capsys, "inspect", str(llama.path), "--json")
    replicated = json.loads(checkpoint)["tensor_bytes"]  # both replicas need every byte
    assert out.splitlines()[-1] == (
        "several ranks need some of the same checkpoint bytes and each reads its own copy: the ranks' shards need "
        f"{fmt_bytes(2 * replicated)} in all, {fmt_bytes(replicated)} more than the {fmt_bytes(replicated)} they "
        "need between them (2.00x); --cooperate always reads each byte once (the default, auto, does on remote "
        "stores and shared file systems where that pays)")
    assert "cluster read amplification 2.000 (bytes read from storage / the " in out


def test_mapped_reads_are_runs_not_requests(capsys, llama):
    code, out, err = _run_cli(capsys, "plan", str(llama.path), "--mesh", "dp=1")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("rank ")).split()
    assert "runs" in header and "requests" not in header
    assert "(runs: contiguous byte runs copied out of the files' memory mappings" in out
    _, out, _ = _run_cli(capsys, "plan", str(llama.path), "--mesh", "dp=1", "--no-map")
    header = next(line for line in out.splitlines() if line.startswith("rank ")).split()
    assert "requests" in header and "runs" not in header and "(runs:" not in out


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
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.storage.read.recording import RecordingReader
    from hp_dcp_hf.tools.rank_plans import parallelize_for

    out = {}
    for name, (path, transforms, options) in cases.items():
        reader = RecordingReader(path, **options)
        parallelize = parallelize_for(MESH)
        _, report = from_pretrained(path, dtype=torch.float32, transforms=transforms, parallelize=parallelize, reader=reader)
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
    assert list(row["phases"]) == ["metadata", "plan", "spans", "read", "copy", "exchange", "finalize"]
    assert row["phases"]["copy"] == 0.0  # CPU tensors: nothing is copied to a device
    code, out, err = _run_cli(capsys, "load", str(llama.path))
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert header.split() == ["rank", "bytes", "needed", "read", "from", "storage", "runs", "load", "s", "metadata",
                              "s", "plan", "s", "spans", "s", "read", "s", "copy", "s", "exchange", "s", "finalize",
                              "s", "GB/s"]
    assert "read amplification 1.000 (bytes read from storage / bytes the shards need, each rank its own)" in out
    assert "(runs: contiguous byte runs copied out of the files' memory mappings" in out
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--no-map")
    assert code == 0, err
    assert next(line for line in out.splitlines() if line.startswith("rank ")).split()[6] == "requests"
    assert "(runs:" not in out


def test_load_names_its_stages_and_progress_on_rank_0(capsys, llama, tmp_path, monkeypatch):
    from hp_dcp_hf.tools import progress

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a line at every update, not every few seconds
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--save-to", str(tmp_path / "saved"), "--json")
    assert code == 0, err
    (row,) = json.loads(out)["ranks"]
    lines = err.splitlines()
    assert all(line.startswith("hp-dcp-hf: ") for line in lines), err
    assert lines[:4] == [f"hp-dcp-hf: reading the config of {llama.path}",
                         "hp-dcp-hf: building LlamaForCausalLM (torch.bfloat16) on the meta device",
                         "hp-dcp-hf: parallelizing", "hp-dcp-hf: allocating the local shards on cpu"]
    loading = [line for line in lines if line.startswith("hp-dcp-hf: rank 0 loading: ")]
    assert len(loading) > 2 and f"{fmt_bytes(row['bytes_read'])} of {fmt_bytes(row['bytes_read'])} (100%)" in loading[-1]
    saving = [line.removeprefix("hp-dcp-hf: rank 0 saving: ") for line in lines if "rank 0 saving" in line]
    done = [float(line.split()[0]) for line in saving]  # KiB: the tiny llama is under 1 MiB
    assert len(saving) > 2 and done == sorted(done) and done[0] == 0, saving
    total = fmt_bytes(row["bytes_written"])
    assert saving[-1].startswith(f"{total} of {total} (100%), ") and lines[-1].startswith("hp-dcp-hf: rank 0 saving")


def test_warnings_and_logs_print_one_clean_line(capsys):
    import logging
    import warnings

    from hp_dcp_hf import errors
    from hp_dcp_hf.tools.cli.messages import messages

    with warnings.catch_warnings(record=True) as shown_by_python, messages():
        warnings.simplefilter("always")
        warnings.warn_explicit("left whole:\n  a\n  b", UserWarning, errors.__file__, 10)  # any module of the package
        logging.getLogger("hp_dcp_hf.load.api").warning("%d tensors unused", 3)
        logging.getLogger("hp_dcp_hf.mapping.compose").info("a planning detail")  # not a stage: not shown
        warnings.warn_explicit("not ours", UserWarning, __file__, 20)  # another module's: Python's own way
    assert capsys.readouterr().err.splitlines() == ["hp-dcp-hf: warning: left whole: a b",
                                                    "hp-dcp-hf: warning: 3 tensors unused"]
    assert [str(w.message) for w in shown_by_python] == ["not ours"]
    with messages(rank=1):
        logging.getLogger("hp_dcp_hf.integrations.transformers").info("parallelizing")  # stages: rank 0's alone
        logging.getLogger("hp_dcp_hf.load.api").error("failed")
    assert capsys.readouterr().err == "hp-dcp-hf: rank 1: error: failed\n"
    logging.getLogger("hp_dcp_hf.integrations.transformers").info("after the command")
    assert capsys.readouterr().err == ""


def test_the_writer_reports_each_rank_s_bytes_as_it_writes(llama, tmp_path):
    from hp_dcp_hf.save.api import save_hf_checkpoint
    from hp_dcp_hf.storage import HFStorageWriter

    calls = []
    writer = HFStorageWriter(tmp_path / "saved", max_shard_size="20KB", progress=lambda done, total: calls.append(
        (done, total)))
    save_hf_checkpoint(llama.build_model(), str(tmp_path / "saved"), writer=writer)
    total = writer.bytes_written
    assert total == sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
                        for f in (tmp_path / "saved").glob("*.safetensors"))
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) > 2
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert {t for _, t in calls} == {total}


def test_legacy_amplification_is_over_what_the_shards_need(capsys, llama):
    """The legacy loader reads whole tensors: its amplification is bytes read over what the shards
    need (what the dcp loader's planner plans for the same layout), here on rank 1 of dp=2,tp=2
    under the fake group."""
    from hp_dcp_hf.load.planner import HFMappingPlanner
    from hp_dcp_hf.model.config import read_config, resolve_model_class
    from hp_dcp_hf.parallel.mesh import parse_mesh
    from hp_dcp_hf.storage import HFStorageReader
    from hp_dcp_hf.tools.fake_ranks import fake_rank, register_fake_backend
    from hp_dcp_hf.tools.progress import progress_planner
    from hp_dcp_hf.tools.rank_plans import rank_model

    register_fake_backend()
    reader = HFStorageReader(str(llama.path))
    metadata = reader.read_metadata()
    config = read_config(str(llama.path))
    with fake_rank(1, 4):
        model, mapping, _ = rank_model(parse_mesh(MESH), config, resolve_model_class(config), torch.bfloat16, ())
        planner = progress_planner(False, shard_bytes=True)(model, weights_mapping=mapping, trace=False)
        planner.set_up_planner(model.state_dict(), metadata)
        planner.create_local_plan()
        dcp = HFMappingPlanner(model, weights_mapping=mapping)
        dcp.plan_reads(model.state_dict(), metadata)
    assert type(planner).last is planner
    assert planner.shard_bytes == dcp.stats.bytes_needed
    assert planner.stats.bytes_needed == sum(e.nbytes for e in reader.entries.values()) > 3 * planner.shard_bytes
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--loader", "legacy")
    assert code == 0, err
    assert ("read amplification 1.000 (bytes read from storage / bytes the shards need, each rank its own; the "
            "legacy loader reads whole tensors, then keeps the shards)\nloaded ") in out  # one rank: whole tensors


def test_load_verify_reads_each_checkpoint_byte_once(capsys, llama):
    """``load --verify``: the loaded shards compared with the checkpoint's bytes, every one read."""
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--verify", "--json")
    assert code == 0, err
    (row,) = json.loads(out)["ranks"]
    tensor_bytes = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
                       for f in llama.path.glob("*.safetensors"))
    assert row["verified"]["read"]["bytes_read"] == tensor_bytes and row["verified"]["absent"] == []
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--verify")
    assert code == 0, err
    assert "slices of the checkpoint's tensors" in out and "equal to the checkpoint's" in out


def test_load_save_to_writes_the_checkpoint_back(capsys, llama, tmp_path):
    """``load --save-to``: the loaded model saved back is the checkpoint it came from."""
    from tests.support.checkpoints import assert_same_checkpoint
    from tests.support.models import DEFAULT_SHARD_SIZE

    code, out, err = _run_cli(capsys, "load", str(llama.path), "--dtype", "bfloat16", "--json",
                              "--save-to", str(tmp_path / "saved"), "--max-shard-size", str(DEFAULT_SHARD_SIZE))
    assert code == 0, err
    (row,) = json.loads(out)["ranks"]
    assert row["bytes_written"] == sum(f.stat().st_size for f in llama.path.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in llama.path.glob("*.safetensors"))
    assert_same_checkpoint(tmp_path / "saved", llama.path)


def test_load_save_to_keeps_the_source_s_layout(capsys, llama, tmp_path):
    """Without ``--max-shard-size`` a sharded source comes back as the same files holding the same
    tensors (save_pretrained's split at the source's largest file), not as one 50 GB-limit file."""
    from tests.support.checkpoints import assert_same_checkpoint

    assert len(list(llama.path.glob("*.safetensors"))) > 2
    code, _, err = _run_cli(capsys, "load", str(llama.path), "--dtype", "float32", "--save-to", str(tmp_path / "saved"))
    assert code == 0, err
    assert_same_checkpoint(tmp_path / "saved", llama.path)


def test_load_save_to_keeps_the_checkpoint_s_dtype(capsys, llama, tmp_path):
    """A bf16 checkpoint loaded into a float32 model saves back as bf16: every file's bytes are the
    checkpoint's but for the save id in the headers; ``--save-dtype model`` writes float32 and says
    so in config.json."""
    from hp_dcp_hf.storage.format.journal import SAVE_ID_KEY
    from tests.support.checkpoints import anonymized
    from tests.support.models import DEFAULT_SHARD_SIZE

    code, _, err = _run_cli(capsys, "load", str(llama.path), "--dtype", "float32", "--save-to",
                            str(tmp_path / "saved"), "--max-shard-size", str(DEFAULT_SHARD_SIZE))
    assert code == 0, err
    theirs = {p.name: p.read_bytes() for p in llama.path.iterdir()}
    ours = {p.name: p.read_bytes() for p in (tmp_path / "saved").iterdir()}
    assert sorted(ours) == sorted(theirs)
    for name, data in anonymized(ours).items():
        if name.endswith(".safetensors"):  # the header's only addition is the save id, padded to 8 bytes
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            assert header["__metadata__"].pop(SAVE_ID_KEY) == "0" * 32
            original = theirs[name]
            length = int.from_bytes(original[:8], "little")
            assert header == json.loads(original[8:8 + length])
            assert data[8 + int.from_bytes(data[:8], "little"):] == original[8 + length:]  # tensor bytes
        elif name != "model.safetensors.index.json":
            assert data == theirs[name], name
    code, _, err = _run_cli(capsys, "load", str(llama.path), "--dtype", "float32", "--save-to", str(tmp_path / "fp32"),
                            "--save-dtype", "model")
    assert code == 0, err
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("rank, world", [(None, None), (0, 2), (1, 2)])
def test_load_mesh_larger_than_the_launch_names_torchrun_once(capsys, llama, monkeypatch, rank, world):
    import torch.distributed as dist

    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    code, out, err = _run_cli(capsys, "load", str(llama.path), "--mesh", "dp=2,tp=2")
    assert code == 1 and out == ""
    assert not dist.is_initialized()  # refused before any process group
    if rank:  # not rank 0: silent, rank 0 says it for everyone
        assert err == ""
        return
    assert err.count("\n") == 1 and err.count("torchrun") == 1, err
    assert f"launched; launch with `torchrun --nproc-per-node 4 -m hp_dcp_hf load {llama.path} --mesh dp=2,tp=2`" in err
    assert ("1 process was launched" if world is None else "2 processes were launched") in err


def test_plan_with_span_ownership_reads_the_checkpoint_once(capsys, llama):
    """HSDP x TP: two replicas of every TP shard; cooperating, the ranks read each byte once between
    them, in spans, and each receives from the spans' owners what it needs of the rest."""
    args = ("plan", str(llama.path), "--mesh", "dp_replicate=2,tp=2", "--cooperate")
    _, direct, _ = _run_cli(capsys, *args, "never", "--json")
    code, shared, err = _run_cli(capsys, *args, "always", "--json")
    assert code == 0, err
    direct, shared = json.loads(direct), json.loads(shared)
    assert not direct["cooperative"] and shared["cooperative"]
    checkpoint = shared["checkpoint_bytes"]
    assert sum(r["bytes_to_read"] for r in direct["ranks"]) >= 2 * checkpoint
    assert sum(r["bytes_to_read"] for r in shared["ranks"]) == checkpoint
    assert sum(r["bytes_from_peers"] for r in shared["ranks"]) == sum(r["bytes_to_peers"] for r in shared["ranks"]) > 0
    assert [r["bytes_needed"] for r in direct["ranks"]] == [r["bytes_needed"] for r in shared["ranks"]]
    for rank in shared["ranks"]:  # its spans, file by file
        assert rank["requests"] == sum(f["requests"] for f in rank["files"].values())
        assert rank["bytes_to_read"] == sum(f["bytes"] for f in rank["files"].values())
    code, out, err = _run_cli(capsys, *args, "always")
    assert code == 0, err
    assert "received from peers" in out and "span ownership: each needed byte is read from storage by one rank" in out


def test_plan_cooperation_figures_name_what_they_count(capsys, llama):
    """Cooperating on HSDP x TP, with a coalescing gap: each rank's bytes read from storage and
    received from peers, and the cluster's figures: its reads over the checkpoint bytes it needs,
    each counted once (not over the ranks' needs summed, which count a replicated byte twice),
    and holes that are never negative."""
    args = ("plan", str(llama.path), "--mesh", "dp_replicate=2,tp=2", "--cooperate", "always", "--no-map",
            "--coalesce-gap", "64")
    code, out, err = _run_cli(capsys, *args, "--json")
    assert code == 0, err
    plan = json.loads(out)
    cluster, ranks, checkpoint = plan["cluster"], plan["ranks"], plan["checkpoint_bytes"]
    assert cluster["bytes_needed_once"] == checkpoint  # every byte is needed by some rank
    # two replicas, and inside each the bytes both TP ranks need (norms, the halves of rows)
    assert cluster["bytes_needed_by_shards"] == sum(r["bytes_needed"] for r in ranks) > 2 * checkpoint
    assert cluster["bytes_read"] == sum(r["bytes_to_read"] for r in ranks) == checkpoint
    assert cluster["holes"] == 0 and cluster["read_amplification"] == 1.0
    assert cluster["bytes_received"] == sum(r["bytes_from_peers"] for r in ranks) > 0
    for rank in ranks:  # what a rank needs and does not read itself, it receives
        assert 0 < rank["bytes_from_peers"] <= rank["bytes_needed"]
    code, out, err = _run_cli(capsys, *args)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("rank "))
    assert "read from storage" in header and "received from peers" in header and "sent to peers" in header
    assert f"cluster read amplification 1.000 (bytes read from storage / the {fmt_bytes(checkpoint)} of the " in out
    assert "of what they read, 0 B are holes no rank needs" in out
    assert f"the ranks' shards need {fmt_bytes(cluster['bytes_needed_by_shards'])} in all" in out
    assert f"{fmt_bytes(cluster['bytes_received'])} received in all" in out


def _cli_load_output(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    """``hp-dcp-hf load ARGV`` on this rank of a launched group: its exit code and what it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["load", *argv])
    return code, out.getvalue()


def test_load_table_cooperating_names_bytes_read_from_storage_and_received(llama):
    """Two HSDP replicas cooperating: each rank reads part of the checkpoint from storage and
    receives the rest from the other; the table has a column for both, and the amplification is
    the cluster's: its reads over the checkpoint bytes it needs, each counted once (1.000, where
    bytes read over the ranks' needs summed would be 0.500)."""
    argv = [str(llama.path), "--mesh", "dp_replicate=2", "--cooperate", "always"]
    (code, text), (other, quiet) = run_ranks(2, _cli_load_output, [*argv, "--json"], timeout=300)
    assert code == other == 0 and quiet == ""  # rank 0 prints for both
    rows = json.loads(text)["ranks"]
    from hp_dcp_hf.tools.inspection import inspect_checkpoint

    checkpoint = inspect_checkpoint(str(llama.path))["tensor_bytes"]
    assert all(r["cooperating"] and r["bytes_needed_once"] == checkpoint for r in rows)
    assert sum(r["bytes_read"] for r in rows) == checkpoint
    for r in rows:  # each replica needs every byte: what it did not read, it received
        assert r["bytes_needed"] == checkpoint == r["bytes_read"] + r["bytes_received"] and r["bytes_received"] > 0
    (code, text), _ = run_ranks(2, _cli_load_output, argv, timeout=300)
    assert code == 0
    header = next(line for line in text.splitlines() if line.startswith("rank "))
    assert header.split()[:9] == ["rank", "bytes", "needed", "read", "from", "storage", "received", "from", "peers"]
    assert (f"cluster read amplification 1.000 (the {fmt_bytes(checkpoint)} the ranks read from storage / the "
            f"{fmt_bytes(checkpoint)} of the checkpoint they read for, each byte counted once); the ranks' shards "
            f"need {fmt_bytes(2 * checkpoint)} in all") in text
    assert f"{fmt_bytes(sum(r['bytes_received'] for r in rows))} received in all" in text


# -- --unexpected --------------------------------------------------------------------------------

EXTRA = "model.layers.0.mlp.extra_proj.weight"


@pytest.fixture(scope="module")
def with_extra_tensor(tiny_checkpoints, tmp_path_factory):
    """The single-file tiny llama with one more tensor, which no model tensor is made from."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoints("llama", torch.bfloat16, max_shard_size=None).path
    path = tmp_path_factory.mktemp("extra") / "llama"
    shutil.copytree(source, path)
    with safe_open(source / "model.safetensors", "pt") as handle:
        metadata = handle.metadata()
    save_file(load_file(source / "model.safetensors") | {EXTRA: torch.ones(4, 4, dtype=torch.bfloat16)},
              path / "model.safetensors", metadata=metadata)
    return path


UNEXPECTED_WARNING = (f"1 checkpoint tensors make no model tensor: ['{EXTRA}'] (--unexpected ignore silences "
                      "this, raise refuses the load)")


@pytest.mark.parametrize("choice", ["warn", "ignore", "raise"])
def test_plan_unexpected(capsys, with_extra_tensor, choice):
    argv = ["plan", str(with_extra_tensor), "--mesh", "dp=1", "--unexpected", choice]
    code, out, err = _run_cli(capsys, *argv)
    if choice == "raise":
        assert code == 1 and out == ""
        assert err == (f"hp-dcp-hf: error: 1 checkpoint tensors make no model tensor (unexpected='raise'): "
                       f"['{EXTRA}']\n")
        return
    assert code == 0 and err == ""
    assert (f"  unexpected: {UNEXPECTED_WARNING}" in out.splitlines()) == (choice == "warn")
    _, out, _ = _run_cli(capsys, *argv, "--json")
    assert json.loads(out)["unexpected"] == ([EXTRA] if choice == "warn" else [])


@pytest.mark.parametrize("choice", ["warn", "ignore", "raise"])
def test_load_unexpected(capsys, with_extra_tensor, choice):
    code, out, err = _run_cli(capsys, "load", str(with_extra_tensor), "--unexpected", choice)
    stages = [line for line in err.splitlines() if not line.startswith(("hp-dcp-hf: warning", "hp-dcp-hf: error"))]
    told = err.splitlines()[len(stages):]
    if choice == "raise":
        assert code == 1 and out == ""
        assert told == [f"hp-dcp-hf: error: 1 checkpoint tensors make no model tensor (unexpected='raise'): "
                        f"['{EXTRA}']"]
        return
    assert code == 0
    assert "unexpected 1, " in out  # the report counts it whatever the choice
    warning = (f"hp-dcp-hf: warning: 1 tensors of {with_extra_tensor} make no model tensor (UNEXPECTED; "
               f"unexpected='ignore' silences this, 'raise' refuses such loads): ['{EXTRA}']")
    assert told == ([warning] if choice == "warn" else [])

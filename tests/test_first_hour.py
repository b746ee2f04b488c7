"""What a newcomer from transformers or torch DCP meets first: the dtype default, strictness about
tensors the model does not use, a checkpoint of another architecture, nested state dicts, typed
mesh-spec errors, and failures that print one line (no DCP traceback), also under torchrun."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, from_pretrained, load_hf_checkpoint
from hp_dcp_hf.errors import (
    ArchitectureMismatchError,
    ArgumentError,
    CheckpointNotFoundError,
    HPDCPHFError,
    MeshSpecError,
    UnexpectedKeysError,
)
from hp_dcp_hf.model.dtype import parse_dtype
from hp_dcp_hf.model.finalize import materialize
from hp_dcp_hf.model.skeleton import build_skeleton
from hp_dcp_hf.parallel.mesh import parse_mesh
from tests.support.models import model_class, tiny_config

REPO = Path(__file__).resolve().parents[1]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- dtype ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_default_dtype_is_the_one_transformers_from_pretrained_picks(tiny_checkpoints, dtype):
    ckpt = tiny_checkpoints("llama", dtype)
    theirs = model_class("llama").from_pretrained(ckpt.path)  # transformers' own default
    ours, _ = from_pretrained(str(ckpt.path))
    assert {p.dtype for p in theirs.state_dict().values()} == {dtype}
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in theirs.state_dict().items()}
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_the_model_is_named_after_its_checkpoint_as_transformers_names_it(tiny_checkpoints):
    """``model.name_or_path`` is the path given (what peft writes as ``base_model_name_or_path``),
    and it stays out of ``config.json``."""
    ckpt = tiny_checkpoints("llama", torch.float32)
    theirs = model_class("llama").from_pretrained(ckpt.path)
    ours, _ = from_pretrained(str(ckpt.path))
    assert ours.name_or_path == theirs.name_or_path == str(ckpt.path)
    assert "name_or_path" not in ours.config.to_json_string(use_diff=True)


def test_auto_without_a_config_dtype_takes_the_checkpoints_first_floating_dtype(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints("llama", torch.bfloat16).path, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    theirs = model_class("llama").from_pretrained(path)
    ours, _ = from_pretrained(str(path), dtype="auto")
    assert theirs.model.embed_tokens.weight.dtype == ours.model.embed_tokens.weight.dtype == torch.bfloat16


def test_dtype_names_as_transformers_takes_them(tiny_checkpoints):
    assert parse_dtype("bfloat16") is parse_dtype("bf16") is parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float16) is torch.float16
    model, _ = from_pretrained(str(tiny_checkpoints("llama").path), dtype="float16")
    assert model.lm_head.weight.dtype == torch.float16
    with pytest.raises(ArgumentError, match="unknown dtype 'float33'") as caught:
        from_pretrained(str(tiny_checkpoints("llama").path), dtype="float33")
    assert isinstance(caught.value, ValueError)


# -- tensors the model does not use --------------------------------------------------------------


@pytest.fixture(scope="module")
def four_layers(tiny_checkpoints):
    """A 4-layer llama checkpoint; the tests load it into the 2-layer model."""
    return tiny_checkpoints("llama", num_hidden_layers=4)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hp_dcp_hf") and r.levelno >= logging.WARNING]


def test_unused_checkpoint_tensors_are_warned_about_once_with_their_number_and_first_names(four_layers, caplog):
    with caplog.at_level(logging.WARNING):
        _, report = from_pretrained(str(four_layers.path), config=tiny_config("llama"))
    unused = [k for k in report.unexpected_keys if ".layers.2." in k or ".layers.3." in k]
    assert len(unused) == len(report.unexpected_keys) == 18  # 9 tensors per llama layer
    [message] = _warnings(caplog)
    assert message.startswith(f"18 tensors of {four_layers.path} make no model tensor (UNEXPECTED")
    assert "'model.layers.2.input_layernorm.weight'" in message and "(13 more)" in message


def test_unexpected_raise_refuses_before_any_write_and_ignore_is_silent(four_layers, caplog):
    model = materialize(build_skeleton(tiny_config("llama"), model_class("llama")))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(7)
    before = _params(model)
    with pytest.raises(UnexpectedKeysError, match=r"18 checkpoint tensors make no model tensor \(unexpected='raise'\)"):
        load_hf_checkpoint(model, str(four_layers.path), unexpected="raise")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with caplog.at_level(logging.WARNING):
        report = load_hf_checkpoint(model, str(four_layers.path), unexpected="ignore")
    assert len(report.unexpected_keys) == 18 and not _warnings(caplog)
    with pytest.raises(ArgumentError, match="unexpected must be one of"):
        load_hf_checkpoint(model, str(four_layers.path), unexpected="quiet")


def test_tensors_transformers_ignores_for_the_class_are_not_warned_about(tiny_checkpoints, tmp_path, caplog):
    """Old checkpoints carry per-layer ``rotary_emb.inv_freq``: transformers does not report them."""
    path = _copy(tiny_checkpoints("llama", max_shard_size=None).path, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        _, report = from_pretrained(str(path))
        load_hf_checkpoint(from_pretrained(str(path))[0], str(path), unexpected="raise")
    assert report.unexpected_keys == ("model.layers.0.self_attn.rotary_emb.inv_freq",)
    assert not _warnings(caplog)


# -- another architecture ------------------------------------------------------------------------


def test_a_model_class_of_another_type_is_named_not_crashed_on(mixtral_checkpoint):
    with pytest.raises(ArchitectureMismatchError) as caught:
        from_pretrained(str(mixtral_checkpoint.path), model_cls=model_class("llama"))
    message = str(caught.value)
    assert "config.json" in message and "'mixtral'" in message and "MixtralForCausalLM" in message
    assert "LlamaForCausalLM a 'llama' one" in message


def test_missing_keys_from_another_architecture_say_what_config_json_names(mixtral_checkpoint):
    model = materialize(build_skeleton(tiny_config("llama"), model_class("llama")))
    with pytest.raises(ArchitectureMismatchError) as caught:
        load_hf_checkpoint(model, str(mixtral_checkpoint.path))
    message = str(caught.value)
    assert message.startswith("file 'config.json': config.json names model_type 'mixtral' (architectures "
                              "['MixtralForCausalLM']), but the model is a 'llama' one (LlamaForCausalLM)")
    assert "model_cls" not in message  # load_hf_checkpoint takes no model class
    assert "the checkpoint makes no value for" in message  # the missing keys are still listed


def test_shapes_from_another_architecture_say_first_what_config_json_names(mixtral_checkpoint):
    """A Llama of other sizes than the Mixtral checkpoint's: the shapes disagree (a MappingError
    listing each tensor), and the first words say why: config.json names mixtral."""
    model = materialize(build_skeleton(tiny_config("llama", hidden_size=48), model_class("llama")))
    with pytest.raises(ArchitectureMismatchError) as caught:
        load_hf_checkpoint(model, str(mixtral_checkpoint.path))
    message = str(caught.value)
    assert message.startswith("file 'config.json': config.json names model_type 'mixtral'"), message
    assert "hp_dcp_hf.from_pretrained(path) builds one from config.json" in message and "model_cls" not in message
    assert "model tensors do not match the checkpoint" in message  # the shapes are still listed


# -- nested state dicts --------------------------------------------------------------------------


class _ModelState(Stateful):
    """A ``Stateful`` wrapper, as torchtitan's checkpointer hands DCP the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.model.load_state_dict(state_dict)


@pytest.mark.parametrize("wrap", ["dict", "stateful"])
def test_a_state_dict_nested_under_one_key_loads_as_dcp_users_write_it(mixtral_checkpoint, wrap):
    config = tiny_config("mixtral")
    model = materialize(build_skeleton(config, model_class("mixtral"), dtype=torch.bfloat16))
    state = {"model": model.state_dict() if wrap == "dict" else _ModelState(model)}
    dcp.load(state, storage_reader=HFStorageReader(str(mixtral_checkpoint.path)), planner=HFMappingPlanner(model),
             no_dist=True)
    reference = mixtral_checkpoint.reference()
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), key


def test_other_nestings_are_refused_with_what_to_pass(llama_checkpoint):
    model = materialize(build_skeleton(tiny_config("llama"), model_class("llama")))
    state = {"model": model.state_dict(), "optimizer": {"step": torch.zeros(())}}
    # dcp.load wraps the planner's PlanningError in its CheckpointException
    with pytest.raises(CheckpointException, match=r"PlanningError: .* under one key \(\{'model': model.state_dict\(\)\}\)"):
        dcp.load(state, storage_reader=HFStorageReader(str(llama_checkpoint.path)), planner=HFMappingPlanner(model),
                 no_dist=True)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["dp=2,tq=2", "dp=two", "dp=2,dp=2", "ep=3,tp=2"])
def test_mesh_spec_typos_are_typed(spec):
    with pytest.raises(MeshSpecError, match=f"mesh spec '{spec}'") as caught:
        parse_mesh(spec)
    assert isinstance(caught.value, HPDCPHFError) and isinstance(caught.value, ValueError)


def _without_a_shard(src: Path, dst: Path) -> Path:
    path = _copy(src, dst)
    (path / "model-00002-of-00003.safetensors").unlink()
    return path


def test_a_failed_load_leaves_no_dcp_traceback_in_the_log(tiny_checkpoints, tmp_path, caplog, capfd):
    ckpt = tiny_checkpoints("llama", max_shard_size="20KB")
    path = _without_a_shard(ckpt.path, tmp_path / "ckpt")
    with caplog.at_level(logging.DEBUG), pytest.raises(CheckpointNotFoundError):
        from_pretrained(str(path))
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert "Global metadata is not found" not in capfd.readouterr().err


def test_a_failed_load_under_torchrun_prints_one_line_from_rank_0(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama", max_shard_size="20KB")
    assert (ckpt.path / "model-00002-of-00003.safetensors").exists()
    path = _without_a_shard(ckpt.path, tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hp_dcp_hf", "load", str(path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert run.returncode != 0
    [ours] = [line for line in run.stderr.splitlines() if line.startswith("hp-dcp-hf: error")]
    assert ours.startswith("hp-dcp-hf: error: on rank 0: file 'model-00002-of-00003.safetensors', key '"), ours
    assert ours.endswith("': model.safetensors.index.json maps keys to a missing file"), ours
    assert "Global metadata is not found" not in run.stderr
    assert "hp_dcp_hf/" not in run.stderr  # no traceback through our code; torchrun's own summary may follow


def test_output_piped_into_a_reader_that_stops_early_ends_quietly(mixtral_checkpoint):
    """``hp-dcp-hf inspect PATH --tensors | head -1``: the reader is gone before the listing is
    printed; the command exits 0 without an error line (nor Python's "Exception ignored")."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "hp_dcp_hf", "inspect", str(mixtral_checkpoint.path), "--tensors"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    proc.stdout.close()  # as head does after its line, here before the first one: every print hits a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(capsys, mixtral_checkpoint, monkeypatch):
    """A ``BrokenPipeError`` from elsewhere (a connection to storage) while stdout is fine is an
    error, as any other."""
    from hp_dcp_hf.tools import cli, inspection

    def broken(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(inspection, "inspect_checkpoint", broken)
    read_end, write_end = os.pipe()  # stdout a pipe whose reader is still there
    with os.fdopen(write_end, "w") as stdout, os.fdopen(read_end) as _:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert cli.main(["inspect", str(mixtral_checkpoint.path)]) == 1
    assert capsys.readouterr().err == "hp-dcp-hf: error: BrokenPipeError: [Errno 32] Broken pipe\n"

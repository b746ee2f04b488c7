"""Failures on several ranks: every rank raises the same clear error promptly, nobody hangs."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from hp_dcp_hf import HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import ArchitectureMismatchError, MappingError, StorageReadError
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.layouts import apply_layout
from tests.support.models import model_class, tiny_config


def _model(model_type: str, world: int, **overrides):
    torch.manual_seed(1)
    model = model_class(model_type)(tiny_config(model_type, **overrides))
    apply_layout(model, "shard0", world)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(3.0)
    return model


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as error:  # the test inspects which error every rank saw
        return type(error).__name__, str(error)
    return "no error", ""


def _unchanged_after(model, fn) -> tuple[tuple[str, str], bool]:
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    outcome = _outcome(fn)
    after = model.state_dict()
    return outcome, all(torch.equal(after[k].to_local(), v) for k, v in before.items())


def _planning_failures(rank: int, world: int, llama: str, mixtral: str) -> dict:
    wrong_size = _model("llama", world, intermediate_size=42)
    wrong_arch = _model("mixtral", world)
    return {
        "size": _unchanged_after(wrong_size, lambda: load_hf_checkpoint(wrong_size, llama)),
        "architecture": _unchanged_after(wrong_arch, lambda: load_hf_checkpoint(wrong_arch, llama)),
    }


def test_mismatches_raise_the_same_error_on_every_rank_before_any_write(tiny_checkpoints):
    llama = str(tiny_checkpoints("llama").path)
    mixtral = str(tiny_checkpoints("mixtral").path)
    results = run_ranks(2, _planning_failures, llama, mixtral, timeout=120)
    for case, error_type in (("size", MappingError), ("architecture", ArchitectureMismatchError)):
        # every rank raises the first failing rank's error: rank 0's own, the others a copy naming it
        outcomes = {(name, message.replace("on rank 0: ", "")) for name, message in (r[case][0] for r in results)}
        assert len(outcomes) == 1, outcomes
        ((name, message),) = outcomes
        assert name == error_type.__name__
        assert all(r[case][1] for r in results), f"{case}: a rank's model changed"
    assert "model expects (42, 44), checkpoint makes (43, 44)" in results[0]["size"][0][1]
    assert "config.json names model_type 'llama'" in results[0]["architecture"][0][1]  # named, with the missing keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in results[0]["architecture"][0][1]


def _unreadable_on_rank_one(rank: int, world: int, path: str, mapped: bool) -> tuple[str, str, tuple[str, ...]]:
    model = _model("llama", world)
    # the call that fails on a bad disk: preadv, or the mapping (whose pages are read on access)
    call = "mmap.mmap" if mapped else "os.preadv"
    failing = mock.patch(call, side_effect=OSError(5, "Input/output error")) if rank == 1 else None
    try:
        if failing:
            failing.start()
        load_hf_checkpoint(model, path, reader=HFStorageReader(path, map_local_files=mapped))
    except StorageReadError as error:
        return type(error).__name__, str(error), error.touched_keys
    finally:
        if failing:
            failing.stop()
    return "no error", "", ()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])
def test_one_unreadable_rank_fails_every_rank_promptly(tiny_checkpoints, mapped):
    path = str(tiny_checkpoints("llama").path)
    results = run_ranks(2, _unreadable_on_rank_one, path, mapped, timeout=90)
    assert {r[0] for r in results} == {"StorageReadError"}
    assert all("Input/output error" in r[1] and ".safetensors" in r[1] for r in results)
    assert results[1][2] == ()  # rank 1 wrote nothing; rank 0 reports what it had written
    assert os.path.isdir(path)

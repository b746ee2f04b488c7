"""Custom mappings saved back exactly on 2 gloo ranks (the cases of ``tests/test_save_mapping.py``).

Every case's model is sharded row-wise (``Shard(0)``) and non-contiguously (``_StridedShard``,
rank 0 holding chunks 0 and 2 of 4), loaded with ``weights_mapping=M``, and saved with the mapping
the load recorded and with ``M`` given again; the tiny Mixtral goes through ``from_pretrained`` under
TP 2. Every file must hold exactly the checkpoint's keys and bytes, each byte written by one rank.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.save_cases import ALL_CASES, CASES, MIXTRAL, assert_same_weights, weights, write_checkpoint

LAYOUTS = ("shard0", "strided")
SAVES = ("recorded", "given")


def _save(rank: int, world: int, checkpoints: dict[str, str], out: str) -> dict[str, int]:
    import warnings

    from hp_dcp_hf import (
        HFSavePlanner,
        HFStorageWriter,
        from_pretrained,
        load_hf_checkpoint,
        save_hf_checkpoint,
    )
    from tests.support.families import family_model_class
    from tests.support.layouts import apply_layout
    from tests.support.save_cases import build_source, case_mapping

    written = {}

    def save(model, name: str, mapping) -> None:
        path = os.path.join(out, name)
        writer = HFStorageWriter(path)
        save_hf_checkpoint(model, path, writer=writer, planner=HFSavePlanner(model, weights_mapping=mapping))
        written[name] = writer.bytes_written

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in CASES:
            for layout in LAYOUTS:
                model = build_source(case, seed=1)
                apply_layout(model, layout, world)
                load_hf_checkpoint(model, checkpoints[case], weights_mapping=case_mapping(case))
                save(model, f"{case}/{layout}/recorded", None)
                save(model, f"{case}/{layout}/given", case_mapping(case))
        model, _ = from_pretrained(checkpoints[MIXTRAL], dtype=torch.float32, model_cls=family_model_class("mixtral"),
                                   distributed_config="tp=2", weights_mapping=case_mapping(MIXTRAL))
        save(model, f"{MIXTRAL}/tp2/recorded", None)
        save(model, f"{MIXTRAL}/tp2/given", case_mapping(MIXTRAL))
    return written


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("save-mapping-dist")
    checkpoints = {case: write_checkpoint(case, root / "checkpoints" / case) for case in ALL_CASES}
    written = run_ranks(2, _save, {c: str(p) for c, p in checkpoints.items()}, str(root / "out"), timeout=400)
    return checkpoints, root / "out", written


def _runs() -> list[str]:
    return [f"{case}/{layout}/{how}" for case in CASES for layout in LAYOUTS for how in SAVES] + \
           [f"{MIXTRAL}/tp2/{how}" for how in SAVES]


@pytest.mark.parametrize("run", _runs())
def test_2_ranks_write_the_checkpoint(saved, run):
    checkpoints, out, written = saved
    case = run.split("/")[0]
    assert_same_weights(out / run, checkpoints[case])
    assert sum(w[run] for w in written) == _tensor_bytes(checkpoints[case])  # each byte once
    assert all(w[run] > 0 for w in written)  # both ranks write


def _tensor_bytes(directory: Path) -> int:
    return sum(math.prod(t.shape) * t.element_size() for tensors in weights(directory).values()
               for t in tensors.values())

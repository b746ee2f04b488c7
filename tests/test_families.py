"""The family matrix: every buildable model type of transformers' conversion table loads exactly.

For each family of :data:`tests.support.families.FAMILIES` (single process, CPU, fp32):

* the tiny checkpoint round-trips: transformers' own ``from_pretrained`` of the files
  ``save_pretrained`` wrote gives back the model that wrote them, bit for bit (so the oracle is
  sound);
* this project's ``hp_dcp_hf.from_pretrained`` (meta skeleton, transformers' conversion mapping,
  DCP load into the unsharded model) gives a state dict bit-identical to that oracle.

Checkpoints are written with ``max_shard_size="100KB"``: the larger families span several files
plus an index, the smaller ones stay one ``model.safetensors``. Each family's checkpoint and
oracle are built once (module-scoped fixture, parametrized by family, so a family's tests run
together and its files are removed before the next family's are written).

A family that transformers loads but this project does not is a bug of the project: it goes to
:data:`KNOWN_PROJECT_FAILURES` (``xfail(strict=True)``), never to ``UNBUILDABLE``.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hp_dcp_hf
from tests.support.families import (
    DIST_FAMILIES,
    FAMILIES,
    MAX_CHECKPOINT_BYTES,
    MOE_FAMILIES,
    UNBUILDABLE,
    build_family_model,
    conversion_op_kinds,
    conversion_table_types,
    family_model_class,
    is_moe,
    load_family_reference,
    save_family_model,
)
from tests.support.symbolic_check import assert_same_plans

SHARD_SIZE = "100KB"

pytestmark = pytest.mark.filterwarnings(
    # transformers' deformable-attention (d_model 40: head dim 10 is not a power of 2) and
    # zero-sized tensors of some tiny configs: noise, not findings
    "ignore:You'd better set embed_dim:UserWarning",
    "ignore:Initializing zero-element tensors is a no-op:UserWarning",
)

#: Families transformers loads but ``hp_dcp_hf.from_pretrained`` does not (reason: the error's
#: last line). Each one runs as ``xfail(strict=True)``: it fails loudly once fixed. None so far.
KNOWN_PROJECT_FAILURES: dict[str, str] = {}


def assert_state_dicts_identical(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    mismatched = [
        key
        for key, value in expected.items()
        if actual[key].dtype != value.dtype
        or actual[key].shape != value.shape
        or not torch.equal(actual[key], value)
    ]
    assert not mismatched, f"{len(mismatched)} tensors differ: {mismatched[:5]}"


# --- the tables -------------------------------------------------------------------------------


def test_tables_cover_the_conversion_table() -> None:
    """FAMILIES + UNBUILDABLE are exactly the conversion table's model types (a transformers
    upgrade that adds or drops one shows up here: re-derive with ``python -m tests.support.families``)."""
    table = conversion_table_types()
    assert len(set(FAMILIES)) == len(FAMILIES), "duplicate families"
    assert not set(FAMILIES) & set(UNBUILDABLE), "a type is both buildable and unbuildable"
    assert set(FAMILIES) | set(UNBUILDABLE) == set(table), (
        f"new: {sorted(set(table) - set(FAMILIES) - set(UNBUILDABLE))}, "
        f"gone: {sorted((set(FAMILIES) | set(UNBUILDABLE)) - set(table))}"
    )
    assert list(FAMILIES) == [t for t in table if t in FAMILIES], "FAMILIES is in table order"
    assert MOE_FAMILIES.issubset(FAMILIES)
    assert set(KNOWN_PROJECT_FAILURES) <= set(FAMILIES)
    assert all(reason for reason in UNBUILDABLE.values())


# --- one family at a time ---------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyCheckpoint:
    model_type: str
    path: Path
    #: State dict of the model that wrote the files.
    written: dict[str, torch.Tensor]
    moe: bool


@functools.cache
def _dist_op_kinds() -> frozenset[str]:
    return frozenset().union(*(conversion_op_kinds(family) for family in DIST_FAMILIES))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyCheckpoint]:
    model = build_family_model(family)
    written = {key: value.detach().clone() for key, value in model.state_dict().items()}
    directory = tmp_path_factory.mktemp(f"family-{family}")
    path = save_family_model(model, directory, max_shard_size=SHARD_SIZE)
    yield FamilyCheckpoint(family, path, written, is_moe(model))
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def family_reference(family_checkpoint: FamilyCheckpoint) -> dict[str, torch.Tensor]:
    """The oracle: transformers' single-process ``from_pretrained`` state dict."""
    return load_family_reference(family_checkpoint.path, family_checkpoint.model_type)


def test_family_checkpoint_roundtrips(
    family_checkpoint: FamilyCheckpoint, family_reference: dict[str, torch.Tensor]
) -> None:
    assert_state_dicts_identical(family_reference, family_checkpoint.written)
    size = sum(t.numel() * t.element_size() for t in family_checkpoint.written.values())
    assert size <= MAX_CHECKPOINT_BYTES
    assert family_checkpoint.moe == (family_checkpoint.model_type in MOE_FAMILIES)


def test_family_conversions_run_on_ranks(family: str) -> None:
    """Every kind of conversion op this family uses also runs in the 2-rank matrix."""
    assert set(DIST_FAMILIES) <= set(FAMILIES)
    assert not conversion_op_kinds(family) - _dist_op_kinds()


def test_family_loads_bit_identical(
    family_checkpoint: FamilyCheckpoint,
    family_reference: dict[str, torch.Tensor],
    request: pytest.FixtureRequest,
) -> None:
    model_type = family_checkpoint.model_type
    if model_type in KNOWN_PROJECT_FAILURES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_PROJECT_FAILURES[model_type]))
    model, report = hp_dcp_hf.from_pretrained(
        str(family_checkpoint.path), model_cls=family_model_class(model_type), dtype=torch.float32
    )
    assert not report.missing_keys
    assert_state_dicts_identical(model.state_dict(), family_reference)


def test_structure_sharing_plans_item_by_item(family_checkpoint: FamilyCheckpoint) -> None:
    """Every family's plan traced once per structure equals its plan traced group by group."""
    model = build_family_model(family_checkpoint.model_type)
    metadata = hp_dcp_hf.HFStorageReader(str(family_checkpoint.path)).read_metadata()
    assert_same_plans(model, metadata)

"""Plain local shards (torch's ``CheckpointableTensor`` protocol) on 2 and 4 gloo ranks: every
parameter a plain local buffer stating its shards (several per tensor, uneven, 2-d boxes, padding
rows and columns), loaded bit-identical to transformers' ``from_pretrained`` (rewritten the same
way for the fused q/k/v and stacked grouped-GEMM experts), each rank reading exactly its shards'
bytes and leaving its padding alone; then saved back equal to ``save_pretrained``'s files, each byte
written once, also where several ranks list one shard (replicas, and shards two ranks share while
the rest of their geometry differs).

One ``run_ranks`` launch per world size runs every case.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.checkpoints import SHARD, assert_same_checkpoint
from tests.support.models import make_checkpoint, model_class, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CASES = {  # world -> (model, rewrites, scheme)
    2: [("llama", (), "rows"), ("llama", (), "grid"), ("llama", (), "overlap"),
        ("mixtral", ("qkv", "experts"), "rows")],
    4: [("llama", (), "rows"), ("llama", (), "grid"), ("llama", (), "replicas"),
        ("mixtral", ("qkv", "experts"), "grid"), ("mixtral", (), "overlap")],
}


def _case_id(case) -> str:
    return f"{case[0]}-{'+'.join(case[1]) or 'plain'}-{case[2]}"


def _cuts(length: int, parts: int) -> list[tuple[int, int]]:
    """``length`` cut into ``parts`` uneven (offset, size) runs (weights 1, 2, 3, 1, 2, 3, ...)."""
    weights = [1 + k % 3 for k in range(parts)]
    bounds = [round(length * sum(weights[:k]) / sum(weights)) for k in range(parts + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def geometry(shape: tuple[int, ...], rank: int, world: int, scheme: str):
    """This rank's shards of a tensor of ``shape``: ``[(global box offsets, sizes)]``, in the order
    they lie in the local buffer.

    - ``rows``: the longest dim cut into ``2 * world`` uneven runs; rank ``r`` holds runs
      ``2w-1-r`` and ``r`` (the later one first in its buffer);
    - ``grid``: 2-d tensors: rows in halves, columns in ``world`` uneven runs; rank ``r`` holds
      (top, column run ``r``) and (bottom, column run ``r+1``); others as ``rows``;
    - ``replicas``: ``rows`` over ``world / 2``, ranks ``r`` and ``r + world/2`` alike;
    - ``overlap``: ``rows``, plus run ``(r+1) % world`` (another rank's): a shard two ranks list.
    """
    ndim = len(shape)
    if scheme == "grid" and ndim == 2:
        rows, cols = _cuts(shape[0], 2), _cuts(shape[1], world)
        return [((rows[0][0], cols[rank][0]), (rows[0][1], cols[rank][1])),
                ((rows[1][0], cols[(rank + 1) % world][0]), (rows[1][1], cols[(rank + 1) % world][1]))]
    if scheme == "replicas":
        rank, world = rank % (world // 2), world // 2
    dim = max(range(ndim), key=lambda d: shape[d])
    runs = _cuts(shape[dim], 2 * world)
    chosen = [runs[2 * world - 1 - rank], runs[rank]]
    if scheme == "overlap":
        chosen.append(runs[(rank + 1) % world])

    def box(run):
        offsets, sizes = [0] * ndim, list(shape)
        offsets[dim], sizes[dim] = run
        return tuple(offsets), tuple(sizes)

    return [box(run) for run in chosen]


def shard_model(model: torch.nn.Module, rank: int, world: int, scheme: str) -> None:
    """Every parameter becomes a NaN-filled plain local buffer with the protocol's attributes:
    its shards stacked along dim 0 in the order :func:`geometry` gives, one padding row after each
    and one padding element beyond the widest shard in every other dim. Tied parameters stay one."""
    from hp_dcp_hf.geometry.shards import mark_checkpointable
    from tests.support.models import replace_parameters

    def make(param: torch.nn.Parameter) -> torch.nn.Parameter:
        shape = tuple(param.shape)
        shards = list(geometry(shape, rank, world, scheme))
        local_offsets, row = [], 0
        for _, sizes in shards:
            local_offsets.append((row, *(0,) * (len(shape) - 1)))
            row += sizes[0] + 1
        rest = [1 + max(s[d] for _, s in shards) for d in range(1, len(shape))]
        new = torch.nn.Parameter(torch.full((row, *rest), float("nan"), dtype=param.dtype), requires_grad=False)
        mark_checkpointable(new, shape, [o for o, _ in shards], local_offsets, [s for _, s in shards])
        return new

    replace_parameters(model, make)


def _rewrites():
    from hp_dcp_hf.transforms import fuse_qkv, grouped_gemm_experts

    return {"qkv": fuse_qkv, "experts": grouped_gemm_experts}


def _one(rank: int, world: int, path: str, out: str, model_type: str, rewrites: tuple, scheme: str) -> dict:
    from hp_dcp_hf import (
        HFMappingPlanner,
        HFSavePlanner,
        HFStorageReader,
        HFStorageWriter,
        load_hf_checkpoint,
        save_hf_checkpoint,
    )
    from hp_dcp_hf.geometry.shards import local_shard_pieces, local_tensor

    with torch.device("meta"):
        model = model_class(model_type)(tiny_config(model_type)).float()
    for rewrite in rewrites:
        _rewrites()[rewrite](model)
    model.to_empty(device="cpu")
    model.tie_weights()
    shard_model(model, rank, world, scheme)
    reader = HFStorageReader(path, coalesce_gap=0)
    planner = HFMappingPlanner(model)
    report = load_hf_checkpoint(model, path, reader=reader, planner=planner, check_written=True)
    state = model.state_dict()
    pieces, padding_nan, own = {}, True, 0
    for name, tensor in state.items():
        local = local_tensor(tensor)
        held = torch.zeros(local.shape, dtype=torch.bool)
        pieces[name] = []
        for piece in local_shard_pieces(tensor):
            pieces[name].append((piece.global_box.slices(), local[piece.local_box().slices()].clone()))
            held[piece.local_box().slices()] = True
            if name in planner.filled:
                own += piece.global_box.numel * 4  # a float32 checkpoint, elements 1:1 with the model's
        padding_nan &= bool(torch.isnan(local[~held]).all())
    planner_save = HFSavePlanner(model)
    writer = HFStorageWriter(out, max_shard_size=SHARD)
    save_hf_checkpoint(model, out, planner=planner_save, writer=writer)
    return {"pieces": pieces, "missing": report.missing_keys, "unexpected": report.unexpected_keys,
            "padding_nan": padding_nan, "bytes_read": reader.stats.total().bytes_read,
            "bytes_needed": planner.stats.bytes_needed, "own_bytes": own,
            "deferred": planner.stats.deferred_targets,
            "written": writer.bytes_written, "planned": planner_save.bytes_planned}


def _run(rank: int, world: int, cases: list, paths: dict, root: str) -> dict:
    return {_case_id(case): _one(rank, world, paths[case[0]], os.path.join(root, f"out{world}", _case_id(case)),
                                 *case) for case in cases}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-shards")
    paths = {m: make_checkpoint(m, root / m, dtype=torch.float32, max_shard_size=SHARD) for m in ("llama", "mixtral")}
    return root, paths


@pytest.fixture(scope="module")
def references(checkpoints):
    _, paths = checkpoints
    pretrained = {m: model_class(m).from_pretrained(p, dtype=torch.float32) for m, p in paths.items()}
    out = {}
    for model_type, rewrites, _ in {c for cases in CASES.values() for c in cases}:
        model = copy.deepcopy(pretrained[model_type])
        for rewrite in rewrites:
            _rewrites()[rewrite](model)
        out[model_type, rewrites] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"world{w}")
def results(request, checkpoints):
    root, paths = checkpoints
    world = request.param
    per_rank = run_ranks(world, _run, CASES[world], {m: str(p) for m, p in paths.items()}, str(root), timeout=400)
    return world, per_rank


def _tensor_bytes(path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # noqa: SIM118 - float32
    return total


def test_every_shard_equals_from_pretrained(results, references):
    world, per_rank = results
    for case in CASES[world]:
        reference = references[case[0], case[1]]
        for rank, r in enumerate(per_rank):
            got = r[_case_id(case)]
            assert not got["missing"] and not got["unexpected"], (rank, case)
            assert set(got["pieces"]) == set(reference), (rank, case)
            bad = [k for k, pieces in got["pieces"].items() for box, value in pieces
                   if not torch.equal(value, reference[k][box])]
            assert not bad, (rank, case, bad[:3])
            assert got["padding_nan"], (rank, case)  # the load wrote the shards, never the padding


def test_the_ranks_together_hold_every_element(results, references):
    """The schemes cover every tensor: the element-wise checks above check all of each tensor."""
    world, per_rank = results
    for case in CASES[world]:
        for key, value in references[case[0], case[1]].items():
            seen = torch.zeros(value.shape, dtype=torch.bool)
            for r in per_rank:
                for box, _ in r[_case_id(case)]["pieces"][key]:
                    seen[box] = True
            assert bool(seen.all()), (case, key)


def test_each_rank_reads_exactly_its_shards_bytes(results):
    world, per_rank = results
    for case in CASES[world]:
        for rank, r in enumerate(per_rank):
            got = r[_case_id(case)]
            assert got["deferred"] == 0
            assert got["bytes_read"] == got["bytes_needed"] == got["own_bytes"] > 0, (rank, case, got["bytes_read"],
                                                                                      got["own_bytes"])


def test_the_save_equals_save_pretrained_each_byte_once(results, checkpoints):
    root, paths = checkpoints
    world, per_rank = results
    for case in CASES[world]:
        assert_same_checkpoint(root / f"out{world}" / _case_id(case), paths[case[0]])
        written = [r[_case_id(case)]["written"] for r in per_rank]
        assert written == [r[_case_id(case)]["planned"] for r in per_rank], case
        assert sum(written) == _tensor_bytes(paths[case[0]]), case
        assert all(w > 0 for w in written), case  # replicas share the writing


def test_shared_shards_are_read_by_each_holder(results):
    """``overlap``: a shard two ranks list is read by both (each needs its values), written once."""
    world, per_rank = results
    for case in CASES[world]:
        if case[2] == "overlap":
            reads = sum(r[_case_id(case)]["bytes_read"] for r in per_rank)
            written = sum(r[_case_id(case)]["written"] for r in per_rank)
            assert reads > written, case

"""Turn a traced RegionTensor back into data, to compare tracing with the real ops."""

import torch

from hp_dcp_hf import HFMappingPlanner
from hp_dcp_hf.mapping.structure import Bound
from hp_dcp_hf.mapping.symbolic import RegionTensor


def plan_of(model: torch.nn.Module, metadata, *, share_structure: bool) -> dict:
    """Everything a plan decides: items in order, each item's destination view, counts, report."""
    planner = HFMappingPlanner(model, share_structure=share_structure)
    items = planner.plan_reads(model.state_dict(), metadata)
    views = [(v.tensor.untyped_storage().data_ptr(), v.sizes, v.strides, v.offset) for v in map(planner._destinations.get, items) if v]
    structures = {id(t.structure) for t in planner.composition.traced.values() if isinstance(t, Bound)}
    return {"items": items, "views": views, "stats": planner.stats, "report": planner.report,
            "deferred": sorted(planner._deferred), "structures": len(structures)}


def materialize(traced: "RegionTensor | Bound", sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copy every piece of ``traced`` out of ``sources``; unwritten elements stay NaN."""
    out = torch.full(tuple(traced.shape), float("nan"), dtype=torch.float64)
    for piece in traced.pieces:
        src = sources[piece.key].to(torch.float64)
        sizes = [a.size for a in piece.axes]
        dest = out.as_strided(
            sizes,
            [a.step * out.stride(a.dim) for a in piece.axes],
            sum(o * s for o, s in zip(piece.origin, out.stride())),
        )
        view = src.as_strided(
            sizes,
            [a.src_step * src.stride(a.src_dim) for a in piece.axes],
            sum(o * s for o, s in zip(piece.src_origin, src.stride())),
        )
        assert not dest.isfinite().any(), "two pieces write the same element"
        dest.copy_(view)
    return out


def assert_same_plans(model: torch.nn.Module, metadata) -> tuple[int, int]:
    """The shared and per-group plans agree; the number of structures each traced."""
    shared = plan_of(model, metadata, share_structure=True)
    per_group = plan_of(model, metadata, share_structure=False)
    assert shared["items"], "nothing planned"
    for part in ("items", "views", "stats", "report", "deferred"):
        assert shared[part] == per_group[part], part
    return shared["structures"], per_group["structures"]

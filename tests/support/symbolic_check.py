"""Turn a traced RegionTensor back into data, to compare tracing with the real ops."""

import torch

from hp_dcp_hf.mapping.structure import Bound
from hp_dcp_hf.mapping.symbolic import RegionTensor


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

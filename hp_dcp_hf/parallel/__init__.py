"""Parallel layouts for the pipeline: mesh specs and transformers' own TP / EP / FSDP / HSDP plans.

* :mod:`hp_dcp_hf.parallel.mesh`: ``"dp_replicate=2,dp=2,tp=2,ep=2"`` -> sizes, a transformers
  ``DistributedConfig`` (:func:`distributed_config`) or a ``DeviceMesh`` (:func:`init_mesh`).
* :mod:`hp_dcp_hf.parallel.plans`: :class:`TransformersPlans`, the ``parallelize=`` callable
  :func:`hp_dcp_hf.from_pretrained` uses for ``distributed_config=``.
"""

from hp_dcp_hf.parallel.mesh import (
    MESH_DIMS,
    MeshSizeError,
    caller_mesh_dims,
    check_caller_mesh,
    check_world_size,
    distributed_config,
    format_mesh,
    init_mesh,
    mesh_spec,
    mesh_world_size,
    parse_mesh,
)

_PLANS = ("CallerMesh", "ParallelizeError", "TransformersPlans", "Unsharded")


def __getattr__(name: str):
    # The plans import torch.distributed and transformers: only when asked for (parsing a mesh
    # spec, e.g. for the CLI's --help, stays light).
    if name in _PLANS:
        from hp_dcp_hf.parallel import plans

        return getattr(plans, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CallerMesh",
    "MESH_DIMS",
    "MeshSizeError",
    "ParallelizeError",
    "TransformersPlans",
    "Unsharded",
    "caller_mesh_dims",
    "check_caller_mesh",
    "check_world_size",
    "distributed_config",
    "format_mesh",
    "init_mesh",
    "mesh_spec",
    "mesh_world_size",
    "parse_mesh",
]

"""Which processes a ``load`` runs on (torchrun's ranks, the package's ``--nproc-per-node`` ranks, or
one process), the checks made before torch is imported, and how a rank's failure is printed once."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys

from hp_dcp_hf.tools.cli.messages import rank_error_line
from hp_dcp_hf.tools.cli.save_to import save_options


def launched_rank_and_world() -> tuple[int, int]:
    """This process' rank and world size: the process group's, else torchrun's ``RANK`` /
    ``WORLD_SIZE``, else a world of one. Asks torch only where it is imported already (no process
    group exists without it), so a bad mesh fails before torch is imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def init_distributed() -> tuple[int, int]:
    """The default process group of the ranks torchrun launched (gloo), or of this process alone."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:  # a single process: a world of one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def check_launch(args: argparse.Namespace, mesh: str, rank: int, world: int) -> bool:
    """Whether the mesh spec parses and fits the processes launched, and the storage options are
    ones the stores take (checked before torch is imported). When not, rank 0 raises the error (for
    a mesh that does not fit: naming the command that does), printed once, and the other ranks
    return ``False``."""
    from hp_dcp_hf.parallel.mesh import MeshSizeError, mesh_world_size
    from hp_dcp_hf.storage.transport.location import check_options

    try:
        need = mesh_world_size(mesh)
        if need != world:
            argv = getattr(args, "argv", None) or ["load", args.path, "--mesh", mesh]
            if args.nproc_per_node is not None:
                fix = f"pass --nproc-per-node {need}"
            else:
                fix = f"launch with `torchrun --nproc-per-node {need} -m hp_dcp_hf {shlex.join(argv)}`"
            raise MeshSizeError(
                f"mesh {mesh} needs {need} ranks, but {world} process{'es were' if world != 1 else ' was'} "
                f"launched; {fix}"
            )
        check_options(args.path, args.storage_options)
        if args.save_to:
            check_options(args.save_to, save_options(args))
    except Exception:
        if rank != 0:
            return False  # rank 0 says why, once
        raise
    return True


def say_once(error: Exception, rank: int) -> None:
    """An error every rank raises (``error.rank`` is the rank it came from) is printed by rank 0
    alone. The others wait for that at a barrier: torchrun ends the job when the first rank exits."""
    import torch.distributed as dist

    if rank == 0:
        print(rank_error_line(error), file=sys.stderr, flush=True)
    error.reported = True  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):  # a process group broken by the failure: nothing to wait for
        dist.barrier()

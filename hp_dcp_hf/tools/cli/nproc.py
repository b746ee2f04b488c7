"""``hp-dcp-hf load PATH --nproc-per-node N``: one host's N ranks started by the package's own runner
(:func:`hp_dcp_hf.tools.launch.run_ranks`, gloo) instead of torchrun."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hp_dcp_hf.tools.cli.messages import config_from_the_command_line, rank_error_line
from hp_dcp_hf.tools.cli.ranks import check_launch

_LAUNCH_TIMEOUT_S = 3600.0
"""How long ``--nproc-per-node`` ranks may take (and wait for each other, the process group's timeout)."""


def launch(args: argparse.Namespace) -> int:
    """``load --nproc-per-node N``: one host's N ranks started by the package's own runner
    (:func:`hp_dcp_hf.tools.launch.run_ranks`, gloo). Everything that can be checked is checked first, in
    this process: the mesh spec and that it needs N ranks, the storage options, and the checkpoint's
    ``config.json`` (transformers' config of a known model type, the mesh as transformers'
    ``DistributedConfig``). A failure, here or on any rank, is one line: a rank's failure with the rank
    it came from (:func:`~hp_dcp_hf.tools.launch.run_ranks` raises the failing rank's own error, not
    the copies the others raise of it, so the line is the same whichever rank reports first)."""
    from hp_dcp_hf.errors import ArgumentError
    from hp_dcp_hf.parallel.mesh import distributed_config

    world = args.nproc_per_node
    if world < 1:
        raise ArgumentError(f"--nproc-per-node {world}: need at least 1 process")
    mesh = args.mesh or f"dp={world}"
    check_launch(args, mesh, 0, world)  # before anything imports torch
    distributed_config(mesh)
    from hp_dcp_hf.model.config import read_config

    with config_from_the_command_line():
        read_config(args.path, args.storage_options)
    from hp_dcp_hf.tools.launch import run_ranks

    argv = without_nproc(getattr(args, "argv", None) or [])
    each_rank = argparse.Namespace(**{**vars(args), "nproc_per_node": None, "argv": argv, "launched": True})
    try:
        return run_ranks(world, _launched_load, each_rank, timeout=_LAUNCH_TIMEOUT_S)[0]
    except Exception as error:
        if world > 1:  # run_ranks names the rank every error it raises came from
            print(rank_error_line(error), file=sys.stderr, flush=True)
            error.reported = True  # type: ignore[attr-defined]
        raise


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--nproc-per-node N`` (or ``--nproc-per-node=N``): what each rank runs."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _launched_load(rank: int, world: int, args: argparse.Namespace) -> int:
    """One rank of ``load --nproc-per-node``: the command's arguments without the option (``launched``),
    in the process group :func:`~hp_dcp_hf.tools.launch.run_ranks` made. Errors go back to the
    launcher, which prints one; this rank prints none."""
    return args.func(args)

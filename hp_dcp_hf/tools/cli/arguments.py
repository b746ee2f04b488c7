"""The arguments several commands share (the checkpoint PATH, the layout of ``plan`` and ``load``,
the reader's options), and the parser classes every command's parser is made of."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from hp_dcp_hf.tools.cli.messages import PROG
from hp_dcp_hf.tools.cli.storage_options import add_storage_option_argument

DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "float16", "float32", "fp16", "fp32")
"""``--dtype`` values (:mod:`hp_dcp_hf.model.dtype`: ``auto`` takes the config's, as transformers 5 does)."""


TRANSFORMS = ("fuse_gate_up", "fuse_qkv", "grouped_gemm_experts")
"""The rewrites of :mod:`hp_dcp_hf.transforms`, listed by ``--help`` without importing them (a test
checks this list against ``hp_dcp_hf.transforms.__all__``)."""


PATH_HELP = ("the checkpoint: a .safetensors file or a directory of them (local path, s3://..., https://...), "
             "hf://org/repo[@revision][/subdir], or a bare Hub repo id org/repo when no such local path exists")
JSON_HELP = "print JSON instead of tables"
TRANSFORMS_HELP = f"comma-separated rewrites, applied in order; available: {', '.join(TRANSFORMS)}"

NewCommand = Callable[[str, str], argparse.ArgumentParser]
"""``new_command(name, help)``: a sub-parser of ``hp-dcp-hf`` for command ``name`` (what each
command module's ``add_parser`` is given)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        if action.nargs == 0 and action.default is False:  # a flag
            return f"{action.help or ''} (default: off)"
        return super()._get_help_string(action)


def add_layout_arguments(parser: argparse.ArgumentParser, mesh_default: str | None) -> None:
    """``plan``'s and ``load``'s arguments: the checkpoint, the mesh and rewrites of the model, the
    dtype, strictness, the store's and the reader's options."""
    parser.add_argument("path", help=PATH_HELP)
    mesh_help = ("mesh dims, e.g. dp=2,tp=2 or ep=4: dp_replicate (HSDP replicas), dp (FSDP), tp, ep (experts, "
                 "overlays dp x tp); dp_replicate x dp x tp is the number of ranks; laid out with "
                 "transformers' own plans")
    if mesh_default is None:
        mesh_help += " (default: dp=<number of processes launched>)"
    parser.add_argument("--mesh", default=mesh_default, help=mesh_help)
    parser.add_argument("--transforms", default="", help=TRANSFORMS_HELP + " (default: none)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="the model's dtype; auto: config.json's dtype, as transformers 5's from_pretrained")
    parser.add_argument("--no-strict", action="store_true", help="missing model tensors are not an error")
    parser.add_argument("--unexpected", default="warn", choices=("warn", "raise", "ignore"),
                        help="checkpoint tensors that make no model tensor: warn (name them), raise (refuse "
                             "the load before any read) or ignore")
    add_storage_option_argument(parser)
    parser.add_argument("--coalesce-gap", type=int, default=None, metavar="BYTES",
                        help="reader: merge ranges at most this far apart (default: 0 local, 1 MiB remote; "
                             "local files only with --no-map)")
    parser.add_argument("--no-map", action="store_true",
                        help="reader: read local files with preadv instead of copying out of a memory mapping")
    parser.add_argument("--threads", type=int, default=None,
                        help="reader: reads in flight (default: 8 remote; local: the cores per rank of this node, 2-8)")
    parser.add_argument("--staging-mib", type=int, default=64, help="reader: staging budget in MiB")
    parser.add_argument("--cooperate", default="auto", choices=("auto", "always", "never"),
                        help="reader: span ownership, each needed byte read by one rank and exchanged (auto: on "
                             "remote stores and shared file systems)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def transforms(spec: str | None) -> tuple[str, ...]:
    """``--transforms fuse_qkv,fuse_gate_up`` -> the rewrites' names, in order."""
    return tuple(t.strip() for t in (spec or "").split(",") if t.strip())


def reader_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~hp_dcp_hf.storage.HFStorageReader` options of :func:`add_layout_arguments`."""
    return {"coalesce_gap": args.coalesce_gap, "num_threads": args.threads, "staging_bytes": args.staging_mib * 2**20,
            "map_local_files": not args.no_map, "cooperate": args.cooperate, "storage_options": args.storage_options}

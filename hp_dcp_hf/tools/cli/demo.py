"""``hp-dcp-hf demo [--out DIR] [--cache-dir DIR]``: generate a small MoE checkpoint and load it on 4
ranks (:mod:`hp_dcp_hf.tools.demo`)."""

from __future__ import annotations

import argparse

from hp_dcp_hf.tools.cli.arguments import TRANSFORMS_HELP, NewCommand


def add_parser(new_command: NewCommand) -> None:
    parser = new_command("demo", "generate a small MoE checkpoint and load it on 4 ranks")
    parser.add_argument("--out", default="demo_out", help="output directory: per-rank JSON, summary.json, pictures")
    parser.add_argument("--cache-dir", default=None,
                        help="where the generated checkpoint is kept (default: $HP_DCP_HF_CACHE or ~/.cache/hp_dcp_hf)")
    parser.add_argument("--mesh", default="dp=2,tp=2",
                        help="mesh dims as for plan/load (dp_replicate, dp, tp, ep; dp_replicate x dp x tp ranks)")
    parser.add_argument("--transforms", default="grouped_gemm_experts", help=TRANSFORMS_HELP)
    parser.add_argument("--regenerate", action="store_true", help="write the checkpoint again")
    parser.add_argument("--quantized", default="none", choices=("none", "fp8"),
                        help="fp8: the same checkpoint with its layer weights FP8 block-quantized (128x128, as "
                             "DeepSeek-V3 ships), loaded as their values into the float32 model")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the single-process transformers forward on rank 0")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds a rank waits for the others (its process group's timeout)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools import demo

    return demo.run(args)

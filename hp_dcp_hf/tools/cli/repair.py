"""``hp-dcp-hf repair PATH [--dry-run]``: finish a save that was killed while publishing, drop what
killed saves left."""

from __future__ import annotations

import argparse

from hp_dcp_hf.tools.cli.arguments import NewCommand
from hp_dcp_hf.tools.cli.messages import with_messages
from hp_dcp_hf.tools.cli.storage_options import add_storage_option_argument


def add_parser(new_command: NewCommand) -> None:
    parser = new_command("repair", "finish a save that was killed while publishing (its journal is the commit point), "
                                   "drop what saves killed before it left")
    parser.add_argument("path", help="a checkpoint directory or s3:// prefix that saves write to")
    add_storage_option_argument(parser)
    parser.add_argument("--dry-run", action="store_true", help="say what repair would do, change nothing")
    parser.set_defaults(func=run)


@with_messages
def run(args: argparse.Namespace) -> int:
    from hp_dcp_hf.storage.write.writer import destination_for

    print(f"{args.path}: {destination_for(args.path, args.storage_options).repair(dry_run=args.dry_run)}")
    return 0

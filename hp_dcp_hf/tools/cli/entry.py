"""The ``hp-dcp-hf`` entry: the top-level parser (each command adds its own sub-parser), dispatch, and
an error as one line (``hp-dcp-hf: error: ...``, exit 1; ``--debug`` shows the traceback)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hp_dcp_hf.tools.cli import demo, inspect, load, plan, repair
from hp_dcp_hf.tools.cli.arguments import HelpFormatter, Parser
from hp_dcp_hf.tools.cli.messages import PROG, one_line
from hp_dcp_hf.version import __version__

DESCRIPTION = "inspect a checkpoint, plan every rank's reads, load under torchrun, run the demo."

COMMANDS = (inspect, plan, load, repair, demo)
"""The command modules, in ``--help``'s order: each adds its sub-parser (``add_parser``), whose
``func`` runs the command."""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks instead of one-line errors (default: off)")
    parser = Parser(prog=PROG, description=f"{PROG}: {DESCRIPTION}", parents=[common], formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    def new_command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=help, formatter_class=HelpFormatter)

    for command in COMMANDS:
        command.add_parser(new_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # for messages that repeat the command line
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, BrokenPipeError) and _stdout_closed():  # `... | head`: the reader has what it wanted
            _discard_stdout()
            return 0
        if getattr(args, "debug", False):
            raise
        if not getattr(error, "reported", False):
            print(f"{PROG}: error: {one_line(error)}", file=sys.stderr)
        return 1


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``head`` exited): a ``BrokenPipeError`` from
    printing, not one from a connection to storage."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file
        return False


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe
    again (and print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)

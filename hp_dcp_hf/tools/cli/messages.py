"""What the commands print besides their results: errors, warnings and log records, one line each.

Errors print ``hp-dcp-hf: error: ...`` (``--debug`` shows the traceback instead); while a command
runs, the package's warnings and log records print ``hp-dcp-hf: [rank N: ]warning: ...`` on
stderr, and ``load`` names its stages and its progress on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import posixpath
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import hp_dcp_hf

PROG = "hp-dcp-hf"

_INFO_LOGGERS = ("hp_dcp_hf.integrations.transformers", "hp_dcp_hf.tools.progress")
"""The loggers whose INFO records rank 0 prints: the stages before a load, progress lines."""

_PACKAGE_DIR = os.path.dirname(os.path.abspath(hp_dcp_hf.__file__))
"""Warnings raised from files under it are the package's: printed as one line."""


def _message_line(message: str, level: int, rank: int) -> str:
    """``hp-dcp-hf: [rank N: ][warning: ]message``, on one line."""
    where = f"rank {rank}: " if rank else ""
    kind = f"{logging.getLevelName(level).lower()}: " if level >= logging.WARNING else ""
    return f"{PROG}: {where}{kind}{' '.join(message.split())}"


class _Lines(logging.Handler):
    """Prints the ``hp_dcp_hf`` loggers' records on stderr, one line each: WARNING and above on
    every rank, INFO of :data:`_INFO_LOGGERS` on rank 0."""

    def __init__(self, rank: int) -> None:
        super().__init__(logging.INFO if rank == 0 else logging.WARNING)
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name in _INFO_LOGGERS

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = _message_line(record.getMessage(), record.levelno, self.rank)
        except Exception:  # noqa: BLE001 - logging's own policy for a record that does not format
            self.handleError(record)
            return
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def messages(rank: int = 0) -> Iterator[None]:
    """While a command runs: the package's log records through :class:`_Lines` (not propagated to
    the root logger's handlers), and Python warnings raised from its modules as one line each,
    without the ``file.py:NNN: UserWarning`` prefix and source line Python adds."""
    logger = logging.getLogger("hp_dcp_hf")
    handler = _Lines(rank)
    level, propagate, showwarning = logger.level, logger.propagate, warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
            print(_message_line(str(message), logging.WARNING, rank), file=sys.stderr, flush=True)
        else:
            showwarning(message, category, filename, lineno, file, line)

    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = showwarning
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def with_messages(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` under :func:`messages` (one process: rank 0)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        with messages():
            return command(args)

    return run


@contextlib.contextmanager
def config_from_the_command_line() -> Iterator[None]:
    """The pipeline's error for a checkpoint without ``config.json`` names a Python argument
    (``from_pretrained(..., config=)``); on the command line the fix is the path."""
    from hp_dcp_hf.errors import CheckpointNotFoundError

    try:
        yield
    except CheckpointNotFoundError as error:
        if posixpath.basename(error.file or "") != "config.json":
            raise
        raise CheckpointNotFoundError(
            "no config.json next to the weights, and plan and load build the model from it: point PATH at "
            "the checkpoint's directory that holds its config.json (as save_pretrained writes it), or put the "
            "model's config.json there", file=error.file) from error


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    from hp_dcp_hf.errors import HPDCPHFError

    if not isinstance(error, HPDCPHFError | ValueError | RuntimeError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= 400 else text[:400] + "... (--debug for all of it)"


def rank_error_line(error: BaseException) -> str:
    """The line for an error a rank of a multi-rank load raised: with the rank it came from
    (``error.rank``, set by the collectives that make every rank raise one cause, and by
    :func:`hp_dcp_hf.tools.launch.run_ranks`), unless its message names it already."""
    where = "" if "on rank " in str(error) else f"on rank {error.rank}: "  # type: ignore[attr-defined]
    return f"{PROG}: error: {where}{one_line(error)}"

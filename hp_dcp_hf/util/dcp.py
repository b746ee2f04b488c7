"""Calling torch's DCP: its log records of our own errors left out, and our error taken back out of
its ``CheckpointException``; what the load and the save entry points share."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint.api import CheckpointException

from hp_dcp_hf.errors import HPDCPHFError
from hp_dcp_hf.util.collectives import should_broadcast


class _OwnErrors(logging.Filter):
    """Drops the records torch's DCP logs, with a traceback, for an error of ours it re-raises
    anyway ("Global metadata is not found. Falling back to rank local metadata.")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HPDCPHFError))


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """torch's DCP logs on the root logger; its records of our own errors are left out meanwhile."""
    root, own = logging.getLogger(), _OwnErrors()
    root.addFilter(own)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(own)


def is_rank0() -> bool:
    return not should_broadcast() or torch.distributed.get_rank() == 0


def unwrap_checkpoint_exception(exc: CheckpointException) -> BaseException:
    """The first rank's own error out of DCP's wrapper, preferring this package's typed errors;
    ``error.rank`` is that rank when DCP gathered every rank's outcome."""
    failures = [(rank, failure[0] if isinstance(failure, tuple) else failure)
                for rank, failure in sorted(exc.failures.items())]
    if not failures:
        return exc
    rank, error = next(((r, e) for r, e in failures if isinstance(e, HPDCPHFError)), failures[0])
    if len(failures) > 1 or should_broadcast():  # every rank raises it: say whose it is
        error.rank = rank  # type: ignore[attr-defined]
    return error

"""``run_ranks``: which error it raises when ranks fail, and the rank it names."""

from __future__ import annotations

import time

import pytest

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.tools.launch import run_ranks


def _agreed_failure(rank: int, world: int) -> None:
    """Rank 0 fails; the collectives make rank 1 raise a copy of its error (naming rank 0), and rank
    1 reports first."""
    from hp_dcp_hf.util.collectives import agree_on_failure

    error = agree_on_failure(MappingError("no value for w") if rank == 0 else None)
    assert error is not None
    if rank == 0:
        time.sleep(1.0)  # within run_ranks' grace period after the first report
    raise error


def test_the_failing_rank_s_own_error_is_raised_whichever_rank_reports_first() -> None:
    with pytest.raises(MappingError) as caught:
        run_ranks(2, _agreed_failure, timeout=60)
    assert str(caught.value) == "no value for w"  # rank 0's own, not rank 1's "on rank 0: no value for w"
    assert caught.value.rank == 0
    assert any(note.startswith("raised on rank 0 of 2:") for note in caught.value.__notes__)


def _rank_one_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1's own trouble")
    return rank


def test_a_lone_failure_names_its_rank() -> None:
    with pytest.raises(ValueError, match="rank 1's own trouble") as caught:
        run_ranks(2, _rank_one_fails, timeout=60)
    assert caught.value.rank == 1

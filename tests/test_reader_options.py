"""The reader's options (:class:`~hp_dcp_hf.storage.read.options.ReaderOptions`): checked once,
when the reader is built, and what its keywords become."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from hp_dcp_hf.storage import HFStorageReader, RetryPolicy
from hp_dcp_hf.storage.read import options as options_module
from hp_dcp_hf.storage.read.options import ReaderOptions, ReadSettings
from hp_dcp_hf.storage.transport.location import CheckpointLocation, filesystem


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cooperate": "sometimes"}, "cooperate must be 'auto', 'always' or 'never'"),
        ({"span_bytes": 0}, "span_bytes must be positive"),
        ({"coalesce_gap": -1}, "need coalesce_gap >= 0"),
        ({"num_threads": 0}, "need coalesce_gap >= 0, num_threads >= 1"),
        ({"num_threads": 4, "staging_bytes": 63}, "staging_bytes >= 16 per thread"),
        ({"retry": {"tries": 3}}, "unknown retry policy fields"),
        # the options' own checks come before the retry policy's
        ({"cooperate": "x", "retry": {"tries": 3}}, "cooperate must be"),
    ],
)
def test_a_wrong_option_is_refused_when_the_reader_is_built(tmp_path, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        HFStorageReader(str(tmp_path), **options)


def test_keywords_that_are_not_options_go_to_the_filesystem_and_defaults_fill_in(tmp_path) -> None:
    reader = HFStorageReader(str(tmp_path), storage_options={"auto_mkdir": False}, use_listings_cache=False,
                            retry={"attempts": 2}, num_threads=3)
    options = reader.options
    assert reader.storage_options == options.storage_options == {"auto_mkdir": False, "use_listings_cache": False}
    assert options.retry == RetryPolicy(attempts=2) and options.num_threads == 3
    assert options.node == socket.gethostname() and options.cooperate == "auto"
    assert ReaderOptions.of(node="n1").node == "n1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_threads = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cores", "local_world", "expected"),
    [(2, "4", 2), (2, "2", 2), (16, "2", 8), (16, "4", 4), (96, "8", 8), (12, None, 8), (6, "bad", 6)],
)
def test_local_reads_take_the_cores_the_nodes_ranks_share(monkeypatch, cores, local_world, expected) -> None:
    """Unset ``num_threads`` on local files: this process's cores over the node's ranks
    (``LOCAL_WORLD_SIZE``, else one outside a process group), at least 2 and at most 8."""
    monkeypatch.setattr(options_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert options_module.local_threads() == expected


def test_threads_given_win_and_remote_reads_keep_eight(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(options_module.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    local = CheckpointLocation(*filesystem(str(tmp_path)))
    remote = CheckpointLocation(*filesystem("memory://warm/ckpt"))
    assert ReadSettings(ReaderOptions(), local).threads == 3
    assert ReadSettings(ReaderOptions(), remote).threads == ReadSettings(ReaderOptions(), None).threads == 8
    assert ReadSettings(ReaderOptions(num_threads=5), local).threads == 5
    assert ReaderOptions().request_threads == 8 and ReaderOptions(num_threads=3).request_threads == 3

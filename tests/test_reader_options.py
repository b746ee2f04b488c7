"""The reader's options (:class:`~hp_dcp_hf.storage.read.options.ReaderOptions`): checked once,
when the reader is built, and what its keywords become."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from hp_dcp_hf.storage import HFStorageReader, RetryPolicy
from hp_dcp_hf.storage.read.options import ReaderOptions


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

"""Progress of long loads and saves: a bar on a terminal, lines in a log.

:class:`Progress` counts bytes done; :class:`SaveProgress` drives one from a writer's ``progress``
hook, :func:`progress_planner` from a load planner's commits. The CLI prints this module's INFO
records (``hp-dcp-hf: rank 0 loading: ...``).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from hp_dcp_hf.tools.formatting import fmt_bytes

if TYPE_CHECKING:
    from hp_dcp_hf.load.planner import HFMappingPlanner

logger = logging.getLogger(__name__)


PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines when stderr is not a terminal."""


class Progress:
    """Bytes done of ``total``, for work long enough to look stuck: a tqdm bar on stderr when it is a
    terminal, else an INFO record of this module's logger every :data:`PROGRESS_EVERY_S` seconds and
    one at :meth:`close` (a log gets lines, not carriage returns; the CLI prints them). ``note``
    (``"tensors 3/10"``) goes after the bytes. Thread-safe."""

    def __init__(self, desc: str, total: int, note: str = "") -> None:
        self.desc, self.total, self.done, self.note = desc, total, 0, note
        self._lock = threading.Lock()
        self._start = self._shown = time.monotonic()
        self._closed = False
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             dynamic_ncols=True, file=sys.stderr, postfix=note or None)

    def update(self, nbytes: int, note: str | None = None) -> None:
        with self._lock:
            self.done += nbytes
            self.note = self.note if note is None else note
            if self._bar is not None:
                self._bar.update(nbytes)
                if note is not None:
                    self._bar.set_postfix_str(note, refresh=False)
            elif time.monotonic() - self._shown >= PROGRESS_EVERY_S:
                self._line()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            else:
                self._line()

    def _line(self) -> None:
        self._shown = time.monotonic()
        share = self.done / self.total if self.total else 1.0
        note = f", {self.note}" if self.note else ""
        logger.info("%s: %s of %s (%.0f%%)%s, %.1f s", self.desc, fmt_bytes(self.done), fmt_bytes(self.total),
                    100 * share, note, self._shown - self._start)


class SaveProgress:
    """A :class:`~hp_dcp_hf.storage.HFStorageWriter` ``progress`` hook: a :class:`Progress` of this
    rank's bytes written, from the first call of a save to the one that reaches its total."""

    def __init__(self, desc: str = "rank 0 saving") -> None:
        self.desc = desc
        self._progress: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress(self.desc, total)
        self._progress.update(done - self._progress.done)
        if done >= total:
            self._progress.close()
            self._progress = None


def progress_planner(show: bool, desc: str = "rank 0 loading", *, shard_bytes: bool = False) -> type[HFMappingPlanner]:
    """A planner class whose planners drive a :class:`Progress` (bytes, tensors done) when ``show``.

    The class's ``last`` is its last planner, to read after ``from_pretrained`` made and used it.
    With ``shard_bytes``, a planner's ``shard_bytes`` is what this rank's shards need from the
    checkpoint: its own ``stats.bytes_needed`` when it traces, and for the legacy (untraced) plan,
    which reads whole tensors, that of a traced plan made first (on this rank alone, no collective):
    the bytes the legacy loader's reads amplify.
    """
    from hp_dcp_hf.load.planner import HFMappingPlanner

    class ProgressPlanner(HFMappingPlanner):
        last: ProgressPlanner | None = None
        shard_bytes: int | None = None

        def create_local_plan(self):
            traced = self._traced_bytes() if shard_bytes and not self.trace else None
            plan = super().create_local_plan()  # after the traced plan: what it records on the model is this one's
            type(self).last = self
            if shard_bytes:
                self.shard_bytes = self.stats.bytes_needed if traced is None else traced
            self._progress = None
            self._lock_bar = threading.Lock()
            self._left = Counter(item.dest_index.fqn for item in plan.items)
            self._tensors, self._done = len(self._left), 0
            if show and plan.items:
                total = sum(self._item_bytes(item) for item in plan.items)
                self._progress = Progress(desc, total, f"tensors 0/{self._tensors}")
            return plan

        def _traced_bytes(self) -> int:
            planner = HFMappingPlanner(
                self.model, weights_mapping=self.weights_mapping, strict=False, unexpected="ignore",
                external_target_fqns=self.external_target_fqns, claimed_source_keys=self.claimed_source_keys,
            )
            planner.plan_reads(self.state_dict, self.metadata)
            return planner.stats.bytes_needed

        def _item_bytes(self, item) -> int:
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            return math.prod(item.lengths) * md.properties.dtype.itemsize

        def commit_tensor(self, read_item, tensor) -> None:
            super().commit_tensor(read_item, tensor)
            if self._progress is None:
                return
            with self._lock_bar:
                self._left[read_item.dest_index.fqn] -= 1
                if not self._left[read_item.dest_index.fqn]:
                    self._done += 1
                self._progress.update(self._item_bytes(read_item), f"tensors {self._done}/{self._tensors}")
                if self._done == self._tensors:
                    self._progress.close()
                    self._progress = None

    return ProgressPlanner

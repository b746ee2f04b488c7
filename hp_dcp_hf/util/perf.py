"""Garbage collection paused over allocation-heavy phases.

Planning and reading allocate one small object per piece, block and byte range: on a layout with
one range per row that is hundreds of thousands of live objects, enough to set off repeated full
collections of the whole process heap (torch and transformers included), each a tenth of a second.
None of these objects form cycles, so collection can wait until the phase is over.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Collection off for the block (if it was on), back on after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""What a load costs a rank, measured from inside it: time, memory, bytes, and what it wrote.

* Memory: ``/proc/self/status``. Before a load the local shards are already touched (see
  :func:`bench.layouts.materialize`), so peak minus the RSS at the start is what the load itself
  added. The peak is the kernel's high-water mark (``VmHWM``, reset through ``clear_refs``) and a
  2 ms sampler of ``RssAnon`` (anonymous memory only: file pages that mmap-based readers map are
  page cache, shared, and not the loader's own allocation).
* Bytes of readers that do not count for themselves (mmap-based ``safetensors.safe_open``, used by
  torch's ``HuggingFaceStorageReader`` and by transformers): :class:`SafeOpenCounter` wraps
  ``safe_open`` and counts the bytes and slices each rank materializes from the mapping.
* Correctness: a digest of every local shard, compared across contenders by the parent.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from bench.layouts import local


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
                name, value = line.split(":", 1)
                out[name] = int(value.split()[0]) * 1024
    return out


def rss() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process, in bytes."""
    return _status()


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryWindow:
    """RSS at the start of a window and its peaks inside it (bytes)."""

    start_rss: int = 0
    start_anon: int = 0
    peak_rss: int = 0
    peak_anon: int = 0
    hwm_reset: bool = False

    @property
    def growth_rss(self) -> int:
        return max(0, self.peak_rss - self.start_rss)

    @property
    def growth_anon(self) -> int:
        return max(0, self.peak_anon - self.start_anon)


@contextlib.contextmanager
def memory_window(interval: float = 0.002) -> Iterator[MemoryWindow]:
    """Track RSS peaks while the body runs (a sampler thread plus the kernel's high-water mark)."""
    window = MemoryWindow()
    window.hwm_reset = _reset_peak()
    now = _status()
    window.start_rss, window.start_anon = now["VmRSS"], now["RssAnon"]
    window.peak_rss, window.peak_anon = window.start_rss, window.start_anon
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = _status()
            window.peak_rss = max(window.peak_rss, s["VmRSS"])
            window.peak_anon = max(window.peak_anon, s["RssAnon"])
            stop.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield window
    finally:
        stop.set()
        thread.join()
        end = _status()
        window.peak_anon = max(window.peak_anon, end["RssAnon"])
        window.peak_rss = max(window.peak_rss, end["VmRSS"], end["VmHWM"] if window.hwm_reset else 0)


def trim_memory() -> None:
    """Give freed heap back to the system between repetitions (glibc keeps it otherwise)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def digests(model: nn.Module) -> dict[str, str]:
    """state dict name -> blake2b of the rank's local bytes, and ``nan:<name>`` for unfilled shards."""
    out = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            data = local(tensor).detach().contiguous()
            if data.is_floating_point() and bool(torch.isnan(data).any()):
                out[f"nan:{name}"] = "unfilled"
            raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
            out[name] = hashlib.blake2b(raw, digest_size=12).hexdigest()
    return out


def compare_digests(ours: dict[str, str], reference: dict[str, str]) -> list[str]:
    """Names whose local bytes differ from the reference's, plus unfilled ones ([] when equal)."""
    bad = sorted(k for k in ours if k.startswith("nan:"))
    names = {k for k in reference if not k.startswith("nan:")}
    bad += sorted(n for n in names if ours.get(n) != reference[n])
    bad += sorted(n for n in ours if not n.startswith("nan:") and n not in names)
    return bad


# -- counting safe_open --------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = 0
        self.slices = 0
        self.opens = 0

    def add(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            self.bytes += nbytes
            self.slices += 1


class _CountingSlice:
    def __init__(self, inner, counter: _Counter) -> None:
        self._inner = inner
        self._counter = counter

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._counter.add(tensor)
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CountingFile:
    def __init__(self, inner, counter: _Counter) -> None:
        self._inner = inner
        self._counter = counter
        with counter.lock:
            counter.opens += 1

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def get_slice(self, key):
        return _CountingSlice(self._inner.get_slice(key), self._counter)

    def get_tensor(self, key):
        tensor = self._inner.get_tensor(key)
        self._counter.add(tensor)
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def count_safe_open() -> Iterator[_Counter]:
    """Count what every ``safe_open`` (safetensors, and transformers' own import of it) hands out:
    ``bytes`` materialized from the mapping and ``slices`` (one per ``get_slice()[...]`` or
    ``get_tensor``, the mmap reader's equivalent of a request)."""
    import safetensors

    counter = _Counter()
    original = safetensors.safe_open

    def counting(*args, **kwargs):
        return _CountingFile(original(*args, **kwargs), counter)

    targets = [safetensors]
    with contextlib.suppress(ImportError):
        import transformers.modeling_utils as modeling_utils

        targets.append(modeling_utils)
    saved = [(t, t.safe_open) for t in targets]
    for t in targets:
        t.safe_open = counting
    try:
        yield counter
    finally:
        for t, value in saved:
            t.safe_open = value


@dataclass
class Timer:
    """Wall times of one timed call, on this rank and to the end of the slowest rank."""

    own_s: float = 0.0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def timed_across_ranks() -> Iterator[Timer]:
    """Barrier, run the body, note this rank's time, barrier again: ``wall_s`` is the load as the
    job sees it (the slowest rank), ``own_s`` this rank's part."""
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    timer = Timer()
    if group:
        dist.barrier()
    start = time.perf_counter()
    yield timer
    timer.own_s = time.perf_counter() - start
    if group:
        dist.barrier()
    timer.wall_s = time.perf_counter() - start


# -- a load's phases -----------------------------------------------------------------------------

SEQUENTIAL = ("metadata", "plan", "spans", "read", "exchange", "finish")
"""The phases of ``LoadReport.seconds`` that follow each other: with ``other`` they make the load."""


def phase_seconds(seconds: Mapping[str, float], own_s: float) -> dict[str, float]:
    """Every phase of a load's ``LoadReport.seconds`` (0 where it had none) and ``other``: the part of
    its own wall time ``own_s`` no sequential phase covers (the state dict, DCP's own steps)."""
    from hp_dcp_hf.load.api import PHASES

    out = {phase: float(seconds.get(phase, 0.0)) for phase in PHASES}
    out["other"] = max(0.0, own_s - sum(out[phase] for phase in SEQUENTIAL))
    return out


def median_phases(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per phase, the median over repetitions (each phase on its own)."""
    import statistics

    return {phase: statistics.median(run[phase] for run in runs) for phase in runs[0]} if runs else {}


def phase_table(rows: Sequence[tuple[str, int, float, Mapping[str, float]]], floor: Mapping[int, float]) -> list[str]:
    """Markdown lines: per ``(contender, rank, own s, phases)`` a row of its phases (seconds) beside the
    floor's own time on that rank (``floor``: rank -> seconds)."""
    from hp_dcp_hf.load.api import PHASES

    names = [*PHASES, "other"]
    lines = ["| contender | rank | own s | floor s | " + " | ".join(f"{n} s" for n in names) + " |",
             "|" + "---|" * (4 + len(names))]
    for contender, rank, own, phases in rows:
        base = floor.get(rank)
        lines.append(f"| `{contender}` | {rank} | {own:.3f} | {'-' if base is None else f'{base:.3f}'} | "
                     + " | ".join(f"{phases.get(n, 0.0):.3f}" for n in names) + " |")
    return lines


PHASES_NOTE = ("Phases (`LoadReport.seconds`, median per phase over the repetitions): metadata, plan, spans, read, "
               "exchange and finish follow each other, *other* is the rest of the rank's own time (state dict, DCP's "
               "steps); *first_byte* (from the start of the reads to the first bytes from storage in memory) and "
               "*convert* (copies out of staging and commits, summed over the read threads) are parts of them; "
               "*copy*: of read, the wait for copies to a device. *floor s*: the floor's own time on that rank.")

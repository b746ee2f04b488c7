"""Bounded host staging for the bytes that cannot land in their destination as read, and the copies
out of it.

A read lands in its destination directly when that is a contiguous CPU tensor of the checkpoint's
dtype. Otherwise its bytes go to a slot of a :class:`StagingRing` first: a cast or a strided view
on the CPU is one ``copy_`` out of the slot, and a CUDA destination is one copy to the device. The
ring is what bounds the memory of the reads in flight: a reader waits for a slot while all of them
are taken.

For CUDA destinations (:class:`SlotCopier`) the slots are pinned, so the copies to the device run
asynchronously, on a side stream per device, while the next reads fill other slots; a slot goes
back to the ring once an event says its copies are done. Strided or cast boxes travel to the device
contiguous, as stored, and are laid out there by one copy on the device (which casts), never through
pageable memory. Without a CUDA destination nothing here touches ``torch.cuda``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from hp_dcp_hf.storage.read.copy import copy_into


@dataclass(frozen=True)
class Slot:
    """The first ``nbytes`` bytes of one of the ring's buffers, held until released."""

    buffer: torch.Tensor
    nbytes: int

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]


@dataclass(frozen=True)
class StagingStats:
    """What went through the ring during one ``read_data``."""

    bytes_staged: int = 0
    """Bytes copied out of slots into destinations (alignment padding excluded)."""
    device_bytes: int = 0
    """Of ``bytes_staged``, those copied to CUDA devices."""
    peak_bytes: int = 0
    """The most slot bytes held at once (padding included); never more than ``capacity``."""
    capacity: int = 0
    """``slots x slot_bytes``: the bound on ``peak_bytes``."""
    wait_seconds: float = 0.0
    """Time readers waited for device copies: for a free slot, and for the last copies at the end."""


class StagingRing:
    """At most ``slots`` host buffers of ``slot_bytes`` each, allocated on first need (a load whose
    reads all land in place allocates none) and reused; pinned when ``pin`` (only then may copies
    to a CUDA device be asynchronous). :meth:`acquire` blocks while every slot is taken."""

    def __init__(self, slots: int, slot_bytes: int, *, pin: bool = False) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._changed = threading.Condition()
        self.in_use = 0
        self.peak_bytes = 0
        self.wait_seconds = 0.0

    def acquire(self, nbytes: int) -> Slot:
        """A slot of ``nbytes`` bytes, once one is free. A request larger than a slot is a caller's
        bug (reads are cut to the slot size before), so it raises rather than exceed the bound."""
        if not 0 < nbytes <= self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a staging slot of {self.slot_bytes} bytes: cut the read")
        with self._changed:
            if not self._free and self._allocated == self.slots:
                start = time.perf_counter()
                self._changed.wait_for(lambda: bool(self._free))
                self.wait_seconds += time.perf_counter() - start
            buffer = self._free.pop() if self._free else None
            if buffer is None:
                self._allocated += 1
            self.in_use += nbytes
            self.peak_bytes = max(self.peak_bytes, self.in_use)
        if buffer is None:
            buffer = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)
        return Slot(buffer, nbytes)

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back: no copy reads from it any more."""
        with self._changed:
            self._free.append(slot.buffer)
            self.in_use -= slot.nbytes
            self._changed.notify()


Copy = tuple[torch.Tensor, torch.Tensor]
"""``(destination, staged)``: a destination and its values in a slot, as stored (checkpoint dtype,
contiguous)."""


class SlotCopier:
    """Copies a slot's staged values into their destinations, then gives the slot back to ``ring``
    and calls the slot's ``done``: at once for CPU destinations; for CUDA ones (on ``devices``)
    asynchronously, on a side stream per device, and a thread of its own waits for the copies.

    The side streams are made (and wait for the caller's current streams, which may still be
    initializing the destinations) by the constructor, so build it on the thread that owns the
    destinations. :meth:`close` waits for every copy and returns the first error of a ``done``.
    """

    def __init__(self, ring: StagingRing, devices: Collection[torch.device]) -> None:
        self.ring = ring
        self.bytes_staged = 0
        self.device_bytes = 0
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        for device in devices:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._streams[device] = stream
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._waiter: threading.Thread | None = None
        if self._streams:
            self._waiter = threading.Thread(target=self._wait_copies, name="hp-dcp-hf-copies", daemon=True)
            self._waiter.start()

    def copy(self, slot: Slot | None, copies: Sequence[Copy], done: Callable[[], None]) -> None:
        """Copy each staged value into its destination, then release ``slot`` and call ``done``
        (once the device copies are done, on the copier's thread, when there are any). On an error
        the slot is released all the same (once what was issued from it is done)."""
        on_device: dict[torch.device, list[Copy]] = defaultdict(list)
        events: list[torch.cuda.Event] = []
        try:
            for dest, staged in copies:
                if dest.device.type == "cuda":
                    on_device[dest.device].append((dest, staged))
                else:
                    copy_into(dest, staged)
            for device, group in on_device.items():
                events.append(self._issue(device, group))
        except BaseException:
            self._retire(events, slot, None)
            raise
        with self._lock:
            self.bytes_staged += sum(staged.nbytes for _, staged in copies)
            self.device_bytes += sum(staged.nbytes for group in on_device.values() for _, staged in group)
        self._retire(events, slot, done)

    def _retire(self, events: list[torch.cuda.Event], slot: Slot | None, done: Callable[[], None] | None) -> None:
        """Release ``slot`` and call ``done`` now, or on the copier's thread once ``events`` complete."""
        if events:
            self._pending.put((events, slot, done))
            return
        if slot is not None:
            self.ring.release(slot)
        if done is not None:
            done()

    def _issue(self, device: torch.device, copies: Sequence[Copy]) -> torch.cuda.Event:
        """Non-blocking copies to ``device`` on its side stream; the event that marks their end."""
        stream = self._streams[device]
        with torch.cuda.stream(stream):
            for dest, staged in copies:
                if dest.dtype == staged.dtype and dest.is_contiguous():
                    dest.copy_(staged, non_blocking=True)
                else:  # contiguous to the device, then one strided (and casting) copy there
                    dest.copy_(staged.to(device, non_blocking=True))
            event = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins
            event.record(stream)
        return event

    def _wait_copies(self) -> None:
        while (pending := self._pending.get()) is not None:
            events, slot, done = pending
            try:
                for event in events:
                    event.synchronize()
                if done is not None:
                    done()
            except BaseException as error:  # noqa: BLE001 - close() returns it
                self._errors.append(error)
            finally:  # whatever happened, a reader waiting for a slot must get one
                if slot is not None:
                    self.ring.release(slot)

    def close(self) -> BaseException | None:
        """Wait for every copy issued (and its ``done``); the first error of one, if any."""
        if self._waiter is not None:
            start = time.perf_counter()
            self._pending.put(None)
            self._waiter.join()
            for stream in self._streams.values():
                stream.synchronize()
            self.ring.wait_seconds += time.perf_counter() - start
        return self._errors[0] if self._errors else None

    @property
    def stats(self) -> StagingStats:
        ring = self.ring
        return StagingStats(self.bytes_staged, self.device_bytes, ring.peak_bytes, ring.slots * ring.slot_bytes,
                            ring.wait_seconds)

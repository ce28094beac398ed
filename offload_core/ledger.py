"""The transfer ledger: what crossed the bus, how often, and what it cost the host and the GPU."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, fields
from typing import Any

#: Past this many unread timers of one kind, recording one folds the finished ones into the total.
FOLD_WAITS_AT = 64


@dataclass
class GpuTimes:
    """GPU time between pairs of timing events (a stream's ``start`` to its ``end``), read as far as the GPU
    has got: only pairs whose ``end`` it has reached are read, so asking never stalls the host."""

    ms: float = 0.0  # the pairs read so far
    count: int = 0
    _pending: list[tuple[Any, Any]] = field(default_factory=list)

    def add(self, start: Any, end: Any) -> None:
        self._pending.append((start, end))
        if len(self._pending) > FOLD_WAITS_AT:
            self.read()  # nobody reads the figures: keep only the timers the GPU has not reached

    def read(self) -> float:
        """The milliseconds of the pairs read so far, those the GPU has just passed included."""
        pending = []
        for start, end in self._pending:
            if end.query():
                self.ms += start.elapsed_time(end)
                self.count += 1
            else:
                pending.append((start, end))
        self._pending = pending
        return self.ms

    def mean_ms(self) -> float | None:
        """Milliseconds per pair, None before one was read."""
        self.read()
        return self.ms / self.count if self.count else None


@dataclass
class TransferLedger:
    """Counters behind ``GroupOffloadHandle.stats()``.

    ``bytes_d2h`` exists to be read, not written: this engine never copies weights back, and the
    benchmarks compare it against baselines that do. A copy counts once it is queued, a gather once it
    is done; the gather worker counts its own, under the ledger's lock.
    """

    bytes_h2d: int = 0
    bytes_d2h: int = 0
    copies_h2d: int = 0
    copies_d2h: int = 0
    onloads: int = 0  # groups brought onto the device (streamed or resident)
    sync_onloads: int = 0  # of those, onloads the compute had to wait for on the host side
    prefetches: int = 0
    staged_copies: int = 0  # of the copies, those that went through a staging buffer (not a pinned packed mirror)
    gathers: int = 0  # onloads of groups kept in place (beyond the host budget), gathered tensor by tensor
    gathered_bytes: int = 0
    gathered_from_disk_bytes: int = 0  # of those, bytes whose pages the page cache did not hold before
    gather_seconds: float = 0.0  # time the gathers took (on the gather worker, off the host thread)
    hook_seconds: float = 0.0  # host time spent inside the hooks
    hook_calls: int = 0  # group entries (each streamed or resident group run counts once)
    back_offs: int = 0  # plans given up for one that holds less, after a call ran out of device memory
    read_ahead: int = 0  # groups whose disk reads are asked for ahead of the group being gathered (``lookahead``)
    _waits: GpuTimes = field(default_factory=GpuTimes, repr=False)  # the compute stream waiting for a copy
    _copies: GpuTimes = field(default_factory=GpuTimes, repr=False)  # a staged copy, on the copy stream
    _computes: GpuTimes = field(default_factory=GpuTimes, repr=False)  # a streamed group's run, on the compute stream
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_hook(self, seconds: float, entered: bool) -> None:
        """Host time of one hook body; ``entered`` counts a group run (its enter, not its exit)."""
        self.hook_seconds += seconds
        self.hook_calls += entered

    def record_copy(self, nbytes: int, staged: bool = False) -> None:
        """A copy to the device queued; ``staged``: from a staging buffer."""
        with self._lock:
            self.bytes_h2d += nbytes
            self.copies_h2d += 1
            self.staged_copies += staged

    def record_gather(self, nbytes: int, from_disk: int, seconds: float) -> None:
        with self._lock:
            self.gathers += 1
            self.gathered_bytes += nbytes
            self.gathered_from_disk_bytes += from_disk
            self.gather_seconds += seconds

    def record_wait(self, start: Any, end: Any) -> None:
        self._waits.add(start, end)

    def record_copy_time(self, start: Any, end: Any) -> None:
        """The timing events around a staged copy on the copy stream (the gather worker records them)."""
        with self._lock:
            self._copies.add(start, end)

    def record_compute(self, start: Any, end: Any) -> None:
        """The timing events around a streamed group's run on the compute stream."""
        self._computes.add(start, end)

    def wait_ms(self) -> float:
        """GPU time the compute stream spent waiting for copies, as far as the GPU has got (never waits)."""
        return self._waits.read()

    def per_group_ms(self) -> tuple[float | None, float | None, float | None]:
        """Milliseconds per group of a gather, a staged copy and a streamed group's run, as measured so far
        (None: none measured yet)."""
        gather = 1e3 * self.gather_seconds / self.gathers if self.gathers else None
        with self._lock:
            copy = self._copies.mean_ms()
        return gather, copy, self._computes.mean_ms()

    def lookahead(self, cap: int) -> int | None:
        """How many groups ahead of its use a group's read must start for it to be ready in time: its gather
        and copy over the compute per group, ``ceil((gather + copy) / compute)``, from 1 to ``cap``; None
        until all three are measured (and the compute took time)."""
        gather, copy, compute = self.per_group_ms()
        if gather is None or copy is None or not compute:
            return None
        return max(1, min(cap, math.ceil((gather + copy) / compute)))

    def as_dict(self) -> dict[str, float | int]:
        stats = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        stats["compute_wait_ms"] = self.wait_ms()
        stats["hook_us_per_group"] = 1e6 * self.hook_seconds / self.hook_calls if self.hook_calls else 0.0
        gather, copy, compute = self.per_group_ms()
        stats["gather_ms_per_group"], stats["copy_ms_per_group"], stats["compute_ms_per_group"] = (
            gather or 0.0, copy or 0.0, compute or 0.0)
        return stats

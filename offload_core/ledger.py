"""The transfer ledger: what crossed the bus, how often, and what it cost the host and the GPU."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

import torch

#: Past this many unread wait timers, recording one folds the finished ones into the total.
FOLD_WAITS_AT = 64


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
    _wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)
    _wait_ms: float = 0.0
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

    def record_wait(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._wait_events.append((start, end))
        if len(self._wait_events) > FOLD_WAITS_AT:
            self.wait_ms()  # nobody reads the stats: keep only the timers the GPU has not reached

    def wait_ms(self) -> float:
        """GPU time the compute stream spent waiting for copies, as far as the GPU has got.

        Only events the GPU has already passed are read, so asking never stalls the host.
        """
        pending = []
        for start, end in self._wait_events:
            if end.query():
                self._wait_ms += start.elapsed_time(end)
            else:
                pending.append((start, end))
        self._wait_events = pending
        return self._wait_ms

    def as_dict(self) -> dict[str, float | int]:
        stats = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        stats["compute_wait_ms"] = self.wait_ms()
        stats["hook_us_per_group"] = 1e6 * self.hook_seconds / self.hook_calls if self.hook_calls else 0.0
        return stats

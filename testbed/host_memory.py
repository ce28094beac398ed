"""Host memory of this process, from ``/proc/self/status`` (Linux).

``VmHWM`` is the peak resident set; writing ``5`` to ``/proc/self/clear_refs`` resets it to the
current resident set, so a peak can be read for one phase (loading, sampling) at a time.
File-backed pages (a memory-mapped safetensors file) count as resident too, as they do for users.
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line")
    return int(match.group(1))


def rss_bytes() -> int:
    """The resident set now."""
    return _status_kib("VmRSS") * 1024


def rss_anon_bytes() -> int:
    """The anonymous resident memory now (``RssAnon``): what the process holds that no file backs; page cache
    and memory-mapped files are not counted."""
    return _status_kib("RssAnon") * 1024


def peak_rss_bytes() -> int:
    """The peak resident set since the process started or since :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Start a new peak at the current resident set; ``False`` (logged) where the kernel refuses."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError as error:
        log.warning("cannot reset the peak RSS (%s); peaks then include earlier phases", error)
        return False
    return True


class PeakAnonymous:
    """The highest :func:`rss_anon_bytes` seen while it runs (a ``with`` block), sampled on a thread every
    ``interval`` seconds: the kernel keeps no peak of the anonymous memory alone."""

    def __init__(self, interval: float = 0.002) -> None:
        self.peak, self._interval, self._done = rss_anon_bytes(), interval, threading.Event()
        self._lock = threading.Lock()  # (a subclass may start a new peak while the thread samples)
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self._interval):
            with self._lock:
                self.peak = max(self.peak, rss_anon_bytes())

    def __enter__(self) -> "PeakAnonymous":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())

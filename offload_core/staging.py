"""Staging buffers: how a group whose host copy is not a pinned packed mirror still reaches the device in
one copy at the pinned rate, without holding the host thread.

Two kinds of groups go this way: those whose pinning was refused (a pinned-memory limit) and those
beyond the host budget, whose tensors stay in place (views of a mapped file); and the resident groups as
they load (never pinned: their host copy is read again only once dropped). A copy from pageable
memory runs at a tenth of the pinned rate (5.8–7.9 GB/s against 55 GB/s on an H200) and blocks the
host while it runs. Instead, the engine keeps a ring of two pinned buffers and a gather worker: the
worker copies the group's bytes into the next buffer (a host-to-host copy; for a mapped file, a read
from the page cache or the disk) and queues the copy from it to the device on the copy stream, while
the host thread goes on launching kernels. A buffer is written again only once the worker has waited
for the copy that read it (its "sent" event): the one cross-stream rule here, checked by
``testbed/stream_checker.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from .mirror import HostMirror, Pinner
from .runtime import Runtime

#: One buffer is filled while the copy from the other one runs.
STAGING_BUFFERS = 2


class StagingRing:
    """``STAGING_BUFFERS`` host buffers of ``nbytes`` each (pinned when the pinner allows), used in turn."""

    def __init__(self, runtime: Runtime, nbytes: int, count: int = STAGING_BUFFERS) -> None:
        self.nbytes = nbytes
        self._runtime = runtime
        self._buffers = [HostMirror([], nbytes) for _ in range(count)]
        self._sent: list[Any] = [None] * count  # each buffer's last copy to the device
        self._next = 0

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self._buffers)

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes * sum(buffer.pinned for buffer in self._buffers)

    def pin(self, pinner: Pinner, drain: Any) -> bool:
        """Pin every buffer, or none (``drain`` waits for the copies before one is unpinned)."""
        if all(buffer.pin(pinner, drain) for buffer in self._buffers):
            return True
        self.unpin()
        return False

    def unpin(self) -> None:
        for buffer in self._buffers:
            buffer.unpin()

    def claim(self) -> int:
        """The buffer the next staged copy goes through (claimed in the order the copies are queued)."""
        index, self._next = self._next, (self._next + 1) % len(self._buffers)
        return index

    def free_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of buffer ``index``, once its last copy out has run (the host waits for it)."""
        if self._sent[index] is not None:
            self._sent[index].synchronize()  # the copy stream has read what this buffer held
            self._sent[index] = None
        return self._buffers[index].buffer[:nbytes]

    def sent(self, index: int, stream: Any) -> None:
        """The copy out of buffer ``index`` is queued on ``stream``."""
        self._sent[index] = self._runtime.new_event()
        self._sent[index].record(stream)

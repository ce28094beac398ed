"""Pinned staging buffers: how a group whose host copy is not pinned still reaches the device at the
pinned rate.

A copy from pageable memory runs at a tenth of the pinned rate (5.8–7.9 GB/s against 55 GB/s on an
H200) and blocks the host while it runs. When pinning is refused for some groups (a pinned-memory
limit), the engine keeps a ring of two pinned buffers instead: the host copies the group's mirror into
the next one (a host-to-host copy, parallel across cores) and the copy stream moves it to the device
asynchronously. A buffer is written again only once the host has waited for the copy that read it
(its "sent" event): the one cross-stream rule here, checked by ``tests/stream_checker.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from .mirror import HostMirror, Pinner
from .runtime import Runtime

#: One buffer is filled while the copy from the other one runs.
STAGING_BUFFERS = 2


class StagingRing:
    """``STAGING_BUFFERS`` pinned host buffers of ``nbytes`` each, used in turn."""

    def __init__(self, runtime: Runtime, nbytes: int, count: int = STAGING_BUFFERS) -> None:
        self.nbytes = nbytes
        self._runtime = runtime
        self._buffers = [HostMirror([], nbytes) for _ in range(count)]
        self._sent: list[Any] = [None] * count  # each buffer's last copy to the device
        self._next = 0

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

    def stage(self, source: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``source`` (host bytes) copied into the next buffer, once its last copy out has run; returns the
        filled part and the buffer's index for :meth:`sent`."""
        index, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._sent[index] is not None:
            self._sent[index].synchronize()  # the copy stream has read what this buffer held
            self._sent[index] = None
        target = self._buffers[index].buffer[: source.numel()]
        self._runtime.host_copy(target, source)
        return target, index

    def sent(self, index: int, stream: Any) -> None:
        """The copy out of buffer ``index`` is queued on ``stream``."""
        self._sent[index] = self._runtime.new_event()
        self._sent[index].record(stream)

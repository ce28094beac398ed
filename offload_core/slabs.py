"""The streamed groups' device buffers ("slabs"): how many a prefetch depth needs, the free list, and
when the copy stream may write into one.

A slab is as large as the largest streamed group; each streamed group is copied into one for its run
and hands it back after. Every buffer the pool hands out is safe for the copy stream to write: a freed
slab waits for its "released" event, fresh memory for the compute stream (see the stream choreography in
``transfers.py``).
"""
from __future__ import annotations

from typing import Any

import torch

from .runtime import Runtime


def slabs_for(prefetch: int) -> int:
    """Slabs a prefetch depth cycles through: one for the group running, one for each group copied ahead."""
    return prefetch + 1


class SlabPool:
    """The slabs made so far, the free ones, and the event each freed slab's last reader recorded."""

    def __init__(self, device: torch.device, runtime: Runtime | None, copy_stream: Any, inference: bool) -> None:
        self.slab_bytes = 0
        self.made = 0
        self._device = device
        self._runtime = runtime  # None: the device is the host, copies are synchronous
        self._copy_stream = copy_stream
        self._inference = inference  # the kind of tensors to make (see ``ModuleGroup``)
        self._free: list[torch.Tensor] = []
        self._released: dict[int, Any] = {}  # slab data_ptr -> event

    def held_bytes(self) -> int:
        return self.slab_bytes * self.made

    def can_take(self, prefetch: int) -> bool:
        """Whether a slab is free or another may be made within what ``prefetch`` needs."""
        return bool(self._free) or self.made < slabs_for(prefetch)

    def take(self) -> torch.Tensor:
        """A free slab once its last reader has run, else a new one (beyond the plan when more groups run
        at once than there are slabs: re-entrant blocks)."""
        if self._free:
            slab = self._free.pop()
            released = self._released.pop(slab.data_ptr(), None)
            if released is not None:
                self._copy_stream.wait_event(released)  # the last group that read this slab has run
            return slab
        slab = self.allocate(self.slab_bytes)
        self.made += 1  # counted once made: an allocation may run out of memory
        return slab

    def release(self, slab: torch.Tensor) -> None:
        """Free ``slab`` once the kernels queued on the compute stream so far, its readers, have run."""
        if self._runtime is not None:
            released = self._runtime.new_event()
            released.record(self._runtime.current_stream())
            self._released[slab.data_ptr()] = released
        self._free.append(slab)

    def put_back(self, slab: torch.Tensor) -> None:
        """Free a slab nothing read (a failed onload); the caller has waited for the copy into it."""
        self._free.append(slab)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Fresh device memory for the copy stream to fill (a slab, or a resident group's own buffer)."""
        with torch.inference_mode(self._inference):
            if self._runtime is None:
                return torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            buffer = self._runtime.empty(nbytes)
        # It comes from the compute stream's pool: kernels queued there may still read this memory.
        self._copy_stream.wait_stream(self._runtime.current_stream())
        return buffer

    def forget(self) -> None:
        """Drop every slab (the caller has waited for the copies into them)."""
        self._free.clear()
        self._released.clear()
        self.made = 0

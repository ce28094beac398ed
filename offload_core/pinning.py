"""Which host copies are page-locked, and the staging ring for the groups that stream without a pin.

Only streamed groups are pinned (a resident group's host copy is read again only after its device copy
is dropped). Groups pinning refused (a pinned-memory limit) and groups kept in place by the host budget
reach the device through a ``StagingRing`` on a CUDA device; past a limit the ring takes the room of the
last pinned groups. Where there is a ring, the resident groups load through it too; where there is none (every
group packed, every pin granted), one is made for the resident groups' load while they hold more bytes than it
(``HostPins.pin_streamed``).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .group import ModuleGroup
from .hostlimits import host_room
from .mirror import CudaHostRegister, Pinner
from .runtime import Runtime
from .staging import STAGING_BUFFERS, StagingRing

log = logging.getLogger(__name__)


def choose_pinner(pin_memory: bool, pinner: Pinner | None, device: torch.device, runtime: Runtime | None) -> Pinner | None:
    """A given pinner decides for itself (it may know a host whose onload device is not CUDA);
    the default one pins only for a CUDA onload device (a ``runtime``)."""
    if not pin_memory:
        return None
    if pinner is not None:
        return pinner
    if runtime is None:
        log.info("pin_memory ignored: the onload device %s is not a CUDA device", device)
        return None
    return CudaHostRegister(device)


class HostPins:
    """The pins of one handle's groups (``groups``, as the handle fills it) and its staging ring."""

    def __init__(self, groups: list[ModuleGroup], pinner: Pinner | None, runtime: Runtime | None,
                 drain: Callable[[], None] | None) -> None:
        self.groups = groups
        self.staging: StagingRing | None = None
        self.seconds = 0.0  # host time spent registering (and refused registering) mirrors, in all
        self._pinner = pinner
        self._runtime = runtime  # None: the device is the host, nothing to stage
        self._drain = drain  # waits for every copy queued or to be queued (before host memory is unpinned)

    @property
    def staging_bytes(self) -> int:
        return 0 if self.staging is None else self.staging.pinned_bytes

    def pin_streamed(self) -> int:
        """Pin every streamed group's mirror the pinner accepts, unpin the resident ones; a refusal
        does not stop the others. Groups kept in place, and those pinning refused, go through a
        staging ring on a CUDA device; the ring stays from one call to the next while it is wanted (a
        sampling run makes one). Returns the streamed packed bytes left in pageable memory.

        Without such a ring (every group packed, every pin granted), the resident groups yet to load get one
        for their load where it pays and fits (``_ring_for_loading``): then none is copied from pageable memory,
        which holds the host thread at a tenth of the pinned rate. That ring goes at the first call that finds
        every resident group on the device (in the nodes, the sampling run's start, which waits for the load's
        copies), not once the last of them is queued: a back-off in the run makes streamed groups of
        resident ones, which stream through the ring the load left (``stage_unpinned``) rather than pin one
        afresh, and the next replan loads through it again, so a back-off each run pins nothing. Nor is it kept
        through the run: it would hold two groups of page-locked memory, and of ComfyUI's pinned limit, that no
        copy reads. A model loaded anew each run (two models taking turns) pins the ring once per load; another
        model that needs pins takes the ring before any streamed group's pin (``unpin``)."""
        started = time.perf_counter()
        refused = 0
        if self._pinner is not None:
            for group in self.groups:
                if group.resident:
                    group.mirror.unpin()  # first, so that the streamed ones can have what it held
            refused = self._pin_pageable_groups()
            if refused and self._runtime is not None:
                self._runtime.discard_last_error()  # once for the pass, so that it does not surface at a later launch
        in_place = any(not g.mirror.packed for g in self.groups)
        pins_at_a_limit = refused and any(g.mirror.pinned for g in self.groups)  # not a driver that pins nothing
        if self._runtime is not None and (in_place or pins_at_a_limit):
            self._stage(refused)
        elif not refused and self._ring_for_loading():
            self._stage(refused=0)
        else:
            self.drop_staging()
        self.seconds += time.perf_counter() - started
        if refused:
            refused = sum(g.nbytes for g in self.groups if not g.resident and g.mirror.packed and not g.mirror.pinned)
            ring = (f"through {self.staging_bytes / 2**20:.1f} MB of pinned staging buffers"
                    if self.staging_bytes else "from pageable memory (slower copies)")
            log.info("%.1f MB of streamed groups stay in pageable memory and stream %s: pinning was refused",
                     refused / 2**20, ring)
        return refused

    def _ring_for_loading(self) -> bool:
        """Whether the resident groups not on the device yet load through a pinned ring (every group is packed,
        every streamed one pinned, so that no stream needs one): where they hold more bytes than the ring (a
        ring that would carry less than its own size is not worth registering) and, unless it is held already,
        it takes at most half the host memory the process may still take (``host_room``: the RAM available, a
        container's limit), leaving as much again to the rest of the load; the pinner may still refuse it (a
        pinned limit). Otherwise they load from pageable memory, as without a ring."""
        if self._runtime is None or self._pinner is None:
            return False
        ring_bytes = STAGING_BUFFERS * max(g.nbytes for g in self.groups)
        if sum(g.nbytes for g in self.groups if g.resident and not g.onloaded) <= ring_bytes:
            return False
        if self.staging is not None:
            return True
        room = host_room()
        return room is None or 2 * ring_bytes <= room

    def stage_unpinned(self) -> None:
        """After a back-off: the groups that no longer stay resident stream from the pageable memory a resident
        group is left in. Rather than pin them in the middle of the recovery (their pins would go again at
        the next plan), they stream through the staging ring: made if there is none, two groups' worth."""
        if self._runtime is None or self._pinner is None or self.staging is not None:
            return
        if any(not g.resident and g.mirror.packed and not g.mirror.pinned for g in self.groups):
            started = time.perf_counter()
            self._stage(refused=0)
            self.seconds += time.perf_counter() - started

    def unpin(self, at_least: int | None = None) -> int:
        """Return the mirrors' page-locked memory (they stay valid), all of it or, last groups first, at least
        ``at_least`` bytes of it; returns the bytes unpinned. A ring no streamed group needs (the resident
        groups' load's) goes first: it only spares the load a copy from pageable memory."""
        freed = 0
        if self.staging is not None and self._ring_only_loads():
            freed = self.staging.pinned_bytes
            self.drop_staging()
        freed += self._unpin_groups(None if at_least is None else at_least - freed)
        if self.staging is not None and (at_least is None or freed < at_least):
            freed += self.staging.pinned_bytes
            if all(g.mirror.packed for g in self.groups):
                self.drop_staging()
            else:  # the groups kept in place stream through it still, from pageable memory
                self.staging.unpin()
        return freed

    def _ring_only_loads(self) -> bool:
        """Whether the ring carries no streamed group: every group packed, every streamed one pinned."""
        return all(g.mirror.packed and (g.resident or g.mirror.pinned) for g in self.groups)

    def drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.unpin()  # after the copies that read it (the drain given to ``pin``)
            self.staging = None

    def _unpin_groups(self, at_least: int | None) -> int:
        freed = 0
        for group in reversed(self.groups):
            if at_least is not None and freed >= at_least:
                break
            if group.mirror.pinned:
                group.mirror.unpin()  # after the copies that read it (the drain given to ``pin``)
                freed += group.nbytes
        return freed

    def _stage(self, refused: int) -> None:
        """The staging ring, as large as two of the largest groups (the groups never change size: an earlier
        call's ring fits), pinned (when pinning was refused for some groups, in the room of the last pinned
        ones): every unpinned copy then runs at the pinned rate, for two groups' worth of pins. A ring that
        gave its pins up takes them back. Unpinned when the pinner refuses it, for groups kept in place."""
        ring = self.staging or StagingRing(self._runtime, max(g.nbytes for g in self.groups))
        if self._pinner is not None and not ring.pinned_bytes:
            if refused:
                self._unpin_groups(at_least=ring.total_bytes)
            if not ring.pin(self._pinner, self._drain):
                self._runtime.discard_last_error()
                if refused:
                    self._pin_pageable_groups()  # no pinned ring after all: the groups take their pins back
                    self._runtime.discard_last_error()
        self.staging = ring if ring.pinned_bytes or any(not g.mirror.packed for g in self.groups) else None

    def _pin_pageable_groups(self) -> int:
        """Pin each streamed packed group not pinned yet (a refusal's CUDA error is the caller's to discard,
        once per pass: it syncs the device); the bytes the pinner refused."""
        return sum(g.nbytes for g in self.groups if not g.resident and g.mirror.packed and not g.mirror.pinned
                   and not g.pin(self._pinner, self._drain))

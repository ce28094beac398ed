"""The transfers: how a group's bytes reach its device buffer, and how the streams wait for them.

A group is copied into a slab (a streamed group) or a buffer of its own (a resident one); the onload
patch rewrites its patched weights there once the compute stream has waited for the copy. Three routes,
by where the bytes come from:

- the device is the host: a plain copy, there and then;
- a pinned packed mirror: one copy on the copy stream, in the host thread's own time (it does not block);
- a group kept in place, a packed mirror pinning refused, or a resident one where there is a ring
  (``staged``; the resident groups' load makes one where there is none: ``HostPins.pin_streamed``): the
  gather worker copies its bytes into a buffer of the staging ring and queues the copy
  from there on the copy stream (``staging.py``); the group's ``pending`` future yields the ``ready``
  event once the worker queued it.

While the worker gathers a group kept in place, the disk reads the next ones ahead (``MADV_WILLNEED``), as
many as it takes for a group's read to be done by its turn: ``TransferLedger.lookahead``, the gather and
copy per group over the compute per group as measured so far (the compute timed on the compute stream
where groups are read ahead), recomputed at each gather, at most the staging ring's slots, at least 1.

Stream choreography on CUDA (the only cross-stream ordering there is; ``testbed/stream_checker.py``
proves it on every test run):

- ``group.ready``  recorded on the copy stream after the copy into the slab; the compute stream waits
  on it before the group runs, then applies the onload patch (``wait_for``): once per onload, on the
  host thread, whichever route the copy took;
- the copy stream allocates nothing  (the patch's temporaries come from the compute stream's pool).
  Under cudaMallocAsync torch lets the pool hand memory freed on one stream to another behind an
  internal dependency: a block freed on the copy stream, handed to the compute stream, would order the
  compute after whatever the copy stream queued meanwhile (the next group's copy), unseen;
- a slab's "released" event  recorded on the compute stream when the group that read the slab has
  run (``SlabPool.release``); the copy stream waits on it before it overwrites the slab (``take``);
- fresh device memory  comes from the compute stream's pool of the caching allocator, where
  queued kernels may still read it: the copy stream waits for the compute stream (``wait_stream``)
  before its first copy into it (``SlabPool.allocate``);
- dropping device memory  the compute stream waits for the copy stream first, so the allocator
  reuses it only after the copies into it (``finish_copies``); unpinning a mirror waits for the copy
  stream on the host (``drain_copies``, the pins' drain).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch

from .group import ModuleGroup
from .ledger import TransferLedger
from .mirror import Pinner
from .onload_patch import OnloadPatch
from .pinning import HostPins
from .runtime import Runtime
from .slabs import SlabPool
from .staging import StagingRing

log = logging.getLogger(__name__)

# What the thread that runs the code now is doing: ``job`` is True inside a gather job (the worker's).
_THREAD = threading.local()


class Transfers:
    """The copies of one handle's groups onto ``device``: its copy stream, slabs, pins and staging ring."""

    def __init__(self, groups: list[ModuleGroup], device: torch.device, runtime: Runtime | None,
                 pinner: Pinner | None, patch: OnloadPatch) -> None:
        self.ledger = TransferLedger()
        self.runtime = runtime  # None: the device is the host, copies are synchronous
        self.copy_stream = runtime.new_stream() if runtime is not None else None
        self._groups = groups
        self._patch = patch
        self._inference = any(g.inference for g in groups)  # the kind of device buffers to make
        self.slabs = SlabPool(device, runtime, self.copy_stream, self._inference)
        self.pins = HostPins(groups, pinner, runtime, None if runtime is None else _drain_without_holding(self))
        self.groups_changed()  # ``_in_place``: groups whose disk reads may go ahead
        self.lookahead = 1  # groups read ahead of the one gathered, until measured (``_settle_lookahead``)
        self._runs_timed: dict[int, object] = {}  # group index -> the timing event its run began at

    def groups_changed(self) -> None:
        """A group's host copy changed kind (``GroupOffloadHandle.give_up_packing``)."""
        self._in_place = any(not g.mirror.packed for g in self._groups)

    # --- onload --------------------------------------------------------------------------------

    def onload(self, group: ModuleGroup, prefetched: bool, upcoming: list[ModuleGroup]) -> None:
        """Start copying ``group`` into a device buffer and point its modules there (the compute waits
        for it in ``wait_for``). ``upcoming``: the groups that stream after it, for the disk to read
        ahead while it is gathered. A streamed group takes a free slab: the caller has made one free."""
        slab = self.slabs.allocate(group.nbytes) if group.resident else self.slabs.take()
        try:
            if self.runtime is None:
                self._copy_into(group, slab, non_blocking=False)
                self._apply_patch(group)  # (no streams: it runs after the copy, as everything does)
            elif self.staged(group):
                self._submit_staged_copy(group, slab)
                self._read_ahead(upcoming)
            else:
                with self.runtime.use_stream(self.copy_stream):
                    self._copy_into(group, slab, non_blocking=True)
                    group.ready = self.runtime.new_event()
                    group.ready.record(self.copy_stream)
        except BaseException:
            self._abandon_onload(group, slab)
            raise
        self.ledger.onloads += 1
        if prefetched:
            self.ledger.prefetches += 1
        else:
            self.ledger.sync_onloads += 1

    def slab_free(self, prefetch: int) -> bool:
        """Whether a streamed group may be copied now: a slab is free, or another may be made within what
        ``prefetch`` needs."""
        return self.slabs.can_take(prefetch)

    def record_hook(self, seconds: float, entered: bool) -> None:
        """The hooks' time around one group's run, in the ledger (``TransferLedger.record_hook``)."""
        self.ledger.record_hook(seconds, entered)

    def reset_ledger(self) -> None:
        """Count from zero again (``GroupOffloadHandle.reset_stats``)."""
        self.ledger = TransferLedger()

    def staged(self, group: ModuleGroup) -> bool:
        """Whether ``group`` reaches the device through the staging ring, where there is one: every group but a
        pinned packed one (kept in place, pinning refused, or resident: a resident group is never pinned)."""
        return self.pins.staging is not None and not group.mirror.pinned

    def blocks_the_host(self, group: ModuleGroup) -> bool:
        """Whether copying ``group`` holds the host thread until the copy is done (from pageable memory)."""
        return self.runtime is not None and not group.mirror.pinned and not self.staged(group)

    def _abandon_onload(self, group: ModuleGroup, slab: torch.Tensor, computed: bool = False) -> None:
        """A failed onload (its copy or its patch raised, say): the group computes from its mirror again.
        ``computed``: the compute stream wrote the slab too (a patch that failed part way)."""
        self.finish_copies()  # the slab may be reused or freed only after the copy into it
        group.offload_()
        if group.resident:
            return
        if computed:
            self.slabs.release(slab)  # the next copy into it waits for the patch's kernels
        else:
            self.slabs.put_back(slab)

    @property
    def read_ahead_cap(self) -> int:
        """The most groups the disk reads ahead of the one gathered: the staging ring's slots (0: none is read
        ahead, no group kept in place or no ring)."""
        ring = self.pins.staging
        return ring.slots if self._in_place and ring is not None else 0

    @property
    def read_ahead_groups(self) -> int:
        """The groups the disk reads ahead of the one gathered now (0: none)."""
        return min(self.lookahead, self.read_ahead_cap)

    def _read_ahead(self, upcoming: list[ModuleGroup]) -> None:
        """The disk reads the groups kept in place among the first ``lookahead`` of ``upcoming`` while the
        worker gathers."""
        self._settle_lookahead()
        for group in upcoming[: self.lookahead]:
            if not group.mirror.packed and not group.onloaded:
                group.mirror.read_ahead()

    def _settle_lookahead(self) -> None:
        """The lookahead from the rates measured so far (kept as it was until they are)."""
        measured = self.ledger.lookahead(self.read_ahead_cap)
        if measured is not None:
            self.lookahead = measured
        self.ledger.read_ahead = self.read_ahead_groups

    def run_starts(self, group: ModuleGroup) -> None:
        """``group`` begins to run on the compute stream: a streamed one's run is timed where the disk reads
        ahead (the compute per group of the lookahead)."""
        if self.read_ahead_cap and not group.resident:
            self._runs_timed[group.index] = self._timing_event(self.runtime.current_stream())

    def run_ends(self, group: ModuleGroup) -> None:
        started = self._runs_timed.pop(group.index, None)
        if started is not None:
            self.ledger.record_compute(started, self._timing_event(self.runtime.current_stream()))

    def _timing_event(self, stream: object) -> object:
        event = self.runtime.new_event(enable_timing=True)
        event.record(stream)
        return event

    def _copy_into(self, group: ModuleGroup, slab: torch.Tensor, non_blocking: bool) -> None:
        """Copy the group into ``slab`` and point its modules there: with the device on the host, or from a
        packed mirror (in the copy stream's context on a CUDA device)."""
        with self._inference_mode():
            started = time.perf_counter()
            from_disk = group.fill(slab, non_blocking)
            if not group.mirror.packed:
                self.ledger.record_gather(group.nbytes, from_disk, time.perf_counter() - started)
            group.show(slab)
        self.ledger.record_copy(group.nbytes)

    def _apply_patch(self, group: ModuleGroup) -> None:
        """The onload patch on ``group``'s freshly copied weights, on the current stream (the compute's)."""
        with self._inference_mode():
            self._patch.apply(group)

    def _submit_staged_copy(self, group: ModuleGroup, slab: torch.Tensor) -> None:
        """Hand ``group`` to the gather worker; the modules see the slab now, the compute waits for
        ``ready`` before it runs."""
        group.show(slab)
        ring = self.pins.staging
        job = functools.partial(self._staged_copy, group, slab, ring, ring.claim(), torch.is_inference_mode_enabled())
        group.pending = self.runtime.submit(job)

    def _staged_copy(self, group: ModuleGroup, slab: torch.Tensor, ring: StagingRing, index: int,
                     inference: bool) -> object:
        """The gather worker's job: ``group``'s bytes into ``ring``'s buffer ``index``, then queued to ``slab``
        on the copy stream; returns the event the copy is done at (the patch is the host's, in ``wait_for``).
        It runs in inference mode where the host submitted it so (``inference``), as the views it writes
        may have been made there."""
        _THREAD.job = True
        try:
            with torch.inference_mode(inference or self._inference), self.runtime.use_stream(self.copy_stream):
                staged = ring.free_buffer(index, group.nbytes)  # (waiting for it is no part of the gather)
                started = time.perf_counter()
                from_disk = group.gather_into(staged, self.runtime.host_copy)
                if not group.mirror.packed:
                    self.ledger.record_gather(group.nbytes, from_disk, time.perf_counter() - started)
                copying = self._timing_event(self.copy_stream)
                group.fill(slab, non_blocking=True, source=staged)
                ring.sent(index, self.copy_stream)
                self.ledger.record_copy(group.nbytes, staged=True)
                ready = self._timing_event(self.copy_stream)
                self.ledger.record_copy_time(copying, ready)
            return ready
        finally:
            _THREAD.job = False

    def _inference_mode(self) -> AbstractContextManager:
        """Inference tensors (see ``ModuleGroup``) are written only under inference mode (a thread's own)."""
        return torch.inference_mode() if self._inference and not torch.is_inference_mode_enabled() else nullcontext()

    # --- waits ---------------------------------------------------------------------------------

    def defer_out_of_gather_job(self, work: Callable[[], None]) -> bool:
        """Whether the code runs inside a gather job; then ``work`` is handed to the worker, to run after the
        jobs queued so far. A job's later jobs cannot run until it returns, so nothing in it may wait for
        them: a finalizer that a collection runs there (the nodes remove a handle from one), say."""
        if self.runtime is None or not getattr(_THREAD, "job", False):  # (no worker: nothing to wait for)
            return False
        self.runtime.submit(work)
        return True

    def take_ready(self, group: ModuleGroup, raising: bool = True) -> None:
        """The ready event of ``group``'s staged copy, once the worker has queued it. A failed job (a read
        error in its gather, say) drops the group from the device, as a failed onload does: it computes from its
        mirror until its next onload copies it again."""
        pending, group.pending = group.pending, None
        try:
            group.ready = self.runtime.wait(pending)
        except Exception:
            self._abandon_onload(group, group.slab)
            if raising:
                raise
            log.debug("a staged copy failed; its group is dropped from the device", exc_info=True)

    def wait_for(self, group: ModuleGroup) -> None:
        """The compute stream waits for the copy into ``group``'s slab (its worker job queued already), then
        applies the onload patch there. A patch that fails (out of memory) drops the group from the device,
        as a failed onload does."""
        stream = self.runtime.current_stream()
        start, end = self.runtime.new_event(enable_timing=True), self.runtime.new_event(enable_timing=True)
        start.record(stream)
        stream.wait_event(group.ready)
        end.record(stream)
        self.ledger.record_wait(start, end)
        group.ready = None
        try:
            self._apply_patch(group)
        except BaseException:
            self._abandon_onload(group, group.slab, computed=True)
            raise

    def offload(self, group: ModuleGroup) -> None:
        """Point ``group`` back at its mirror and free its slab once the compute that read it has run."""
        if group.pending is not None:  # a copy into the slab yet to be queued must come before the next one
            self.take_ready(group, raising=False)  # (a failed one has dropped the group already)
        if group.onloaded:
            self.slabs.release(group.offload_())  # its "released" event: recorded on the compute stream

    def finish_copies(self) -> None:
        """Device buffers may be dropped only once the copies into them are done."""
        if self.runtime is not None:
            self.queue_staged_copies()
            self.runtime.current_stream().wait_stream(self.copy_stream)

    def drain_copies(self) -> None:
        """The host waits until every copy queued or to be queued has run (before host memory is unpinned)."""
        self.queue_staged_copies()
        self.copy_stream.synchronize()

    def queue_staged_copies(self) -> None:
        """Wait until the gather worker has queued every staged copy it was given."""
        for group in self._groups:
            if group.pending is not None:
                self.take_ready(group, raising=False)


def _drain_without_holding(transfers: Transfers) -> Callable[[], None]:
    """``transfers``' drain for the pinned buffers' finalizers, which must not keep it (nor, through its
    groups' blocks, the handle) alive: once it is gone, no staged copy is left to queue, and its copy
    stream is all there is to wait for."""
    transfers_ref, copy_stream = weakref.ref(transfers), transfers.copy_stream

    def drain() -> None:
        alive = transfers_ref()
        if alive is None:
            copy_stream.synchronize()
        else:
            alive.drain_copies()

    return drain

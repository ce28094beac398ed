"""Group offloading without copy-back: hooks, the prefetch schedule and the public entry point.

Per group, per forward (each block's ``forward`` is wrapped, or the methods a model calls instead, see
``apply_group_offload``'s ``entry_methods``):

- ``_enter`` (before the group's first block runs): make sure the group is on the device, make the
  compute stream wait for its copy, then start copying the next streamed groups on the side stream;
- ``_leave`` (after its last block ran): point the modules back at the host mirror — no
  device-to-host copy, the host already holds the weights — and hand the slab back.

Both stay out of torch.compile graphs (``torch.compiler.disable``): a compiled model breaks its graph
at them, and each block's forward compiles on its own, once for all blocks of its class, since every
device view keeps its dtype, shape and stride whichever slab it lies in.

Stream choreography on CUDA (the only cross-stream ordering there is; ``tests/stream_checker.py``
proves it on every test run):

- ``group.ready``  recorded on the copy stream after the copy into the slab; the compute stream
  waits on it before the group runs;
- a slab's "released" event  recorded on the compute stream when the group that read the slab has
  run (``SlabPool.release``); the copy stream waits on it before it overwrites the slab (``take``);
- fresh device memory  comes from the compute stream's pool of the caching allocator, where
  queued kernels may still read it: the copy stream waits for the compute stream (``wait_stream``)
  before its first copy into it (``SlabPool.allocate``);
- dropping device memory  the compute stream waits for the copy stream first, so the allocator
  reuses it only after the copies into it; unpinning a mirror waits for the copy stream on the host.
"""
from __future__ import annotations

import functools
import gc
import logging
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from .group import FillFn, ModuleGroup, check_unshared, split_into_groups
from .hostmem import FileMappings, SourceFiles
from .ledger import TransferLedger
from .mirror import CudaHostRegister, Pinner, pack_layout
from .residency import Residency, backed_off_plan, device_footprint, plan_packing, plan_residency, planned_slabs
from .subclass import flatten
from .runtime import CudaRuntime, Runtime
from .slabs import SlabPool
from .pinning import HostPins
from .staging import StagingRing

log = logging.getLogger(__name__)

#: Computes a patched weight on the device from the freshly copied one (e.g. LoRA): (name, weight) -> weight.
PatchFn = Callable[[str, torch.Tensor], torch.Tensor]

# block -> its handle, weak both ways: the wrapped methods are what keep a handle alive, so a handle
# lives exactly as long as its blocks can be reached (or until ``remove()``), and never longer.
_MANAGED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[GroupOffloadHandle]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class OffloadConfig:
    """What the handle is built for; which groups stay resident is not in it (``set_resident_bytes`` re-plans)."""

    onload_device: torch.device
    offload_device: torch.device
    blocks_per_group: int = 1
    prefetch: int = 1
    pin_memory: bool = True
    entry_methods: tuple[str, ...] = ("forward",)

    def validate(self) -> None:
        if not isinstance(self.blocks_per_group, int) or self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be an integer >= 1, got {self.blocks_per_group!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (0 = synchronous onload), got {self.prefetch!r}")
        names = self.entry_methods
        if not names or not all(isinstance(name, str) for name in names) or len(set(names)) < len(names):
            raise ValueError(f"entry_methods must name one or more distinct block methods, got {names!r}")
        if self.offload_device.type != "cpu":
            raise ValueError(f"offload_device must be the CPU (host mirrors live in host memory), got {self.offload_device}")


class GroupOffloadHandle:
    """Owns the groups, hooks, slabs and ledger of one ``apply_group_offload`` call."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], config: OffloadConfig, resident_bytes: int,
                 fill: FillFn | None, pinner: Pinner | None, progress: Callable[[int, int], None] | None,
                 runtime: Runtime | None = None, host_budget: int | None = None) -> None:
        self.config = config
        self.ledger = TransferLedger()
        qualnames = {id(m): (name + "." if name else "") for name, m in model.named_modules(remove_duplicate=False)}
        chunks = split_into_groups(blocks, config.blocks_per_group)
        check_unshared(model, chunks, qualnames)
        if runtime is None and config.onload_device.type == "cuda":
            runtime = CudaRuntime(config.onload_device)
        self._runtime = runtime  # None: the device is the host, copies are synchronous
        self._copy_stream = runtime.new_stream() if runtime is not None else None
        self.groups: list[ModuleGroup] = []
        self._pins = HostPins(self.groups, self._choose_pinner(pinner), runtime,
                              None if runtime is None else _drain_without_holding(self))
        self._sources = SourceFiles()  # the mapped files groups kept in place read from
        packed_chunks = _packed_chunks(chunks, resident_bytes, host_budget)
        in_place = None if all(packed_chunks) else (FileMappings(), self._sources)  # (/proc/self/maps read once)
        for chunk, packed in zip(chunks, packed_chunks):
            group = ModuleGroup(len(self.groups), chunk, qualnames, fill, None if packed else in_place)
            self.groups.append(group)
            if progress is not None:
                progress(len(self.groups), len(chunks))
        self._inference = any(g.inference for g in self.groups)  # the kind of device buffers to make
        self._slabs = SlabPool(config.onload_device, runtime, self._copy_stream, self._inference)
        self._sources.seal()
        self._active: set[int] = set()
        self._trace: list[int] = []
        self._lookahead: dict[int, list[ModuleGroup]] | None = None  # group index -> next streamed groups
        self._patch: PatchFn | None = None
        self._patched: dict[int, list[int]] = {}  # group index -> binding indices the patch applies to
        self._patch_bytes = 0
        self._wrapped = [w for g in self.groups for w in self._wrap_entries(g)]
        for block in blocks:
            _MANAGED[block] = weakref.ref(self)
        self.set_resident_bytes(resident_bytes)

    # --- public -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Transfer ledger and layout (never waits for the GPU)."""
        resident = [g for g in self.groups if g.resident]
        staging = self._pins.staging_bytes
        in_place = [g for g in self.groups if not g.mirror.packed]
        return {
            **self.ledger.as_dict(),
            "prefetch": self.prefetch,
            "groups": len(self.groups),
            "resident_groups": len(resident),
            "resident_bytes": sum(g.nbytes for g in resident),
            "streamed_bytes_per_pass": sum(g.nbytes for g in self.groups if not g.resident),
            "slab_bytes": self._slabs.held_bytes(),
            "host_bytes": sum(g.nbytes for g in self.groups),
            "packed_bytes": sum(g.nbytes for g in self.groups if g.mirror.packed),  # the host copies in anonymous memory
            "in_place_bytes": sum(g.nbytes for g in in_place),  # beyond the host budget: gathered where they lie
            "file_backed_bytes": sum(g.mirror.file_backed_bytes for g in in_place),  # of those, in mapped files
            "pinned_bytes": sum(g.nbytes for g in self.groups if g.mirror.pinned) + staging,  # all it holds page-locked
            "staging_bytes": staging,
            "pin_seconds": self._pins.seconds,
        }

    def reset_stats(self) -> None:
        self.ledger = TransferLedger()

    def check_sources(self) -> None:
        """Before a run: ``SourceChangedError`` if a file that groups kept in place are mapped from shrank or
        changed on disk (reading a page of a shrunk mapping is a SIGBUS, not an error)."""
        self._sources.check()

    def set_resident_bytes(self, resident_bytes: int) -> None:
        """Re-plan which groups stay on the device, with the configured prefetch; takes effect from the
        next forward.

        The streamed groups' mirrors get pinned (as many as the pinner allows: see
        ``stats()["pinned_bytes"]``); a resident group's mirror is read again only after its device
        copy is dropped, so it stays pageable and leaves the pinned memory to the streamed ones.
        """
        _check_resident_bytes(resident_bytes)
        self.release_device_memory()
        self.prefetch = self.config.prefetch  # the depth in effect: ``back_off`` may lower it
        self.backed_off = False
        self._use_plan(plan_residency([g.nbytes for g in self.groups], resident_bytes))

    def back_off(self) -> bool:
        """After a call ran out of device memory: fall back to the next plan that holds less
        (``residency.backed_off_plan``); it holds until the next ``set_resident_bytes``.

        Once the copies in flight are done, the streaming buffers and the groups that no longer stay
        resident leave the device; the groups that stay keep their device copy. An order learnt from
        a first forward that failed part-way is forgotten. Returns False when no plan holds less
        (every group streams with prefetch 1 or 0): nothing changes then.
        """
        fallback = backed_off_plan([g.nbytes for g in self.groups], [g.resident for g in self.groups], self.prefetch)
        if fallback is None:
            return False
        resident, self.prefetch = fallback
        self._finish_copies()
        for group, stays in zip(self.groups, resident):
            if group.resident and stays:
                continue
            if group.onloaded:
                group.offload_()
            group.drop_device_views()  # the views of slabs it ran from keep those alive
        self._forget_slabs()
        if self._lookahead is None:
            self._trace.clear()
        self._use_plan(resident)
        self.backed_off = True
        self.ledger.back_offs += 1
        return True

    def empty_device_cache(self) -> None:
        """Give the device memory that nothing holds any longer back to the driver: after a call
        that ran out of it, once its tensors are gone (a collection frees those that only reference
        cycles of its traceback's frames still hold)."""
        if self._runtime is not None:
            gc.collect()
            self._runtime.empty_cache()

    def residency(self) -> Residency:
        """The plan in effect."""
        resident = [g for g in self.groups if g.resident]
        footprint = device_footprint([g.nbytes for g in self.groups], [g.resident for g in self.groups], self.prefetch)
        return Residency(len(resident), len(self.groups), sum(g.nbytes for g in resident), self.prefetch, footprint)

    def _use_plan(self, resident: list[bool]) -> None:
        for group, stays in zip(self.groups, resident):
            group.resident = stays
        self._slabs.slab_bytes = max((g.nbytes for g in self.groups if not g.resident), default=0)
        self._lookahead = None if self._lookahead is None else self._plan_lookahead()
        self.pin_streamed()

    def pin_streamed(self) -> int:
        """Pin every streamed group the pinner accepts (``HostPins.pin_streamed``); the streamed packed bytes
        left in pageable memory."""
        return self._pins.pin_streamed()

    def unpin(self, at_least: int | None = None) -> int:
        """Return the mirrors' page-locked memory, all of it or, last groups first, at least ``at_least``
        bytes of it (``HostPins.unpin``); returns the bytes unpinned."""
        return self._pins.unpin(at_least)

    def device_bytes_needed(self) -> int:
        """Device memory the offloaded blocks hold while sampling: resident groups plus slabs
        (including slabs made beyond the plan while more groups ran at once than it has slabs for),
        and what the onload patch holds."""
        resident = [g.resident for g in self.groups]
        planned = device_footprint([g.nbytes for g in self.groups], resident, self.prefetch)
        extra_slabs = self._slabs.made - planned_slabs(resident.count(False), self.prefetch)
        return planned + max(0, extra_slabs) * self._slabs.slab_bytes + self._patch_bytes

    def set_onload_patch(self, patch: PatchFn | None, names: Iterable[str] = (), device_bytes: int = 0) -> None:
        """Apply ``patch`` to the named tensors on the device after every onload (mirrors stay pristine).

        ``device_bytes``: device memory the patch holds or needs besides the groups (its own tensors,
        its temporaries); ``device_bytes_needed`` counts it.
        """
        wanted = set(names)
        self.release_device_memory()
        self._patch = patch if wanted else None
        self._patch_bytes = device_bytes if wanted else 0
        self._patched = {g.index: [i for i, n in enumerate(g.qualnames()) if n in wanted] for g in self.groups}

    def onload_resident(self) -> None:
        """Copy the resident groups onto the device now instead of at their first use."""
        for group in self.groups:
            if group.resident and not group.onloaded:
                self._onload(group, prefetched=False)

    def park(self) -> None:
        """Point every module at its host mirror without giving up the device copies.

        Whoever drives the model next sees pristine host weights; if that is this handle again, each
        group takes its device copy up again at its next use, without a copy.
        """
        for group in self.groups:
            if group.onloaded:
                group.park()
        self._active.clear()

    def holds_device_memory(self) -> bool:
        """Whether a group or a streaming buffer is on the device (with prefetch 0 a free buffer stays between runs)."""
        return self._slabs.made > 0 or any(g.onloaded for g in self.groups)

    def release_device_memory(self) -> None:
        """Offload every group, resident ones too, and free the slabs; mirrors stay as they are."""
        self._finish_copies()
        for group in self.groups:
            if group.onloaded:
                group.offload_()
            group.drop_device_views()
        self._forget_slabs()

    def remove(self) -> None:
        """Hooks gone, no pinned memory held; the model computes exactly as before, from host memory."""
        self._finish_copies()
        for group in self.groups:
            group.release()
            for block in group.blocks:
                _MANAGED.pop(block, None)
        self._queue_staged_copies()
        self._pins.drop_staging()
        self._forget_slabs()
        for block, name, wrapper in self._wrapped:
            if block.__dict__.get(name) is wrapper:
                delattr(block, name)  # back to the class's method
            # else someone wrapped it after us: ours stays in their chain, as a plain pass-through
        self._wrapped.clear()

    def _finish_copies(self) -> None:
        """Device buffers may be dropped only once the copies into them are done."""
        if self._runtime is not None:
            self._queue_staged_copies()
            self._runtime.current_stream().wait_stream(self._copy_stream)

    def _drain_copies(self) -> None:
        """The host waits until every copy queued or to be queued has run (before host memory is unpinned)."""
        self._queue_staged_copies()
        self._copy_stream.synchronize()

    def _queue_staged_copies(self) -> None:
        """Wait until the gather worker has queued every staged copy it was given."""
        for group in self.groups:
            if group.pending is not None:
                self._take_ready(group, raising=False)

    def _take_ready(self, group: ModuleGroup, raising: bool = True) -> None:
        """The ready event of ``group``'s staged copy, once the worker has queued it."""
        pending, group.pending = group.pending, None
        try:
            group.ready = self._runtime.wait(pending)
        except Exception:
            if raising:
                raise
            log.debug("a staged copy failed; its group is dropped from the device", exc_info=True)

    def _forget_slabs(self) -> None:
        self._active.clear()
        self._slabs.forget()

    # --- hooks ------------------------------------------------------------------------------

    def _wrap_entries(self, group: ModuleGroup) -> list[tuple[nn.Module, str, Callable]]:
        """Wrap each block's entry methods (as diffusers' hook registry wraps ``forward``) rather than
        register PyTorch module hooks: their dispatch costs more per call than re-pointing a whole
        group, a wrapper can put the group back when a forward raises, and it works for methods other
        than ``forward``. Of several entry methods, all but the last one open a visit of a block (in
        the group's first block: a run of the group) and the last one ends it (in its last block)."""
        wrapped = []
        names = self.config.entry_methods
        opening = names[:-1] or names
        for block in group.blocks:
            for name in names:
                first = block is group.blocks[0] and name in opening
                last = block is group.blocks[-1] and name == names[-1]
                wrapper = self._offloaded_call(group, getattr(block, name), first, last)
                setattr(block, name, wrapper)
                wrapped.append((block, name, wrapper))
        return wrapped

    def _offloaded_call(self, group: ModuleGroup, method: Callable, first: bool, last: bool) -> Callable:
        def offloaded_call(*args, **kwargs):
            if not self._wrapped:  # removed while someone else's wrapper still calls this one
                return method(*args, **kwargs)
            try:
                self._enter(group, first)
                output = method(*args, **kwargs)
            except BaseException:
                self._leave(group, close=True, failed=True)  # the group computes from its mirror again
                raise
            self._leave(group, close=last)
            return output

        return offloaded_call

    @torch.compiler.disable
    def _enter(self, group: ModuleGroup, first: bool) -> None:
        group.running += 1
        if group.index in self._active and (group.running > 1 or not first):
            return  # a later block of a group that is already running (its first block again: a new run)
        started = time.perf_counter()
        if self._active:
            self._close_unfinished()
        if self._lookahead is None:
            self._learn_order(group)
        if not group.onloaded:
            self._onload(group, prefetched=False)
        elif group.parked:
            group.unpark()
        if group.ready is not None or group.pending is not None:
            self._wait_for(group)
        self._active.add(group.index)
        self._prefetch_after(group, pageable=False)
        self.ledger.record_hook(time.perf_counter() - started, entered=True)

    @torch.compiler.disable
    def _leave(self, group: ModuleGroup, close: bool, failed: bool = False) -> None:
        group.running -= 1
        if not failed:
            self._prefetch_after(group, pageable=True)
        if close:
            started = time.perf_counter()
            self._close(group)
            self.ledger.record_hook(time.perf_counter() - started, entered=False)

    def _close(self, group: ModuleGroup) -> None:
        self._active.discard(group.index)
        if not group.resident and group.onloaded:
            self._offload(group)

    def _close_unfinished(self) -> None:
        """Close the groups whose last block was skipped (skip-layer guidance, a replaced block):
        open, but none of their blocks running. Blocks that call other blocks keep theirs open."""
        for index in [i for i in self._active if not self.groups[i].running]:
            self._close(self.groups[index])

    # --- schedule ---------------------------------------------------------------------------

    def _learn_order(self, group: ModuleGroup) -> None:
        """Record the first forward's group order; it is complete once every group ran or one repeats."""
        if group.index not in self._trace:
            self._trace.append(group.index)
        if group.index == self._trace[0] and len(self._trace) > 1 or len(self._trace) == len(self.groups):
            missing = len(self.groups) - len(self._trace)
            if missing:
                log.warning("%d offloaded group(s) did not run in the first forward; they will load on demand", missing)
            self._lookahead = self._plan_lookahead()

    def _plan_lookahead(self) -> dict[int, list[ModuleGroup]]:
        """For each group in the learnt order, the next ``prefetch`` streamed groups after it (cyclic)."""
        order = [self.groups[i] for i in self._trace]
        streamed_positions = [p for p, g in enumerate(order) if not g.resident]
        plan = {}
        for p, group in enumerate(order):
            after = [q for q in streamed_positions if q > p] + [q for q in streamed_positions if q <= p]
            plan[group.index] = [order[q] for q in after if order[q] is not group][: self.prefetch]
        return plan

    def _prefetch_after(self, group: ModuleGroup, pageable: bool) -> None:
        """Start copying the streamed groups that follow ``group``, in order, while slabs are free.

        From its enter (``pageable`` False) only up to the first group whose mirror is not pinned: a
        copy from pageable memory blocks the host until it is done, and there it would hold back the
        launch of this group's kernels, leaving the GPU idle through the copy. Its leave (``pageable``
        True), with this group's kernels queued, copies the rest; the copy then overlaps them.
        """
        if self._lookahead is None:
            return
        for upcoming in self._lookahead.get(group.index, ()):
            if upcoming.onloaded:
                continue
            if not pageable and self._runtime is not None and not upcoming.mirror.pinned and not self._staged(upcoming):
                return
            if not self._prefetch(upcoming):
                return

    def _prefetch(self, group: ModuleGroup) -> bool:
        """Start copying ``group`` ahead of its use, if a slab is free; never evicts."""
        if not self._slabs.can_take(self.prefetch):
            return False
        self._onload(group, prefetched=True)
        return True

    def _onload(self, group: ModuleGroup, prefetched: bool) -> None:
        slab = self._slabs.allocate(group.nbytes) if group.resident else self._take_slab()
        try:
            if self._runtime is None:
                self._copy_into(group, slab, non_blocking=False)
            elif self._staged(group):
                group.show(slab)  # the modules see the slab now; the compute waits for ``ready`` before it runs
                ring = self._pins.staging
                job = functools.partial(self._staged_copy, group, slab, ring, ring.claim(), self._patch_targets(group))
                group.pending = self._runtime.submit(job)
                self._read_ahead_after(group)
                self.ledger.staged_copies += 1
                self.ledger.record_copy(group.nbytes)
            else:
                with self._runtime.use_stream(self._copy_stream):
                    self._copy_into(group, slab, non_blocking=True)
                    group.ready = self._runtime.new_event()
                    group.ready.record(self._copy_stream)
        except BaseException:
            self._abandon_onload(group, slab)
            raise
        self.ledger.onloads += 1
        if prefetched:
            self.ledger.prefetches += 1
        else:
            self.ledger.sync_onloads += 1

    def _abandon_onload(self, group: ModuleGroup, slab: torch.Tensor) -> None:
        """A failed onload (its patch raised, say): the group computes from its mirror again."""
        self._finish_copies()  # the slab may be reused or freed only after the copy into it
        group.offload_()
        if not group.resident:
            self._slabs.put_back(slab)

    def _read_ahead_after(self, group: ModuleGroup) -> None:
        """While ``group`` is gathered, the disk reads the groups kept in place that stream after it."""
        for upcoming in (self._lookahead or {}).get(group.index, ()):
            if not upcoming.mirror.packed and not upcoming.onloaded:
                upcoming.mirror.read_ahead()

    def _staged(self, group: ModuleGroup) -> bool:
        """Whether ``group`` reaches the device through the staging ring: kept in place, or streamed from a
        packed mirror pinning refused."""
        return self._pins.staging is not None and (not group.mirror.packed or not group.resident and not group.mirror.pinned)

    def _copy_into(self, group: ModuleGroup, slab: torch.Tensor, non_blocking: bool) -> None:
        """Copy the group into ``slab`` and point its modules there: with the device on the host, or from a
        packed mirror (in the copy stream's context on a CUDA device)."""
        with self._inference_mode():
            started = time.perf_counter()
            from_disk = group.fill(slab, non_blocking)
            if not group.mirror.packed:
                self.ledger.record_gather(group.nbytes, from_disk, time.perf_counter() - started)
            group.show(slab)
            self._apply_patch(self._patch_targets(group))
        self.ledger.record_copy(group.nbytes)

    def _staged_copy(self, group: ModuleGroup, slab: torch.Tensor, ring: StagingRing, index: int,
                     patch_targets: list[tuple[str, torch.Tensor]]) -> object:
        """The gather worker's job: ``group``'s bytes into ``ring``'s buffer ``index``, then queued to ``slab``
        on the copy stream with the patch after them; returns the event the copies are done at."""
        with self._inference_mode(), self._runtime.use_stream(self._copy_stream):
            started = time.perf_counter()
            staged, from_disk = ring.stage(index, group)
            if not group.mirror.packed:
                self.ledger.record_gather(group.nbytes, from_disk, time.perf_counter() - started)
            group.fill(slab, non_blocking=True, source=staged)
            ring.sent(index, self._copy_stream)
            self._apply_patch(patch_targets)
            ready = self._runtime.new_event()
            ready.record(self._copy_stream)
        return ready

    def _inference_mode(self) -> AbstractContextManager:
        """Inference tensors (see ``ModuleGroup``) are written only under inference mode (a thread's own)."""
        return torch.inference_mode() if self._inference and not torch.is_inference_mode_enabled() else nullcontext()

    def _patch_targets(self, group: ModuleGroup) -> list[tuple[str, torch.Tensor]]:
        """The device tensors of ``group`` the onload patch rewrites (the group shows its slab), by name."""
        if self._patch is None:
            return []
        return [(group.bindings[i].qualname, group.device_tensor(i)) for i in self._patched[group.index]]

    def _apply_patch(self, targets: list[tuple[str, torch.Tensor]]) -> None:
        for qualname, tensor in targets:
            tensor.copy_(self._patch(qualname, tensor))

    def _wait_for(self, group: ModuleGroup) -> None:
        if group.pending is not None:
            self._take_ready(group)
        stream = self._runtime.current_stream()
        start, end = self._runtime.new_event(enable_timing=True), self._runtime.new_event(enable_timing=True)
        start.record(stream)
        stream.wait_event(group.ready)
        end.record(stream)
        self.ledger.record_wait(start, end)
        group.ready = None

    def _offload(self, group: ModuleGroup) -> None:
        if group.pending is not None:  # a copy into the slab yet to be queued must come before the next one
            self._take_ready(group, raising=False)
        self._slabs.release(group.offload_())  # its "released" event: recorded on the compute stream

    def _take_slab(self) -> torch.Tensor:
        if not self._slabs.can_take(self.prefetch):
            # Out of order: a prefetched group that has not run yet gives its slab up.
            waiting = [g for g in self.groups if g.onloaded and not g.resident and g.index not in self._active]
            if waiting:
                self._offload(waiting[0])
        return self._slabs.take()  # the copy stream waits for the slab's release, or for fresh memory

    def _choose_pinner(self, pinner: Pinner | None) -> Pinner | None:
        """A given pinner decides for itself (it may know a host whose onload device is not CUDA);
        the default one pins only for a CUDA onload device."""
        if not self.config.pin_memory:
            return None
        if pinner is not None:
            return pinner
        if self._runtime is None:
            log.info("pin_memory ignored: the onload device %s is not a CUDA device", self.config.onload_device)
            return None
        return CudaHostRegister(self.config.onload_device)


def apply_group_offload(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    onload_device: torch.device | str,
    offload_device: torch.device | str = "cpu",
    blocks_per_group: int = 1,
    prefetch: int = 1,
    resident_bytes: int = 0,
    pin_memory: bool = True,
    *,
    entry_methods: Sequence[str] = ("forward",),
    fill: FillFn | None = None,
    pinner: Pinner | None = None,
    progress: Callable[[int, int], None] | None = None,
    runtime: Runtime | None = None,
    host_budget: int | None = None,
) -> GroupOffloadHandle:
    """Keep ``blocks`` in packed host mirrors and stream them to ``onload_device`` group by group.

    Only the given blocks are managed; everything else in ``model`` is the caller's to place.
    ``entry_methods`` are the block methods the model runs a block through, in the order one visit
    of a block calls them (a model may skip the first ones): the group is loaded when one is called
    and released after the last one of its last block.
    ``fill(name, host_view)`` writes each tensor's weights into its mirror instead of copying the
    module's current tensor (a loader reads a file straight in); ``pinner`` replaces the default
    ``cudaHostRegister`` pinning; ``progress(done, total)`` is called as the groups are built;
    ``runtime`` replaces ``torch.cuda``'s streams, events and allocations (a test's checker).
    ``host_budget``: the bytes of packed host mirrors the groups may have (None: every group has one);
    the groups beyond it keep their tensors where they are (views of a mapped file cost no anonymous
    memory) and are gathered at each onload, through a staging ring on a CUDA device. It cannot go
    with ``fill``, which writes every tensor into a packed mirror.
    """
    config = OffloadConfig(torch.device(onload_device), torch.device(offload_device),
                           blocks_per_group, prefetch, pin_memory, tuple(entry_methods))
    config.validate()
    _check_resident_bytes(resident_bytes)
    if host_budget is not None and (not isinstance(host_budget, int) or host_budget < 0):
        raise ValueError(f"host_budget must be None (pack every group) or an integer >= 0, got {host_budget!r}")
    if host_budget is not None and fill is not None:
        raise ValueError("fill writes every tensor into a packed host mirror: it cannot go with a host_budget, "
                         "beyond which the tensors stay where they are (make them views of the file instead)")
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty: pass the model's block modules, e.g. model.transformer_blocks")
    inside = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if id(block) not in inside:
            raise ValueError(f"blocks[{i}] ({type(block).__name__}) is not a submodule of the given model")
        if missing := [name for name in config.entry_methods if not callable(getattr(block, name, None))]:
            raise ValueError(f"blocks[{i}] ({type(block).__name__}) has no method {missing[0]!r} of entry_methods")
        if handle_of(block) is not None:
            raise ValueError(f"blocks[{i}] is already group-offloaded; call remove() on its handle before applying again")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("blocks lists the same module more than once")
    return GroupOffloadHandle(model, blocks, config, resident_bytes, fill, pinner, progress, runtime, host_budget)


def _drain_without_holding(handle: GroupOffloadHandle) -> Callable[[], None]:
    """``handle``'s drain for the pinned buffers' finalizers, which must not keep it alive: once it is gone,
    no staged copy is left to queue, and its copy stream is all there is to wait for."""
    handle_ref, copy_stream = weakref.ref(handle), handle._copy_stream

    def drain() -> None:
        alive = handle_ref()
        if alive is None:
            copy_stream.synchronize()
        else:
            alive._drain_copies()

    return drain


def _packed_chunks(chunks: list[list[nn.Module]], resident_bytes: int, host_budget: int | None) -> list[bool]:
    """Which chunks of blocks get a packed host mirror within ``host_budget`` (``plan_packing``, on the
    residency planned for ``resident_bytes``); a chunk with a tensor off the host is packed regardless."""
    if host_budget is None:
        return [True] * len(chunks)
    tensors = [_chunk_tensors(chunk) for chunk in chunks]
    sizes = [pack_layout([inner for t in chunk for inner in flatten(t)[1]])[1] for chunk in tensors]  # as packed
    packed = plan_packing(sizes, plan_residency(sizes, resident_bytes), host_budget)
    return [p or not all(_on_the_host(t) for t in chunk) for p, chunk in zip(packed, tensors)]


def _chunk_tensors(chunk: list[nn.Module]) -> list[torch.Tensor]:
    unique = {id(t): t for block in chunk for t in (*block.parameters(), *block.buffers())}
    return list(unique.values())


def _on_the_host(tensor: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in flatten(tensor)[1])


def _check_resident_bytes(resident_bytes: int) -> None:
    if resident_bytes < 0:
        raise ValueError(f"resident_bytes must be >= 0 (0 = stream every group), got {resident_bytes!r}")


def handle_of(block: nn.Module) -> GroupOffloadHandle | None:
    """The handle that manages ``block``, if any."""
    ref = _MANAGED.get(block)
    return None if ref is None else ref()

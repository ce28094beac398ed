"""Group offloading without copy-back: the public entry point, ``apply_group_offload``, and the face of the
handle it returns (stats, the residency plan, back-off, parking, pins, removal).

The rooms behind the face, each importing only those below it:

- ``hooks.py``: what entering and leaving a group does, and the wrappers on the blocks' methods (the handle
  holds its ``GroupHooks`` and asks them through their public methods);
- ``schedule.py``: which streamed groups to copy ahead of which (group indices, no tensors, no streams);
- ``transfers.py``: the copies into device buffers, the gather worker, the waits and the stream rules;
- ``onload_patch.py``: the device-side patch (a LoRA) applied after each copy;
- ``pinning.py``, ``staging.py``, ``slabs.py``: the page-locked host memory, the staging ring, the device buffers;
- ``grouping.py``, ``group.py``, ``mirror.py``: how blocks become groups, a group, its host copy; ``residency.py``: the plans.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Iterator, Sequence

import torch
from torch import nn

from .grouping import OffloadConfig, build_groups, check_host_budget, check_resident_bytes
from .group import FillFn, ModuleGroup
from .hooks import GroupHooks
from .hostmem import FileMappings, SourceChangedError, bytes_kept_cached
from .ledger import TransferLedger
from .mirror import Pinner
from .onload_patch import OnloadPatch, PatchFn
from .pinning import choose_pinner
from .residency import Residency, backed_off_plan, device_footprint, plan_residency, planned_slabs
from .runtime import CudaRuntime, Runtime
from .schedule import Schedule
from .transfers import Transfers


# block -> its handle, weak both ways: the wrapped methods are what keep a handle alive, so a handle
# lives exactly as long as its blocks can be reached (or until ``remove()``), and never longer.
_MANAGED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[GroupOffloadHandle]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class GroupSnapshot:
    """One group as its handle's callers see it, read at one moment (``GroupOffloadHandle.snapshot``)."""

    index: int
    nbytes: int
    resident: bool  # kept on the device by the plan in effect
    packed: bool  # its host copy is a packed mirror; False: its tensors stay in place (beyond the host budget)
    pinned: bool  # that host copy is page-locked


class GroupOffloadHandle:
    """Owns the groups, hooks, schedule and transfers of one ``apply_group_offload`` call."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], config: OffloadConfig, resident_bytes: int,
                 fill: FillFn | None, pinner: Pinner | None, progress: Callable[[int, int], None] | None,
                 runtime: Runtime | None = None, host_budget: int | None = None, learn_entries: bool = False,
                 returnable: bool = False) -> None:
        self.config = config
        if runtime is None and config.onload_device.type == "cuda":
            runtime = CudaRuntime(config.onload_device)
        self._runtime = runtime  # None: the device is the host
        pinner = choose_pinner(config.pin_memory, pinner, config.onload_device, runtime)
        groups, self._sources, self._returnable = build_groups(model, blocks, config.blocks_per_group, resident_bytes,
                                                               host_budget, fill, progress, returnable)
        self.groups = groups
        self._patch = OnloadPatch()
        self._transfers = Transfers(groups, config.onload_device, runtime, pinner, self._patch)
        self._pins, self._slabs = self._transfers.pins, self._transfers.slabs
        self._schedule = Schedule(len(groups), config.prefetch)
        self._hooks = GroupHooks(groups, self._schedule, self._transfers, config.entry_methods, learn_entries,
                                 owner=self)
        for block in blocks:
            _MANAGED[block] = weakref.ref(self)
        self.set_resident_bytes(resident_bytes)

    @property
    def ledger(self) -> TransferLedger:
        return self._transfers.ledger

    @property
    def busy(self) -> bool:
        """Whether the hooks are entering or leaving a group now (their own uses of its tensors: ``watch.py``)."""
        return self._hooks.busy

    def is_open(self, group: ModuleGroup) -> bool:
        """Whether ``group``'s tensors may be used now: one of its entries runs, or its run is open."""
        return self._hooks.is_open(group)

    def close_open_groups(self) -> None:
        """At the end of a model call: close the runs no call of a block ends (``GroupHooks.close_open_groups``)."""
        self._hooks.close_open_groups()

    def settle_entries(self) -> list[str]:
        """After a model call that ran blocks: keep only the part entries that opened a use of their group
        (``GroupHooks.settle_entries``); the names of those kept."""
        return self._hooks.settle_entries()

    @property
    def prefetch(self) -> int:
        """The prefetch depth in effect: ``back_off`` may lower the configured one."""
        return self._schedule.prefetch

    def ledger_figures(self) -> dict[str, float | int]:
        """What crossed the bus since the last ``reset_stats``, how often, and what it cost (``TransferLedger``'s
        counters, the GPU's wait as far as it has got, the hooks' time per group); never waits for the GPU."""
        return self.ledger.as_dict()

    def stats(self) -> dict[str, float | int]:
        """The ledger's figures and the layout (never waits for the GPU)."""
        resident = [g for g in self.groups if g.resident]
        staging = self._pins.staging_bytes
        in_place = [g for g in self.groups if not g.mirror.packed]
        return {
            **self.ledger_figures(),
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
            # of those, the bytes whose pages stay in the page cache between their gathers (``keep_cached``)
            "kept_cached_bytes": sum(g.mirror.cached_bytes for g in in_place),
            "pinned_bytes": sum(g.nbytes for g in self.groups if g.mirror.pinned) + staging,  # all it holds page-locked
            "staging_bytes": staging,
            "pin_seconds": self._pins.seconds,
        }

    def snapshot(self) -> list[GroupSnapshot]:
        """The groups as they are now, in order: their size, residency and host copy."""
        return [GroupSnapshot(g.index, g.nbytes, g.resident, g.mirror.packed, g.mirror.pinned) for g in self.groups]

    def block_tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer of the offloaded blocks as the modules see it now, each once (a tied
        one too): a quantized weight as its subclass, with the attributes that say its format."""
        return [binding.current() for group in self.groups for binding in group.bindings]

    def reset_stats(self) -> None:
        self._transfers.reset_ledger()

    def check_sources(self) -> None:
        """Before a run, each model call and any read of the host weights: ``SourceChangedError`` if a file that
        groups kept in place are mapped from shrank or changed on disk, or a writer opened it (reading a page of
        a shrunk mapping is a SIGBUS, not an error). A writer a lease held is let go once the copies in flight
        are done: nothing reads the mappings after the error."""
        try:
            self._sources.check()
        except Exception:
            self._finish_copies()
            self._sources.let_writers_go()
            raise

    @contextlib.contextmanager
    def reading_sources(self) -> Iterator[None]:
        """While the groups kept in place may be read (a sampling run): a writer a lease holds waits until the
        next ``check_sources`` fails, or this ends (with the copies in flight done)."""
        with self._sources.reading():
            try:
                yield
            finally:
                self._finish_copies()
        self._sources.let_writers_go()

    def host_tensors(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """The named tensors (qualified names in the model) as their host copies hold them, after
        ``check_sources``: pristine (patches go to device copies), and those of groups kept in place copied
        into memory of their own, so that no later change of their file reaches them."""
        self.check_sources()
        wanted = set(names)
        with self._sources.reading():
            return {name: tensor for group in self.groups for name, tensor in group.host_tensors(wanted).items()}

    def keep_cached(self, room: int | None) -> int:
        """Give the groups kept in place ``room`` bytes of page cache (None: as much as they need); returns the
        bytes of them kept cached.

        A step gathers the streamed ones in a cycle: where they need more page cache than ``room``, the
        kernel's LRU drops each page shortly before it is read again, and every step reads all of them from
        the disk. Instead, their first bytes that fit (``hostmem.bytes_kept_cached``: the first groups whole,
        then the leading part of the next) stay cached and the pages past them are read around the page cache
        where their file reads so (``InPlaceMirror.gather_into``), else released after each gather, so that a
        step reads only those again. Where pages pass through the cache, room is left for the groups in flight:
        the one being gathered and, where the disk reads the next ones ahead (a CUDA device), those (the
        lookahead in effect). A resident group is gathered once per load: its pages are released then too.
        """
        in_place = [g for g in self.groups if not g.mirror.packed]
        sizes = [g.nbytes for g in in_place if not g.resident]
        if room is None or sum(sizes) <= max(0, room):
            kept = [g.nbytes for g in in_place]
        else:
            through_cache = [g.nbytes for g in in_place if not g.resident and not g.mirror.reads_around_cache]
            in_flight = (1 + self._transfers.read_ahead_groups) * max(through_cache, default=0)
            cached = iter(bytes_kept_cached(sizes, room - in_flight))
            kept = [0 if g.resident else next(cached) for g in in_place]
        for group, cached_bytes in zip(in_place, kept):
            group.mirror.cached_bytes = cached_bytes
        return sum(kept)

    def returnable_bytes(self) -> int:
        """The packed host bytes ``give_up_packing`` could free (built ``returnable``): the packed groups' tensors
        that were views of read-only file mappings when the handle was built; 0 once one of those files changed."""
        try:
            self._returnable.check()
        except SourceChangedError:
            return 0
        return sum(g.returnable_bytes for g in self.groups)

    def give_up_packing(self, at_least: int) -> int:
        """Free at least ``at_least`` bytes of packed host memory, where the groups can give it up
        (``returnable_bytes``): their tensors become the file views they were built from, kept in place and
        gathered from the files at each onload from then on, as if the host budget had never packed them. The
        resident groups go first (their host copy is read once per load), then the streamed ones, last first.
        Every group leaves the device first. Nothing is given up where a file changed on disk since the build
        (its views no longer hold what was packed). Returns the bytes freed."""
        if at_least <= 0 or not self.returnable_bytes():
            return 0
        returnable = sorted((g for g in self.groups if g.returnable_bytes), key=lambda g: (not g.resident, -g.index))
        self.release_device_memory()
        mappings, freed = FileMappings(), 0
        for group in returnable:
            if freed >= at_least:
                break
            freed += group.return_to_files(mappings, self._sources)
        self._sources.seal()
        self._transfers.groups_changed()
        self.pin_streamed()
        return freed

    def set_resident_bytes(self, resident_bytes: int) -> None:
        """Re-plan which groups stay on the device, with the configured prefetch; takes effect from the
        next forward.

        The streamed groups' mirrors get pinned (as many as the pinner allows: see
        ``stats()["pinned_bytes"]``); a resident group's mirror is read again only after its device
        copy is dropped, so it stays pageable and leaves the pinned memory to the streamed ones.
        """
        check_resident_bytes(resident_bytes)
        self.release_device_memory()
        self.backed_off = False
        self._use_plan(plan_residency([g.nbytes for g in self.groups], resident_bytes), self.config.prefetch)
        self.pin_streamed()

    def back_off(self) -> bool:
        """After a call ran out of device memory: fall back to the next plan that holds less
        (``residency.backed_off_plan``); it holds until the next ``set_resident_bytes``.

        Once the copies in flight are done, the streaming buffers and the groups that no longer stay
        resident leave the device; the groups that stay keep their device copy; those that stream now are
        not pinned in the middle of the recovery (``HostPins.stage_unpinned``). An order learnt from
        a first forward that failed part-way is forgotten. Returns False when no plan holds less
        (every group streams with prefetch 1 or 0): nothing changes then.
        """
        fallback = backed_off_plan([g.nbytes for g in self.groups], [g.resident for g in self.groups], self.prefetch)
        if fallback is None:
            return False
        resident, prefetch = fallback
        self._finish_copies()
        for group, stays in zip(self.groups, resident):
            if group.resident and stays:
                continue
            if group.onloaded:
                group.offload_()
            group.drop_device_views()  # the views of slabs it ran from keep those alive
        self._forget_slabs()
        self._schedule.forget_unfinished()
        self._use_plan(resident, prefetch)
        self._pins.stage_unpinned()  # the groups that stream now: not pinned in the middle of a recovery
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

    def _use_plan(self, resident: list[bool], prefetch: int) -> None:
        for group, stays in zip(self.groups, resident):
            group.resident = stays
        self._slabs.slab_bytes = max((g.nbytes for g in self.groups if not g.resident), default=0)
        self._schedule.use_plan([not stays for stays in resident], prefetch)

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
        return planned + max(0, extra_slabs) * self._slabs.slab_bytes + self._patch.device_bytes

    def set_onload_patch(self, patch: PatchFn | None, names: Iterable[str] = (), device_bytes: int = 0) -> None:
        """Apply ``patch`` to the named tensors on the device after every onload (mirrors stay pristine).

        ``device_bytes``: device memory the patch holds or needs besides the groups (its own tensors,
        its temporaries); ``device_bytes_needed`` counts it.
        """
        self.release_device_memory()
        self._patch.set(patch, names, device_bytes, self.groups)

    def onload_resident(self) -> None:
        """Copy the resident groups onto the device now instead of at their first use."""
        for group in self.groups:
            if group.resident and not group.onloaded:
                self._hooks.onload(group)

    def park(self) -> None:
        """Point every module at its host mirror without giving up the device copies.

        Whoever drives the model next sees pristine host weights; if that is this handle again, each
        group takes its device copy up again at its next use, without a copy.
        """
        for group in self.groups:
            if group.onloaded:
                group.park()
        self._hooks.forget_open_runs()

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
        """Hooks gone, no pinned memory held; the model computes exactly as before, from host memory.
        Called inside a gather job (a finalizer run there), the worker does it once that job has run."""
        if self._transfers.defer_out_of_gather_job(self.remove):
            return
        self._finish_copies()
        for group in self.groups:
            group.release()
            for block in group.blocks:
                _MANAGED.pop(block, None)
        self._transfers.queue_staged_copies()
        self._pins.drop_staging()
        self._forget_slabs()
        self._hooks.remove()

    def _finish_copies(self) -> None:
        self._transfers.finish_copies()

    def _forget_slabs(self) -> None:
        self._hooks.forget_open_runs()
        self._slabs.forget()


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
    learn_entries: bool = False,
    returnable: bool = False,
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
    ``learn_entries``: also stream a block wherever the model uses it from, its other public methods or
    the modules inside it called directly (``hooks.PartWrappers``); call ``close_open_groups`` at the end
    of each model call, and ``settle_entries`` after the first one that ran blocks.
    ``returnable``: the packed groups keep aliases of their tensors that are views of read-only file mappings
    (the mappings stay, their pages the page cache's), so that ``give_up_packing`` can turn them back into
    groups kept in place.
    """
    config = OffloadConfig(torch.device(onload_device), torch.device(offload_device),
                           blocks_per_group, prefetch, pin_memory, tuple(entry_methods))
    config.validate()
    check_resident_bytes(resident_bytes)
    check_host_budget(host_budget, fill)
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
    return GroupOffloadHandle(model, blocks, config, resident_bytes, fill, pinner, progress, runtime, host_budget,
                              learn_entries, returnable)


def handle_of(block: nn.Module) -> GroupOffloadHandle | None:
    """The handle that manages ``block``, if any."""
    ref = _MANAGED.get(block)
    return None if ref is None else ref()

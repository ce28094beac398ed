"""The hooks: what happens when a group is entered and left, and the wrappers that call them.

Per group, per forward (each block's ``forward`` is wrapped, or the methods a model calls instead, see
``apply_group_offload``'s ``entry_methods``; with ``learn_entries``, also every other place a model may
use a block from, see ``PartWrappers``):

- ``_enter`` (before the group's first block runs): make sure the group is on the device, make the
  compute stream wait for its copy, then start copying the next streamed groups on the side stream;
- ``_leave`` (after its last block ran): point the modules back at the host mirror — no
  device-to-host copy, the host already holds the weights — and hand the slab back.

Both stay out of torch.compile graphs (``torch.compiler.disable``): a compiled model breaks its graph
at them, and each block's forward compiles on its own, once for all blocks of its class, since every
device view keeps its dtype, shape and stride whichever slab it lies in.

They decide when; which groups follow which is the schedule's (``schedule.py``), how the bytes travel
and what the streams wait for, the transfers' (``transfers.py``).
"""
from __future__ import annotations

import inspect
import time
from typing import Callable

import torch
from torch import nn

from .group import ModuleGroup
from .runtime import refuse_capture
from .schedule import Schedule
from .transfers import Transfers

#: ``enter(group, first)``: ``first`` when the call opens a run of the group (its first block's opening method).
EnterFn = Callable[[ModuleGroup, bool], None]
#: ``leave(group, close, failed=False)``: ``close`` when the call ends a run (its last block's last method).
LeaveFn = Callable[..., None]


class GroupHooks:
    """Enter and leave for the groups of one handle (``GroupOffloadHandle`` is one, with its public face)."""

    def __init__(self, groups: list[ModuleGroup], schedule: Schedule, transfers: Transfers,
                 entry_methods: tuple[str, ...], learn_entries: bool = False) -> None:
        self.groups = groups
        self._schedule = schedule
        self._transfers = transfers
        self._active: set[int] = set()  # the groups whose run is open
        self.busy = False  # in ``_enter`` / ``_leave``: their own uses of the groups' tensors (see ``watch.py``)
        self._wrappers = EntryWrappers(entry_methods)
        self._parts = PartWrappers(entry_methods) if learn_entries else None
        for group in groups:
            self._wrappers.wrap(group, self._enter, self._leave)
            if self._parts is not None:
                self._parts.wrap(group, self._enter, self._leave)

    def is_open(self, group: ModuleGroup) -> bool:
        """Whether ``group``'s tensors may be used now: one of its entries runs, or its run is open."""
        return group.running > 0 or group.index in self._active

    @torch.compiler.disable
    def close_open_groups(self) -> None:
        """At the end of a model call: close the runs no call of a block ends (those opened by its parts)."""
        self.busy = True
        try:
            self._close_unfinished()
        finally:
            self.busy = False

    def settle_entries(self) -> list[str]:
        """After a model call that ran blocks: keep only the part entries that opened a use of their group
        (``PartWrappers.settle``); the names of those kept."""
        return [] if self._parts is None else self._parts.settle()

    @torch.compiler.disable
    def _enter(self, group: ModuleGroup, first: bool) -> None:
        refuse_capture(self._transfers.runtime)
        group.running += 1
        if group.index in self._active and (group.running > 1 or not first):
            return  # a later block of a group that is already running (its first block again: a new run)
        self.busy = True
        try:
            self._open(group)
        finally:
            self.busy = False

    def _open(self, group: ModuleGroup) -> None:
        started = time.perf_counter()
        if self._active:
            self._close_unfinished()
        self._schedule.saw(group.index)
        if not group.onloaded:
            self._onload(group, prefetched=False)
        elif group.parked:
            group.unpark()
        if group.pending is not None:
            self._take_ready(group)
        if group.ready is not None:
            self._transfers.wait_for(group)
        self._transfers.run_starts(group)
        self._active.add(group.index)
        self._prefetch_after(group, pageable=False)
        self._transfers.ledger.record_hook(time.perf_counter() - started, entered=True)

    @torch.compiler.disable
    def _leave(self, group: ModuleGroup, close: bool, failed: bool = False) -> None:
        if failed and not group.running:
            return  # its enter refused before counting the call (inside a CUDA graph capture): nothing to undo
        group.running -= 1
        self.busy = True
        try:
            if not failed:
                self._prefetch_after(group, pageable=True)
            if close:
                started = time.perf_counter()
                self._close(group)
                self._transfers.ledger.record_hook(time.perf_counter() - started, entered=False)
        finally:
            self.busy = False

    def _take_ready(self, group: ModuleGroup) -> None:
        """The host waits for the worker to queue ``group``'s staged copy (``Transfers.take_ready``)."""
        self._transfers.take_ready(group)

    def _close(self, group: ModuleGroup) -> None:
        self._active.discard(group.index)
        self._transfers.run_ends(group)
        if not group.resident and group.onloaded:
            self._transfers.offload(group)

    def _close_unfinished(self) -> None:
        """Close the groups whose last block was skipped (skip-layer guidance, a replaced block):
        open, but none of their blocks running. Blocks that call other blocks keep theirs open."""
        for index in [i for i in self._active if not self.groups[i].running]:
            self._close(self.groups[index])

    def _prefetch_after(self, group: ModuleGroup, pageable: bool) -> None:
        """Start copying the streamed groups that follow ``group`` (``Schedule.after``), in order, while
        slabs are free; never evicts.

        From its enter (``pageable`` False) only up to the first group whose copy blocks the host: a
        copy from pageable memory blocks the host until it is done, and there it would hold back the
        launch of this group's kernels, leaving the GPU idle through the copy. Its leave (``pageable``
        True), with this group's kernels queued, copies the rest; the copy then overlaps them.
        """
        for index in self._schedule.after(group.index):
            upcoming = self.groups[index]
            if upcoming.onloaded:
                continue
            if not pageable and self._transfers.blocks_the_host(upcoming) or not self._slab_free():
                return
            self._onload(upcoming, prefetched=True)

    def _onload(self, group: ModuleGroup, prefetched: bool) -> None:
        if not group.resident and not self._slab_free():
            # Out of order: a prefetched group that has not run yet gives its slab up.
            waiting = [g for g in self.groups if g.onloaded and not g.resident and g.index not in self._active]
            if waiting:
                self._transfers.offload(waiting[0])
        upcoming = [self.groups[i] for i in self._schedule.after(group.index, self._transfers.read_ahead_cap)]
        self._transfers.onload(group, prefetched, upcoming)

    def _slab_free(self) -> bool:
        """Whether a slab is free, or another may be made within the prefetch depth in effect."""
        return self._transfers.slabs.can_take(self._schedule.prefetch)



class EntryWrappers:
    """The wrappers on the entry methods ``names`` of the blocks of one handle's groups.

    Wrapping the methods (as diffusers' hook registry wraps ``forward``) rather than registering PyTorch
    module hooks: their dispatch costs more per call than re-pointing a whole group, a wrapper can put
    the group back when a forward raises, and it works for methods other than ``forward``.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._wrapped: list[tuple[nn.Module, str, Callable]] = []

    def wrap(self, group: ModuleGroup, enter: EnterFn, leave: LeaveFn) -> None:
        """Wrap each entry method of ``group``'s blocks to call ``enter`` and ``leave`` around it. Of several
        entry methods, all but the last one open a visit of a block (in the group's first block: a run of
        the group) and the last one ends it (in its last block). Only the wrappers hold ``enter`` and
        ``leave`` (the handle): once removed, nothing here keeps the handle alive."""
        names = self._names
        opening = names[:-1] or names
        for block in group.blocks:
            for name in names:
                first = block is group.blocks[0] and name in opening
                last = block is group.blocks[-1] and name == names[-1]
                wrapper = self._offloaded_call(group, getattr(block, name), first, last, enter, leave)
                setattr(block, name, wrapper)
                self._wrapped.append((block, name, wrapper))

    def remove(self) -> None:
        """The blocks' methods back to their classes'; a wrapper someone else wrapped again stays in their
        chain, as a plain pass-through."""
        for block, name, wrapper in self._wrapped:
            if block.__dict__.get(name) is wrapper:
                delattr(block, name)
        self._wrapped.clear()

    def _offloaded_call(self, group: ModuleGroup, method: Callable, first: bool, last: bool, enter: EnterFn,
                        leave: LeaveFn) -> Callable:
        def offloaded_call(*args, **kwargs):
            if not self._wrapped:  # removed while someone else's wrapper still calls this one
                return method(*args, **kwargs)
            try:
                enter(group, first)
                output = method(*args, **kwargs)
            except BaseException:
                leave(group, close=True, failed=True)  # the group computes from its mirror again
                raise
            leave(group, close=last)
            return output

        return offloaded_call


class PartWrappers:
    """Entries beside the blocks' entry methods, for models that use a block some other way: the block's
    other public methods (SenseNova-U1.5's ``forward_prefix`` / ``forward_generation``) and the ``forward``
    of every module inside it that holds tensors (Prism's fused blocks, whose parts the model calls one by
    one). A part entry opens its group's run if none is open, and leaves it open: the run closes as the
    next group opens, or at the end of the model call (``GroupHooks.close_open_groups``).

    Learnt at the first model call that runs blocks (``settle``): the entries that opened a run stay, the
    others are unwrapped (a Linear inside its block's ``forward``), so that a block's ``forward`` compiles
    whole again; but a block's own method never called stays: a later call may run the block through it
    (SenseNova-U1.5 runs ``forward_prefix`` only in calls given no precomputed prefix).
    """

    def __init__(self, entry_methods: tuple[str, ...]) -> None:
        self._entry_methods = entry_methods
        self._wrapped: dict[tuple[int, str], tuple[nn.Module, str, Callable]] = {}
        self._seen: dict[tuple[int, str], bool] = {}  # entry -> whether it ever opened its group's use
        self._of_blocks: set[tuple[int, str]] = set()  # the entries that are methods of a block itself
        self._learning = True

    def wrap(self, group: ModuleGroup, enter: EnterFn, leave: LeaveFn) -> None:
        for block in group.blocks:
            entries = [(block, name) for name in _public_methods(block) if name not in self._entry_methods]
            entries += [(module, "forward") for module in block.modules()
                        if module is not block and _holds_tensors(module) and _has_forward(module)]
            for module, name in entries:
                key = (id(module), name)
                if module is block:
                    self._of_blocks.add(key)
                if key not in self._wrapped:
                    wrapper = self._part_call(key, group, getattr(module, name), enter, leave)
                    setattr(module, name, wrapper)
                    self._wrapped[key] = (module, name, wrapper)

    def settle(self) -> list[str]:
        """Unwrap the entries that opened no run (but a block's own method never called); the names of those
        kept."""
        unused = [key for key in self._wrapped if not self._seen.get(key, key in self._of_blocks)]
        for key in unused:
            module, name, wrapper = self._wrapped.pop(key)
            if module.__dict__.get(name) is wrapper:
                delattr(module, name)
        self._seen.clear()
        self._learning = False
        return sorted({f"{type(module).__name__}.{name}" for module, name, _ in self._wrapped.values()})

    def remove(self) -> None:
        for module, name, wrapper in self._wrapped.values():
            if module.__dict__.get(name) is wrapper:
                delattr(module, name)
        self._wrapped.clear()

    def _part_call(self, key: tuple[int, str], group: ModuleGroup, method: Callable, enter: EnterFn,
                   leave: LeaveFn) -> Callable:
        def part_call(*args, **kwargs):
            if key not in self._wrapped:  # unwrapped while someone else's wrapper still calls this one
                return method(*args, **kwargs)
            if self._learning:
                self._seen[key] = self._seen.get(key, False) or group.running == 0
            try:
                enter(group, False)
                output = method(*args, **kwargs)
            except BaseException:
                leave(group, close=True, failed=True)
                raise
            leave(group, close=False)
            return output

        return part_call


def _public_methods(block: nn.Module) -> list[str]:
    """The public plain methods ``block``'s own classes define (not torch's: a ``Sequential``'s ``append``)."""
    names: list[str] = []
    for cls in type(block).__mro__:
        if cls.__module__.partition(".")[0] == "torch":
            continue
        names += [name for name, value in vars(cls).items()
                  if inspect.isfunction(value) and not name.startswith("_") and name not in names]
    return names


def _holds_tensors(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward

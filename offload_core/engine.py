"""Group offloading without copy-back: hooks, the prefetch schedule and the public entry point.

Per group, per forward (each block's ``forward`` is wrapped):

- ``_enter`` (before the group's first block runs): make sure the group is on the device, make the
  compute stream wait for its copy, then start copying the next streamed groups on the side stream;
- ``_exit`` (after its last block ran): point the modules back at the host mirror — no
  device-to-host copy, the host already holds the weights — and hand the slab back.

Both stay out of torch.compile graphs (``torch.compiler.disable``): a compiled model breaks its graph
at them, and each block's forward compiles on its own, once for all blocks of its class, since every
device view keeps its dtype, shape and stride whichever slab it lies in.

Stream choreography on CUDA (the only cross-stream ordering there is):

- ``group.ready``  recorded on the copy stream after the copy into the slab; the compute stream
  waits on it before the group runs;
- ``self._released[slab]``  recorded on the compute stream when the group that read the slab has
  run; the copy stream waits on it before it overwrites the slab.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from .group import FillFn, ModuleGroup
from .ledger import TransferLedger
from .mirror import CudaHostRegister, Pinner
from .residency import device_footprint, plan_residency

log = logging.getLogger(__name__)

#: Computes a patched weight on the device from the freshly copied one (e.g. LoRA): (name, weight) -> weight.
PatchFn = Callable[[str, torch.Tensor], torch.Tensor]

_MANAGED: "weakref.WeakKeyDictionary[nn.Module, GroupOffloadHandle]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class OffloadConfig:
    onload_device: torch.device
    offload_device: torch.device
    blocks_per_group: int = 1
    prefetch: int = 1
    resident_bytes: int = 0
    pin_memory: bool = True

    def validate(self) -> None:
        if not isinstance(self.blocks_per_group, int) or self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be an integer >= 1, got {self.blocks_per_group!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (0 = synchronous onload), got {self.prefetch!r}")
        if self.resident_bytes < 0:
            raise ValueError(f"resident_bytes must be >= 0 (0 = stream every group), got {self.resident_bytes!r}")
        if self.offload_device.type != "cpu":
            raise ValueError(f"offload_device must be the CPU (host mirrors live in host memory), got {self.offload_device}")


class GroupOffloadHandle:
    """Owns the groups, hooks, slabs and ledger of one ``apply_group_offload`` call."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], config: OffloadConfig,
                 fill: FillFn | None, pinner: Pinner | None, progress: Callable[[int, int], None] | None) -> None:
        self.config = config
        self.ledger = TransferLedger()
        self._cuda = config.onload_device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(config.onload_device) if self._cuda else None
        qualnames = {id(m): (name + "." if name else "") for name, m in model.named_modules(remove_duplicate=False)}
        chunks = [blocks[i : i + config.blocks_per_group] for i in range(0, len(blocks), config.blocks_per_group)]
        self.groups: list[ModuleGroup] = []
        self._pin_failed = False
        for chunk in chunks:
            group = ModuleGroup(len(self.groups), chunk, qualnames, fill)
            self._pin(group, pinner)
            self.groups.append(group)
            if progress is not None:
                progress(len(self.groups), len(chunks))
        self._slab_bytes = 0
        self._slabs_made = 0
        self._free_slabs: list[torch.Tensor] = []
        self._released: dict[int, torch.cuda.Event] = {}
        self._active: set[int] = set()
        self._trace: list[int] = []
        self._lookahead: dict[int, list[ModuleGroup]] | None = None  # group index -> next streamed groups
        self._patch: PatchFn | None = None
        self._patched: dict[int, list[int]] = {}  # group index -> binding indices the patch applies to
        self._wrapped = [w for g in self.groups for w in self._wrap_forwards(g)]
        for block in blocks:
            _MANAGED[block] = self
        self.set_resident_bytes(config.resident_bytes)

    # --- public -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Transfer ledger and layout (never waits for the GPU)."""
        resident = [g for g in self.groups if g.resident]
        return {
            **self.ledger.as_dict(),
            "groups": len(self.groups),
            "resident_groups": len(resident),
            "resident_bytes": sum(g.nbytes for g in resident),
            "streamed_bytes_per_pass": sum(g.nbytes for g in self.groups if not g.resident),
            "slab_bytes": self._slab_bytes * self._slabs_made,
            "host_bytes": sum(g.nbytes for g in self.groups),
            "pinned": all(g.mirror.pinned for g in self.groups),
        }

    def reset_stats(self) -> None:
        self.ledger = TransferLedger()

    def set_resident_bytes(self, budget: int) -> None:
        """Re-plan which groups stay on the device; takes effect from the next forward."""
        if budget < 0:
            raise ValueError(f"resident_bytes must be >= 0 (0 = stream every group), got {budget!r}")
        self.release_device_memory()
        for group, resident in zip(self.groups, plan_residency([g.nbytes for g in self.groups], budget)):
            group.resident = resident
        streamed = [g.nbytes for g in self.groups if not g.resident]
        self._slab_bytes = max(streamed, default=0)
        self._lookahead = None if self._lookahead is None else self._plan_lookahead()

    def device_bytes_needed(self) -> int:
        """Device memory the offloaded blocks hold while sampling: resident groups plus slabs."""
        return device_footprint([g.nbytes for g in self.groups], [g.resident for g in self.groups], self.config.prefetch)

    def set_onload_patch(self, patch: PatchFn | None, names: Iterable[str] = ()) -> None:
        """Apply ``patch`` to the named tensors on the device after every onload (mirrors stay pristine)."""
        wanted = set(names)
        self.release_device_memory()
        self._patch = patch if wanted else None
        self._patched = {g.index: [i for i, n in enumerate(g.qualnames()) if n in wanted] for g in self.groups}

    def onload_resident(self) -> None:
        """Copy the resident groups onto the device now instead of at their first use."""
        for group in self.groups:
            if group.resident and not group.onloaded:
                self._onload(group, prefetched=False)

    def park(self) -> None:
        """Point every module at its host mirror without giving up the device copies.

        Whoever drives the model next sees pristine host weights; if that is this engine again, each
        group takes its device copy up again at its next use, without a copy.
        """
        for group in self.groups:
            if group.onloaded:
                group.park()
        self._active.clear()

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
        self._forget_slabs()
        for block, wrapper in self._wrapped:
            if block.__dict__.get("forward") is wrapper:
                del block.forward  # back to the class's forward
            # else someone wrapped it after us: ours stays in their chain, as a plain pass-through
        self._wrapped.clear()

    def _finish_copies(self) -> None:
        """Device buffers may be dropped only once the copies into them are done."""
        if self._cuda:
            torch.cuda.current_stream(self.config.onload_device).wait_stream(self._copy_stream)

    def _forget_slabs(self) -> None:
        self._active.clear()
        self._free_slabs.clear()
        self._released.clear()
        self._slabs_made = 0

    # --- hooks ------------------------------------------------------------------------------

    def _wrap_forwards(self, group: ModuleGroup) -> list[tuple[nn.Module, Callable]]:
        """Wrap each block's ``forward`` (as diffusers' hook registry does) rather than register
        PyTorch module hooks: their dispatch costs more per call than re-pointing a whole group, and
        a wrapper can put the group back when a forward raises."""
        wrapped = []
        for block in group.blocks:
            wrapper = self._offloaded_forward(group, block.forward, last=block is group.blocks[-1])
            block.forward = wrapper
            wrapped.append((block, wrapper))
        return wrapped

    def _offloaded_forward(self, group: ModuleGroup, forward: Callable, last: bool) -> Callable:
        def offloaded_forward(*args, **kwargs):
            if not self._wrapped:  # removed while someone else's wrapper still calls this one
                return forward(*args, **kwargs)
            self._enter(group)
            try:
                output = forward(*args, **kwargs)
            except BaseException:
                self._exit(group)
                raise
            if last:
                self._exit(group)
            return output

        return offloaded_forward

    @torch.compiler.disable
    def _enter(self, group: ModuleGroup) -> None:
        if group.index in self._active:
            return  # a later block of a group that is already running
        started = time.perf_counter()
        if self._lookahead is None:
            self._learn_order(group)
        if not group.onloaded:
            self._onload(group, prefetched=False)
        elif group.parked:
            group.unpark()
        if group.ready is not None:
            self._wait_for(group)
        self._active.add(group.index)
        if self._lookahead is not None:
            for upcoming in self._lookahead.get(group.index, ()):
                if not upcoming.onloaded and not self._prefetch(upcoming):
                    break
        self.ledger.record_hook(time.perf_counter() - started, entered=True)

    @torch.compiler.disable
    def _exit(self, group: ModuleGroup) -> None:
        started = time.perf_counter()
        self._active.discard(group.index)
        if not group.resident and group.onloaded:
            self._offload(group)
        self.ledger.record_hook(time.perf_counter() - started, entered=False)

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
            plan[group.index] = [order[q] for q in after if order[q] is not group][: self.config.prefetch]
        return plan

    def _prefetch(self, group: ModuleGroup) -> bool:
        """Start copying ``group`` ahead of its use, if a slab is free; never evicts."""
        if not self._free_slabs and self._slabs_made >= self.config.prefetch + 1:
            return False
        self._onload(group, prefetched=True)
        return True

    def _onload(self, group: ModuleGroup, prefetched: bool) -> None:
        slab = self._resident_buffer(group) if group.resident else self._take_slab()
        if self._cuda:
            released = self._released.pop(slab.data_ptr(), None)
            if released is not None:
                self._copy_stream.wait_event(released)  # the last group that read this slab has run
            with torch.cuda.stream(self._copy_stream):
                self._copy_into(group, slab, non_blocking=True)
                group.ready = torch.cuda.Event()
                group.ready.record(self._copy_stream)
        else:
            self._copy_into(group, slab, non_blocking=False)
        self.ledger.onloads += 1
        if prefetched:
            self.ledger.prefetches += 1
        else:
            self.ledger.sync_onloads += 1

    def _copy_into(self, group: ModuleGroup, slab: torch.Tensor, non_blocking: bool) -> None:
        views = group.onload_(slab, non_blocking)
        self.ledger.record_copy(group.nbytes)
        if self._patch is not None:
            for i in self._patched[group.index]:
                views[i].copy_(self._patch(group.bindings[i].qualname, views[i]))

    def _wait_for(self, group: ModuleGroup) -> None:
        stream = torch.cuda.current_stream(self.config.onload_device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(group.ready)
        end.record(stream)
        self.ledger.record_wait(start, end)
        group.ready = None

    def _offload(self, group: ModuleGroup) -> None:
        slab = group.offload_()
        if self._cuda:
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(self.config.onload_device))
            self._released[slab.data_ptr()] = released
        self._free_slabs.append(slab)

    def _take_slab(self) -> torch.Tensor:
        if self._free_slabs:
            return self._free_slabs.pop()
        if self._slabs_made < self.config.prefetch + 1:
            self._slabs_made += 1
            return torch.empty(self._slab_bytes, dtype=torch.uint8, device=self.config.onload_device)
        # Out of order: a prefetched group that has not run yet gives its slab up.
        waiting = [g for g in self.groups if g.onloaded and not g.resident and g.index not in self._active]
        if waiting:
            self._offload(waiting[0])
            return self._free_slabs.pop()
        self._slabs_made += 1  # more groups running at once than slabs: re-entrant blocks
        return torch.empty(self._slab_bytes, dtype=torch.uint8, device=self.config.onload_device)

    def _resident_buffer(self, group: ModuleGroup) -> torch.Tensor:
        return torch.empty(group.nbytes, dtype=torch.uint8, device=self.config.onload_device)

    def _pin(self, group: ModuleGroup, pinner: Pinner | None) -> None:
        if not self.config.pin_memory or self._pin_failed:
            return
        if not self._cuda:
            if group.index == 0:
                log.info("pin_memory ignored: the onload device %s is not a CUDA device", self.config.onload_device)
            return
        if not group.pin(pinner or CudaHostRegister()):
            self._pin_failed = True
            log.warning("could not pin %.1f MB of host memory; streaming from pageable memory (slower copies)",
                        group.nbytes / 2**20)


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
    fill: FillFn | None = None,
    pinner: Pinner | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GroupOffloadHandle:
    """Keep ``blocks`` in packed host mirrors and stream them to ``onload_device`` group by group.

    Only the given blocks are managed; everything else in ``model`` is the caller's to place.
    ``fill(name, host_view)`` writes each tensor's weights into its mirror instead of copying the
    module's current tensor (a loader reads a file straight in); ``pinner`` replaces the default
    ``cudaHostRegister`` pinning; ``progress(done, total)`` is called as the groups are built.
    """
    config = OffloadConfig(torch.device(onload_device), torch.device(offload_device),
                           blocks_per_group, prefetch, resident_bytes, pin_memory)
    config.validate()
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty: pass the model's block modules, e.g. model.transformer_blocks")
    inside = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if id(block) not in inside:
            raise ValueError(f"blocks[{i}] ({type(block).__name__}) is not a submodule of the given model")
        if block in _MANAGED:
            raise ValueError(f"blocks[{i}] is already group-offloaded; call remove() on its handle before applying again")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("blocks lists the same module more than once")
    return GroupOffloadHandle(model, blocks, config, fill, pinner, progress)


def handle_of(block: nn.Module) -> GroupOffloadHandle | None:
    """The handle that manages ``block``, if any."""
    return _MANAGED.get(block)

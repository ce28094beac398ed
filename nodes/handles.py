"""A model's ``GroupOffloadHandle`` in ComfyUI: its build (pinned through ComfyUI's ``pin_memory``), the
guard that takes it off when a plain patcher runs the model, its owners (the GroupOffloadPatchers of the
model: it goes with the last of them) and its removal; and, at ComfyUI's pinned-memory limit, the pins
the other models give up first: those ComfyUI has unloaded, then those run longest ago."""
from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

import comfy.model_management as mm
import comfy.utils
from comfy.model_patcher import ModelPatcher

from ..offload_core import GroupOffloadHandle, OutsideUseWatch, apply_group_offload, format_bytes, handle_of
from .blocks import find_blocks
from .compiler import ComfyCudaRuntime
from .memory import (HostBudget, anonymous_host_bytes, host_budget, module_bytes, pinning_enabled, plan_blocks,
                     raw_group_bytes, room_on_the_card)
from .settings import OffloadSettings

log = logging.getLogger(__name__)

_cpu_notice_given = False


class ComfyPinner:
    """Pins the mirrors of one diffusion model through ComfyUI's ``pin_memory``, so that its
    pinned-memory total and limit count them.

    ComfyUI 0.3.75 pins only tensors whose type is named ``Parameter`` (or ``QuantizedTensor``; 0.33.0
    plain tensors too); a mirror is handed over as a Parameter over the same storage, which ComfyUI
    registers in place. ComfyUI's limit (``MAX_PINNED_MEMORY``) is kept here: from 0.33.0 on,
    ``pin_memory`` evicts what it can of its own pins (``ensure_pin_registerable``) and then registers
    even past the limit. Past the limit, other offloaded models give
    their pins up first (see ``_make_pin_room``); what still does not fit stays in pageable memory and, on
    a GPU, streams through the handle's pinned staging buffers.
    """

    def __init__(self, owner: nn.Module) -> None:
        self._owner = weakref.ref(owner)

    enabled = staticmethod(pinning_enabled)

    def pin(self, buffer: torch.Tensor) -> bool:
        return _make_pin_room(buffer.nbytes, keep=self._owner()) and bool(
            mm.pin_memory(nn.Parameter(buffer, requires_grad=False)))

    def unpin(self, buffer: torch.Tensor) -> None:
        mm.unpin_memory(buffer)


def warn_if_unpinned(handle: GroupOffloadHandle) -> None:
    """One warning per load when some streamed packed groups copy from pageable memory (those the host budget
    left in place are never pinned: they always stream through the staging buffers)."""
    streamed = [g for g in handle.snapshot() if not g.resident and g.packed]
    pinned = [g for g in streamed if g.pinned]
    if len(pinned) == len(streamed) or not ComfyPinner.enabled():
        return
    staging = handle.stats()["staging_bytes"]
    route = (f"through {format_bytes(staging)} of pinned staging buffers (a host copy each, slower than a pinned group)"
             if staging else "from pageable memory, with slower copies")
    log.warning("Group Offload: %d of %d streamed groups are pinned (%s of %s); ComfyUI's pinned-memory limit is %s, "
                "%s of it in use. The others stream %s: unload other models, load the model as fp8, or set "
                "residency to keep more groups on the GPU",
                len(pinned), len(streamed), format_bytes(sum(g.nbytes for g in pinned)),
                format_bytes(sum(g.nbytes for g in streamed)), format_bytes(mm.MAX_PINNED_MEMORY),
                format_bytes(mm.TOTAL_PINNED_MEMORY), route)


# --- build -------------------------------------------------------------------------------------


def _cast_to_model_dtypes(blocks: list[nn.Module]) -> None:
    """Give each weight the dtype the model was built for (e.g. fp8), so that the mirrors hold that.

    With Dynamic VRAM on (newest ComfyUI), Linear weights load lazily in the file's dtype and are cast
    to the model's (``<name>_comfy_model_dtype``) only as they move to the device.
    """
    for block in blocks:
        for module in block.modules():
            for name, param in module.named_parameters(recurse=False):
                dtype = getattr(module, f"{name}_comfy_model_dtype", None)
                if dtype is not None and param.dtype != dtype and type(param) is nn.Parameter:
                    param.data = param.data.to(dtype)


def build_handle(model: nn.Module, blocks: list[nn.Module], device: torch.device,
                 settings: OffloadSettings) -> GroupOffloadHandle:
    """Pack the blocks into host mirrors (with a ComfyUI progress bar) as far as the host budget allows,
    pin the ones planned to stream, and hook them."""
    global _cpu_notice_given
    if torch.device(device).type == "cpu" and not _cpu_notice_given:
        _cpu_notice_given = True
        log.info("Group Offload: ComfyUI runs on the CPU, so offloading brings nothing here; "
                 "the whole mechanism still runs, with host-to-host copies")
    _cast_to_model_dtypes(blocks)
    bar = comfy.utils.ProgressBar(len(blocks))
    other_bytes = mm.module_size(model) - module_bytes(blocks)
    plan = plan_blocks(settings, raw_group_bytes(blocks, settings.blocks_per_group),  # so it pins what will stream
                       room_on_the_card(model, device, other_bytes))
    budget = host_budget(settings, module_bytes(blocks), packed_elsewhere=packed_host_bytes(),
                         freed_by_packing=anonymous_host_bytes(blocks))
    handle = apply_group_offload(
        model, blocks, device,
        offload_device="cpu",
        blocks_per_group=settings.blocks_per_group,
        prefetch=settings.prefetch,
        resident_bytes=plan.resident_bytes,
        host_budget=budget.bytes,
        pin_memory=ComfyPinner.enabled(),
        learn_entries=True,
        **_runtime_for(torch.device(device)),
        pinner=ComfyPinner(model.diffusion_model),
        progress=lambda done, total: bar.update_absolute(done, total),
    )
    _guard(model, handle)
    _BUILT_WITH[handle] = settings.handle_layout()
    _HOST_LIMIT[handle] = budget.bound_by
    _log_host_copies(handle, settings, budget)
    return handle


def _runtime_for(device: torch.device) -> dict:
    """On a CUDA device, the runtime that makes the streaming buffers outside ComfyUI's memory compiler."""
    return {"runtime": ComfyCudaRuntime(device)} if device.type == "cuda" else {}


def packed_host_bytes() -> int:
    """The packed host copies every offloaded model alive holds (what a shared host budget already spent)."""
    handles = (ref() for ref in list(_HANDLES.values()))
    return sum(handle.stats()["packed_bytes"] for handle in handles if handle is not None)


def _log_host_copies(handle: GroupOffloadHandle, settings: OffloadSettings, budget: HostBudget) -> None:
    stats = handle.stats()
    in_place = (f", {format_bytes(stats['in_place_bytes'])} left in place ({format_bytes(stats['file_backed_bytes'])} "
                f"of it file-backed, read through the page cache)" if stats["in_place_bytes"] else "")
    allowed = "all of it fits" if budget.bytes is None else f"{format_bytes(budget.bytes)} allowed"
    log.info("Group Offload: %s of the blocks packed in host memory%s (host_memory %s: %s, bound by %s)",
             format_bytes(stats["packed_bytes"]), in_place, settings.host_memory, allowed, budget.bound_by)


# Handle -> the settings it was built for (``OffloadSettings.handle_layout``): other settings need a new handle.
_BUILT_WITH: "weakref.WeakKeyDictionary[GroupOffloadHandle, tuple]" = weakref.WeakKeyDictionary()
# Handle -> the limit that bound its host budget (``HostBudget.bound_by``): the readout names it.
_HOST_LIMIT: "weakref.WeakKeyDictionary[GroupOffloadHandle, str]" = weakref.WeakKeyDictionary()


def host_limit(handle: GroupOffloadHandle) -> str | None:
    """The limit that bound ``handle``'s host budget when ``build_handle`` built it."""
    return _HOST_LIMIT.get(handle)


def built_for(handle: GroupOffloadHandle) -> tuple | None:
    """The ``handle_layout`` of the settings ``build_handle`` built ``handle`` for."""
    return _BUILT_WITH.get(handle)


# --- guard -------------------------------------------------------------------------------------

_GUARDS: "weakref.WeakKeyDictionary[nn.Module, list[torch.utils.hooks.RemovableHandle]]" = weakref.WeakKeyDictionary()
# Base model -> the handle on its blocks, found even while a wrapper around the one that backs off has
# swapped the diffusion model or its blocks for compiled ones (TorchCompileModel, per-block compiles).
_HANDLES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[GroupOffloadHandle]]" = weakref.WeakKeyDictionary()


def handle_for_model(base_model: nn.Module) -> GroupOffloadHandle:
    """The handle ``build_handle`` put on ``base_model``'s blocks (it must be alive)."""
    return _HANDLES[base_model]()


def _guard(base_model: nn.Module, handle: GroupOffloadHandle) -> None:
    """Hooks on the diffusion model: the handle goes when a plain ModelPatcher drives it (one that
    ``own_handle`` never saw); each call closes the runs of groups its blocks' parts opened; and until a
    call has run blocks, the entries are being learnt: a block's tensor used outside all of them is an
    error naming the model and the tensor, raised before it is used (``OutsideUseWatch``; not while
    torch.compile traces the whole model: its graphs would hold the check)."""
    diffusion_model = base_model.diffusion_model
    for hook in _GUARDS.pop(diffusion_model, []):
        hook.remove()
    model_ref, handle_ref = weakref.ref(base_model), weakref.ref(handle)
    learning = {"watch": None, "entered": 0, "done": False}
    name = type(diffusion_model).__name__

    def outside_use(qualname: str) -> str:
        return (f"Group Offload: {name} uses {qualname} of its transformer blocks without calling the block or a "
                f"module in it, so Group Offload cannot stream it (it would compute from host memory): connect the "
                f"model to the sampler without Group Offload")

    def before_call(module, args):
        patcher = getattr(model_ref(), "current_patcher", None)
        if patcher is not None and patcher not in _OFFLOAD_PATCHERS:
            log.info("Group Offload: a plain patcher runs this model now; removing the offload hooks")
            remove_handle(model_ref())
            return
        handle = handle_ref()
        if handle is not None and not learning["done"] and learning["watch"] is None:
            learning["entered"] = handle.ledger_figures()["hook_calls"]
            if not torch.compiler.is_compiling():  # (torch.compile of the whole model traces this hook)
                learning["watch"] = OutsideUseWatch(handle, outside_use).__enter__()

    @torch.compiler.disable
    def after_call(module, args, output):
        watch, learning["watch"] = learning["watch"], None
        if watch is not None:
            watch.__exit__(None, None, None)
        handle = handle_ref()
        if handle is None:
            return
        handle.close_open_groups()
        if not learning["done"] and output is not None and handle.ledger_figures()["hook_calls"] > learning["entered"]:
            learning["done"] = True
            log.debug("Group Offload: %s runs its blocks through %s", name, ", ".join(handle.settle_entries()))

    _HANDLES[base_model] = handle_ref
    _GUARDS[diffusion_model] = [diffusion_model.register_forward_pre_hook(before_call),
                                diffusion_model.register_forward_hook(after_call, always_call=True)]


# --- ownership and removal ---------------------------------------------------------------------

# Base model -> how many GroupOffloadPatchers (the node's clone and every clone of it) can drive its handle.
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
# Every GroupOffloadPatcher alive (each passes through ``own_handle``): a patcher not in it is a plain one.
_OFFLOAD_PATCHERS: "weakref.WeakSet[ModelPatcher]" = weakref.WeakSet()


def own_handle(patcher: ModelPatcher) -> None:
    """Remove the handle once the last GroupOffloadPatcher of its model is garbage-collected.

    The model may outlive them all (the plain patcher it was cloned from stays in ComfyUI's cache, and
    ComfyUI then unloads that one in their place); nothing would ever give the handle's device copies
    and pinned memory back otherwise. The callback holds the model, which the patcher holds anyway: so
    it lives no longer for it, and is still there to unpin when both go in one garbage collection.
    """
    model = patcher.model
    _OFFLOAD_PATCHERS.add(patcher)
    _OWNERS[model] = _OWNERS.get(model, 0) + 1
    weakref.finalize(patcher, _disown_handle, model).atexit = False


def _disown_handle(model: nn.Module) -> None:
    owners = _OWNERS.pop(model, 1) - 1
    if owners:
        _OWNERS[model] = owners
    else:
        remove_handle(model)


def remove_handle(base_model: nn.Module) -> None:
    """Hooks and pinned memory gone; the weights stay, as ordinary host memory."""
    blocks = find_blocks(base_model.diffusion_model)
    handle = handle_of(blocks[0]) if blocks else None
    if handle is not None:
        handle.remove()
    for hook in _GUARDS.pop(base_model.diffusion_model, []):
        hook.remove()
    _HANDLES.pop(base_model, None)


# --- pins past ComfyUI's limit -----------------------------------------------------------------

# Diffusion model -> when its handle last started a sampling run (a counter): the least recent gives its pins up first.
_LAST_RUN: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_runs_started = itertools.count(1)


def mark_run_started(diffusion_model: nn.Module) -> None:
    _LAST_RUN[diffusion_model] = next(_runs_started)


def _make_pin_room(nbytes: int, keep: nn.Module | None) -> bool:
    """Whether ``nbytes`` more fit ComfyUI's pinned-memory limit, once ComfyUI has evicted what it evicts
    of its own (newest) and other offloaded models gave up pins: those ComfyUI has unloaded first, then
    the least recently run, never ``keep``."""
    ensure_registerable = getattr(mm, "ensure_pin_registerable", None)
    if ensure_registerable is not None:
        ensure_registerable(nbytes)
    for handle in _handles_giving_pins_first(keep):
        if _pin_shortfall(nbytes) <= 0:
            break
        handle.unpin(at_least=_pin_shortfall(nbytes))
    return _pin_shortfall(nbytes) <= 0


def _pin_shortfall(nbytes: int) -> int:
    """Bytes past ComfyUI's limit if ``nbytes`` more were pinned (ComfyUI's own count: every pin, not only ours)."""
    return mm.TOTAL_PINNED_MEMORY + nbytes - mm.MAX_PINNED_MEMORY


def _handles_giving_pins_first(keep: nn.Module | None) -> list[GroupOffloadHandle]:
    loaded = {id(getattr(m.model.model, "diffusion_model", None)) for m in mm.current_loaded_models if m.model is not None}
    others = [m for m in list(_GUARDS) if m is not keep]  # every other diffusion model with a handle
    others.sort(key=lambda m: (id(m) in loaded, _LAST_RUN.get(m, 0)))
    handles = [handle_of(find_blocks(m)[0]) for m in others]
    return [h for h in handles if h is not None]

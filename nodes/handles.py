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
from .blocks import blocks_owner, find_blocks, is_text_encoder
from .compiler import ComfyCudaRuntime
from .memory import (GIVEN_TO_THE_DIFFUSION_MODEL, HostBudget, anonymous_host_bytes, host_budget, module_bytes,
                     pinning_enabled, plan_blocks, raw_group_bytes, room_on_the_card)
from .model_state import ModelState, every_state, state_of
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
    block_bytes, freed_by_packing = module_bytes(blocks), anonymous_host_bytes(blocks)
    givable = 0 if is_text_encoder(model) else text_encoders_packing()
    budget = host_budget(settings, block_bytes, packed_elsewhere=packed_host_bytes(),
                         freed_by_packing=freed_by_packing, givable=givable)
    taken = take_text_encoders_packing(budget.taken_from_text_encoders)
    if budget.taken_from_text_encoders:  # the room as it is now, whatever the text encoders could give up
        budget = host_budget(settings, block_bytes, packed_elsewhere=packed_host_bytes(),
                             freed_by_packing=freed_by_packing)
    handle = apply_group_offload(
        model, blocks, device,
        offload_device="cpu",
        blocks_per_group=settings.blocks_per_group,
        prefetch=settings.prefetch,
        resident_bytes=plan.resident_bytes,
        host_budget=budget.bytes,
        pin_memory=ComfyPinner.enabled(),
        learn_entries=True,
        returnable=is_text_encoder(model),  # (a text encoder's packed copies are the first a diffusion model takes)
        **_runtime_for(torch.device(device)),
        pinner=ComfyPinner(model),
        progress=lambda done, total: bar.update_absolute(done, total),
    )
    _guard(model, handle)
    state = state_of(model)
    state.built_with = settings.handle_layout()
    state.host_limit = budget.bound_by + (f", {format_bytes(taken)} of it the text encoder's" if taken else "")
    _log_host_copies(handle, settings, budget)
    return handle


def _runtime_for(device: torch.device) -> dict:
    """On a CUDA device, the runtime that makes the streaming buffers outside ComfyUI's memory compiler."""
    return {"runtime": ComfyCudaRuntime(device)} if device.type == "cuda" else {}


def _live_handles(text_encoders_only: bool = False) -> list[tuple[nn.Module, GroupOffloadHandle]]:
    """Each offloaded model alive with its handle (only the text encoders')."""
    found = [(model, state.handle()) for model, state in every_state() if state.handle is not None
             and (is_text_encoder(model) or not text_encoders_only)]
    return [(model, handle) for model, handle in found if handle is not None]


def packed_host_bytes() -> int:
    """The packed host copies every offloaded model alive holds (what a shared host budget already spent)."""
    return sum(handle.stats()["packed_bytes"] for _, handle in _live_handles())


def text_encoders_packing() -> int:
    """The packed host copies of the offloaded text encoders that can stream from their files instead
    (``GroupOffloadHandle.returnable_bytes``): the first a diffusion model's host budget takes."""
    return sum(handle.returnable_bytes() for _, handle in _live_handles(text_encoders_only=True))


def take_text_encoders_packing(nbytes: int) -> int:
    """At least ``nbytes`` of the text encoders' packed host copies given up (before the diffusion model packs
    its own): those groups stream from the text encoders' files from then on, and their readouts say so. The
    diffusion model runs every step, a text encoder once per prompt change. Returns the bytes given up."""
    taken = 0
    for model, handle in _live_handles(text_encoders_only=True):
        if taken >= nbytes:
            break
        if not handle.returnable_bytes():
            continue
        patcher = next(iter(state_of(model).offload_patchers), None)  # (any: the device memory is the model's)
        if patcher is not None:
            patcher.release_handle_memory()  # taken off what ComfyUI counts as loaded too
        freed = handle.give_up_packing(nbytes - taken)
        if freed:
            taken += freed
            state_of(model).host_limit = GIVEN_TO_THE_DIFFUSION_MODEL
            log.info("Group Offload: the text encoder's %s of packed host copies go to the diffusion model's host "
                     "budget; those layers stream from the text encoder's file", format_bytes(freed))
    return taken


def _log_host_copies(handle: GroupOffloadHandle, settings: OffloadSettings, budget: HostBudget) -> None:
    stats = handle.stats()
    in_place = (f", {format_bytes(stats['in_place_bytes'])} left in place ({format_bytes(stats['file_backed_bytes'])} "
                f"of it file-backed, read through the page cache)" if stats["in_place_bytes"] else "")
    allowed = "all of it fits" if budget.bytes is None else f"{format_bytes(budget.bytes)} allowed"
    log.info("Group Offload: %s of the blocks packed in host memory%s (host_memory %s: %s, bound by %s)",
             format_bytes(stats["packed_bytes"]), in_place, settings.host_memory, allowed, budget.bound_by)


def host_limit(base_model: nn.Module) -> str | None:
    """The limit that bound the host budget of the handle ``build_handle`` put on ``base_model``'s blocks."""
    return state_of(base_model).host_limit


def built_for(base_model: nn.Module) -> tuple | None:
    """The ``handle_layout`` of the settings ``build_handle`` built the handle on ``base_model``'s blocks for."""
    return state_of(base_model).built_with


# --- guard -------------------------------------------------------------------------------------

def handle_for_model(base_model: nn.Module) -> GroupOffloadHandle:
    """The handle ``build_handle`` put on ``base_model``'s blocks (it must be alive), found even while a wrapper
    around the one that backs off has swapped the diffusion model or its blocks for compiled ones
    (TorchCompileModel, per-block compiles)."""
    return state_of(base_model).handle()


def _guard(base_model: nn.Module, handle: GroupOffloadHandle) -> None:
    """Hooks on the diffusion model: the handle goes when a plain ModelPatcher drives it (one that
    ``own_handle`` never saw); each call closes the runs of groups its blocks' parts opened; and until a
    call has run blocks, the entries are being learnt: a block's tensor used outside all of them is an
    error naming the model and the tensor, raised before it is used (``OutsideUseWatch``; not while
    torch.compile traces the whole model: its graphs would hold the check)."""
    owner = blocks_owner(base_model)
    state = state_of(base_model)
    _remove_guards(state)
    model_ref, handle_ref = weakref.ref(base_model), weakref.ref(handle)
    learning = {"entered": 0, "done": False}
    name = type(owner).__name__

    def outside_use(qualname: str) -> str:
        return (f"Group Offload: {name} uses {qualname} of its transformer blocks without calling the block or a "
                f"module in it, so Group Offload cannot stream it (it would compute from host memory): connect the "
                f"model to the sampler without Group Offload")

    def before_call(module, args):
        patcher = driving_patcher(model_ref())
        if patcher is not None and patcher not in state.offload_patchers:
            log.info("Group Offload: a plain patcher runs this model now; removing the offload hooks")
            remove_handle(model_ref())
            return
        stop_watching(state)  # (one an interrupted call left, where its cleanup did not run)
        handle = handle_ref()
        if handle is not None and not learning["done"]:
            learning["entered"] = handle.ledger_figures()["hook_calls"]
            if not torch.compiler.is_compiling():  # (torch.compile of the whole model traces this hook)
                state.watch = OutsideUseWatch(handle, outside_use).__enter__()

    @torch.compiler.disable
    def after_call(module, args, output):
        stop_watching(state)
        handle = handle_ref()
        if handle is None:
            return
        handle.close_open_groups()
        if not learning["done"] and output is not None and handle.ledger_figures()["hook_calls"] > learning["entered"]:
            learning["done"] = True
            log.debug("Group Offload: %s runs its blocks through %s", name, ", ".join(handle.settle_entries()))

    state.handle = handle_ref
    state.guards = [owner.register_forward_pre_hook(before_call),
                    owner.register_forward_hook(after_call, always_call=True)]


def driving_patcher(base_model: nn.Module) -> ModelPatcher | None:
    """The patcher running ``base_model`` now: a diffusion model's ``current_patcher`` (set by the sampler); for a
    text encoder, which has none, the patcher of it that ComfyUI loaded last (``CLIP.load_model`` loads it before
    each encode)."""
    if hasattr(base_model, "current_patcher"):
        return base_model.current_patcher
    return next((loaded.model for loaded in mm.current_loaded_models
                 if loaded.model is not None and loaded.model.model is base_model), None)


def stop_watching(state: ModelState) -> None:
    """Take the watch of a call that learns the entries off the torch function mode stack.

    The diffusion model's forward hook does it at the end of the call, but torch runs a forward hook after an
    exception only for an ``Exception``: ComfyUI 0.33's ``InterruptProcessingException`` is a ``BaseException``,
    raised inside a forward when the user interrupts. Then the sampler's ``cleanup`` (in its ``finally``, on the
    same thread, with the call's own context managers unwound, so the watch is on top) does it; otherwise the watch
    would stay on that thread's stack, holding the handle and seeing every torch call after it.
    """
    watch, state.watch = state.watch, None
    if watch is not None:
        watch.__exit__(None, None, None)


def _remove_guards(state: ModelState) -> None:
    for hook in state.guards:
        hook.remove()
    state.guards = []


# --- ownership and removal ---------------------------------------------------------------------

def own_handle(patcher: ModelPatcher) -> None:
    """Remove the handle once the last GroupOffloadPatcher of its model is garbage-collected.

    The model may outlive them all (the plain patcher it was cloned from stays in ComfyUI's cache, and
    ComfyUI then unloads that one in their place); nothing would ever give the handle's device copies
    and pinned memory back otherwise. The callback holds the model, which the patcher holds anyway: so
    it lives no longer for it, and is still there to unpin when both go in one garbage collection.
    """
    model = patcher.model
    state = state_of(model)
    state.offload_patchers.add(patcher)
    state.owners += 1
    weakref.finalize(patcher, _disown_handle, model).atexit = False


def _disown_handle(model: nn.Module) -> None:
    state = state_of(model)
    state.owners = max(0, state.owners - 1)
    if not state.owners:
        remove_handle(model)


def remove_handle(base_model: nn.Module) -> None:
    """Hooks and pinned memory gone; the weights stay, as ordinary host memory."""
    blocks = find_blocks(blocks_owner(base_model))
    handle = handle_of(blocks[0]) if blocks else None
    if handle is not None:
        handle.remove()
    state = state_of(base_model)
    _remove_guards(state)
    state.handle = state.built_with = state.host_limit = None


# --- pins past ComfyUI's limit -----------------------------------------------------------------

_runs_started = itertools.count(1)


def mark_run_started(base_model: nn.Module) -> None:
    state_of(base_model).run_started = next(_runs_started)


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
    loaded = {id(m.model.model) for m in mm.current_loaded_models if m.model is not None}
    others = [(m, state) for m, state in every_state() if state.guards and m is not keep]  # the others with a handle
    others.sort(key=lambda item: (id(item[0]) in loaded, item[1].run_started))
    handles = [handle_of(find_blocks(blocks_owner(m))[0]) for m, _ in others]
    return [h for h in handles if h is not None]

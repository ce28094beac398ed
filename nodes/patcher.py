"""``GroupOffloadPatcher``: a ModelPatcher whose diffusion blocks stream from pinned host mirrors.

ComfyUI's memory manager keeps working as it does for every model; only four of its questions get
different answers:

- ``model_size``  the device footprint this model asks for: the weights outside the blocks, plus the
  resident groups and streaming slabs (``auto`` asks for everything, so ComfyUI sizes the budget);
- ``load``        ComfyUI loads everything but the blocks its usual way; the blocks get the engine,
  with as many groups resident as the budget allows;
- ``partially_unload`` / ``unpatch_model``  give the engine's device memory back first;
- ``detach``      (unload) also removes the engine, so the pinned host memory is returned too; a later
  engine adopts the packed host buffers without a copy.

A plain clone of the same model (the node bypassed, say) must find plain modules: a guard on the
diffusion model takes the engine off when such a patcher runs it.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import uuid
import weakref
from typing import Iterator

import torch
from torch import nn

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.utils
from comfy.model_patcher import ModelPatcher, get_key_weight, string_to_seed

from ..offload_core import (GroupOffloadHandle, apply_group_offload, check_offloadable, device_footprint, handle_of,
                            plan_residency)
from .blocks import block_list_owners, find_blocks
from .memory import OffloadSettings, resident_budget
from .telemetry import finish_run, post_cfg_step, start_run

log = logging.getLogger(__name__)

# Newest ComfyUI computes a patched weight without storing it (and in its own LoRA dtype).
_PATCH_RETURNS_WEIGHT = "return_weight" in inspect.signature(ModelPatcher.patch_weight_to_device).parameters
_cpu_notice_given = False


class ComfyPinner:
    """Pins through ComfyUI, so that its pinned-memory budget and accounting see the mirrors."""

    def pin(self, buffer: torch.Tensor) -> bool:
        return bool(mm.pin_memory(buffer))

    def unpin(self, buffer: torch.Tensor) -> None:
        mm.unpin_memory(buffer)


@contextlib.contextmanager
def _blocks_hidden(diffusion_model: nn.Module) -> Iterator[None]:
    """Take the block lists out of the module tree, so ComfyUI's loader sees only the rest."""
    saved = [(owner, attribute, getattr(owner, attribute)) for owner, attribute in block_list_owners(diffusion_model)]
    try:
        for owner, attribute, blocks in saved:
            setattr(owner, attribute, type(blocks)())  # empty, of the same kind
        yield
    finally:
        for owner, attribute, blocks in saved:
            setattr(owner, attribute, blocks)


def _module_bytes(modules: list[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


class GroupOffloadPatcher(ModelPatcher):
    offload_settings: OffloadSettings

    def clone(self, *args, **kwargs) -> "GroupOffloadPatcher":
        clone = super().clone(*args, **kwargs)
        clone.offload_settings = self.offload_settings
        return clone

    # --- what ComfyUI asks --------------------------------------------------------------------

    def model_size(self) -> int:
        blocks = self.blocks()
        total = mm.module_size(self.model)
        if self.offload_settings.residency == "auto" or not blocks:
            return total
        return total - _module_bytes(blocks) + self._planned_device_bytes(blocks)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        with _blocks_hidden(self.model.diffusion_model):
            super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                         force_patch_weights=force_patch_weights, full_load=True)
        other_bytes = mm.module_size(self.model) - _module_bytes(self.blocks())
        handle = self.engine(device_to)
        slabs = device_footprint([g.nbytes for g in handle.groups], [False] * len(handle.groups), handle.config.prefetch)
        handle.set_resident_bytes(resident_budget(self.offload_settings, lowvram_model_memory, full_load, other_bytes, slabs))
        handle.set_onload_patch(self._onload_patch(), [k for k in self.patches if k in self._block_keys(handle)])
        handle.onload_resident()
        self.model.model_loaded_weight_memory = other_bytes + handle.device_bytes_needed()
        self.model.model_lowvram = False
        stats = handle.stats()
        log.info("Group Offload: %d of %d groups resident (%.2f GB), %.2f GB streamed per pass, prefetch %d",
                 stats["resident_groups"], stats["groups"], stats["resident_bytes"] / 1e9,
                 stats["streamed_bytes_per_pass"] / 1e9, handle.config.prefetch)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self._release_engine_memory()
        if freed < memory_to_free:
            freed += super().partially_unload(device_to, memory_to_free - freed, force_patch_weights=force_patch_weights)
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            self._release_engine_memory()
        return super().unpatch_model(device_to, unpatch_weights)

    def detach(self, unpatch_all=True):
        # ``unpatch_all=False`` comes before every sampling run (load_models_gpu detaches the
        # requested model itself, or a clone about to take over): park the engine, so that a plain
        # clone finds pristine host weights and this one takes its device copies up again for free.
        # Unloading removes it: the pinned memory goes back, the weights stay as ordinary host
        # memory, and a later engine adopts that packing.
        model = super().detach(unpatch_all)
        if unpatch_all:
            remove_engine(self.model)
        elif (handle := self.current_engine()) is not None and getattr(self.model, "current_patcher", None) in (None, self):
            handle.park()  # (a stale clone being garbage-collected detaches too: it must not park a running engine)
        return model

    def pre_run(self):
        super().pre_run()
        handle = self.current_engine()
        if handle is not None:
            start_run(self.model.diffusion_model, handle, self.offload_settings.node_id,
                      cpu_only=torch.device(self.load_device).type == "cpu")

    def cleanup(self):
        finish_run(self.model.diffusion_model)
        super().cleanup()

    # --- the engine ---------------------------------------------------------------------------

    def blocks(self) -> list[nn.Module]:
        return find_blocks(self.model.diffusion_model)

    def current_engine(self) -> GroupOffloadHandle | None:
        blocks = self.blocks()  # empty while ComfyUI's own load runs with the blocks hidden
        return handle_of(blocks[0]) if blocks else None

    def engine(self, device: torch.device) -> GroupOffloadHandle:
        """The engine on this model's blocks, built (or rebuilt for a new layout) on demand."""
        settings = self.offload_settings
        handle = self.current_engine()
        if handle is not None and (handle.config.blocks_per_group, handle.config.prefetch) != (settings.blocks_per_group, settings.prefetch):
            remove_engine(self.model)
            handle = None
        if handle is None:
            handle = build_engine(self.model, self.blocks(), device, settings)
        return handle

    def _release_engine_memory(self) -> int:
        handle = self.current_engine()
        if handle is None or not any(g.onloaded for g in handle.groups):
            return 0
        held = handle.device_bytes_needed()
        handle.release_device_memory()
        self.model.model_loaded_weight_memory = max(0, self.model.model_loaded_weight_memory - held)
        self.model.model_lowvram = True  # so that the next load_models_gpu calls load() again
        return held

    def _planned_device_bytes(self, blocks: list[nn.Module]) -> int:
        handle = self.current_engine()
        if handle is not None:
            return handle.device_bytes_needed()
        size = self.offload_settings.blocks_per_group
        group_bytes = [_module_bytes(blocks[i : i + size]) for i in range(0, len(blocks), size)]
        budget = resident_budget(self.offload_settings, 0, False, 0, 0)
        return device_footprint(group_bytes, plan_residency(group_bytes, budget), self.offload_settings.prefetch)

    @staticmethod
    def _block_keys(handle: GroupOffloadHandle) -> set[str]:
        return {name for group in handle.groups for name in group.qualnames()}

    def _onload_patch(self):
        """LoRA and other weight patches, computed on the device from each fresh copy."""
        patcher = weakref.ref(self)  # the engine lives on the shared model; it must not keep patchers alive
        return lambda key, weight: patcher().patched_weight(key, weight)

    def patched_weight(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with this patcher's patches for ``key``, exactly as ComfyUI's own load computes it."""
        if _PATCH_RETURNS_WEIGHT:
            return self.patch_weight_to_device(key, device_to=weight.device, return_weight=True)
        _, set_func, convert_func = get_key_weight(self.model, key)
        if set_func is not None:
            raise ValueError(f"Group Offload cannot patch {key}: its weight format needs ComfyUI's own loader")
        temp = mm.cast_to_device(weight, weight.device, torch.float32, copy=True)
        if convert_func is not None:
            temp = convert_func(temp, inplace=True)
        out = comfy.lora.calculate_weight(self.patches[key], temp, key)
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=string_to_seed(key))


_GUARDS: "weakref.WeakKeyDictionary[nn.Module, torch.utils.hooks.RemovableHandle]" = weakref.WeakKeyDictionary()


def _guard_against_plain_patchers(base_model: nn.Module) -> None:
    """Remove the engine at the first forward of a sampling run that a plain ModelPatcher drives."""
    model_ref = weakref.ref(base_model)

    def check(module, args):
        patcher = getattr(model_ref(), "current_patcher", None)
        if patcher is not None and not isinstance(patcher, GroupOffloadPatcher):
            log.info("Group Offload: a plain patcher runs this model now; removing the offload hooks")
            remove_engine(model_ref())

    _GUARDS[base_model.diffusion_model] = base_model.diffusion_model.register_forward_pre_hook(check)


def remove_engine(base_model: nn.Module) -> None:
    """Hooks and pinned memory gone; the weights stay, as ordinary host memory."""
    blocks = find_blocks(base_model.diffusion_model)
    handle = handle_of(blocks[0]) if blocks else None
    if handle is not None:
        handle.remove()
    guard = _GUARDS.pop(base_model.diffusion_model, None)
    if guard is not None:
        guard.remove()


def build_engine(model: nn.Module, blocks: list[nn.Module], device: torch.device, settings: OffloadSettings,
                 fill=None) -> GroupOffloadHandle:
    """Pack the blocks into pinned host mirrors (with a ComfyUI progress bar) and hook them."""
    global _cpu_notice_given
    if torch.device(device).type == "cpu" and not _cpu_notice_given:
        _cpu_notice_given = True
        log.info("Group Offload: ComfyUI runs on the CPU, so offloading brings nothing here; "
                 "the whole mechanism still runs, with host-to-host copies")
    bar = comfy.utils.ProgressBar(len(blocks))
    handle = apply_group_offload(
        model, blocks, device,
        offload_device="cpu",
        blocks_per_group=settings.blocks_per_group,
        prefetch=settings.prefetch,
        fill=fill,
        pinner=ComfyPinner(),
        progress=lambda done, total: bar.update_absolute(done, total),
    )
    _guard_against_plain_patchers(model)
    return handle


def make_offloaded(model: ModelPatcher, settings: OffloadSettings) -> GroupOffloadPatcher:
    """A clone of ``model`` that offloads its blocks; the input stays as it was."""
    settings.validate()
    check_offloadable(find_blocks(model.model.diffusion_model))  # fail now, in this node, not in the sampler
    if getattr(model, "is_dynamic", lambda: False)():
        # Dynamic VRAM (comfy-aimdo) pages weights in on its own; the engine needs a plain patcher,
        # which ComfyUI makes by loading the model again through the loader that made this one.
        try:
            clone = model.clone(disable_dynamic=True)
        except RuntimeError as error:
            raise ValueError("Group Offload needs this model without Dynamic VRAM and its loader cannot provide "
                             "that; use Load Diffusion Model (Group Offload), or start ComfyUI with "
                             "--disable-dynamic-vram") from error
    else:
        clone = model.clone()
    clone.__class__ = GroupOffloadPatcher
    clone.offload_settings = settings
    if post_cfg_step not in clone.model_options.get("sampler_post_cfg_function", []):
        clone.set_model_sampler_post_cfg_function(post_cfg_step)  # marks steps for the telemetry
    # A new identity for its weights: ComfyUI then unpatches whatever another clone left on the
    # device before this one loads, instead of taking that state as already loaded.
    clone.patches_uuid = uuid.uuid4()
    return clone

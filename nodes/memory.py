"""How many device bytes the resident groups may use, from ComfyUI's own memory figures.

``plan_blocks`` is the one place that turns the settings and the memory free into a resident budget;
the patcher's ``model_size``, the handle's build and ``load`` all call it. Which groups that budget
keeps resident is the core's rule (``offload_core.plan_residency``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

import comfy.model_management as mm

from ..offload_core import device_footprint, packed_nbytes, plan_residency, split_into_groups
from .settings import OffloadSettings

# ComfyUI's sampler runs cond and uncond as one call only while 1.5 × that call's estimated memory is
# free (``samplers._calc_cond_batch``); with less, each streamed group is copied once per half.
BATCH_ROOM = 1.5

# Base model -> ComfyUI's estimate of the device memory the forwards of its last sampling run hold
# (from the latent's shape: the memory_required that _prepare_sampling passes to load_models_gpu).
RUN_ACTIVATIONS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def inference_reserve(base_model: nn.Module) -> float:
    """Device memory ``auto`` leaves free: the room ComfyUI's sampler asks for before it batches the
    run's conds (``BATCH_ROOM`` × the run's activations) and its extra reserve, never less than its
    minimum inference reserve. Batching comes before residency, as under Dynamic VRAM."""
    activations = BATCH_ROOM * RUN_ACTIVATIONS.get(base_model, 0)
    return max(mm.minimum_inference_memory(), activations + mm.extra_reserved_memory())


def room_on_the_card(base_model: nn.Module, device: torch.device, other_bytes: int) -> float:
    """Before ComfyUI grants anything: the device's whole memory less the inference reserve and the weights
    outside the blocks (``auto`` asks for as much as the card could hold)."""
    return mm.get_total_memory(torch.device(device)) - inference_reserve(base_model) - other_bytes


def room_now(base_model: nn.Module, device: torch.device) -> float:
    """At a load, once the weights outside the blocks are loaded: the device memory really free, less the
    inference reserve."""
    return mm.get_free_memory(device) - inference_reserve(base_model)


def module_bytes(modules: list[nn.Module]) -> int:
    """The bytes the modules' tensors hold (a quantized weight's data and scales, at their own size)."""
    return sum(packed_nbytes(t) for m in modules for t in (*m.parameters(), *m.buffers()))


def raw_group_bytes(blocks: list[nn.Module], blocks_per_group: int) -> list[int]:
    """Each group's bytes before packing (the packed mirrors add alignment)."""
    return [module_bytes(group) for group in split_into_groups(blocks, blocks_per_group)]


@dataclass(frozen=True)
class BlocksPlan:
    """The bytes the resident groups may use, and what the blocks then hold on the device."""

    resident_bytes: int
    group_bytes: tuple[int, ...]
    prefetch: int

    def device_bytes(self) -> int:
        """Resident groups plus the streaming buffers, as the core plans them for ``resident_bytes``."""
        group_bytes = list(self.group_bytes)
        return device_footprint(group_bytes, plan_residency(group_bytes, self.resident_bytes), self.prefetch)


def plan_blocks(settings: OffloadSettings, group_bytes: list[int], free_bytes: float, *, other_bytes: int = 0,
                patch_bytes: int = 0, granted_bytes: float | None = None) -> BlocksPlan:
    """The blocks' resident budget under ``settings``.

    ``free_bytes`` is the device memory the blocks and their patches may take, the inference reserve
    already off (``room_on_the_card`` or ``room_now``): ``auto`` never plans past it. ``granted_bytes``
    is what ComfyUI's ``load_models_gpu`` grants this model's weights after its inference reserve
    (``lowvram_model_memory``); None when it grants all of it (``full_load``, which it also says
    under ``--highvram`` / ``--gpu-only`` whatever the model's size). ``other_bytes`` are the weights
    outside the blocks (always loaded), ``patch_bytes`` what the blocks' LoRA holds on the device.
    """
    every_group_streamed = [False] * len(group_bytes)
    slabs = device_footprint(group_bytes, every_group_streamed, settings.prefetch)  # room any budget must leave
    if settings.residency == "stream_all":
        resident_bytes = 0
    elif settings.residency == "budget":
        resident_bytes = settings.resident_bytes()
    else:
        room = free_bytes - slabs - patch_bytes
        granted = room if granted_bytes is None else min(granted_bytes - other_bytes - slabs - patch_bytes, room)
        resident_bytes = max(0, int(granted))
    return BlocksPlan(resident_bytes, tuple(group_bytes), settings.prefetch)

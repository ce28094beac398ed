"""How many device bytes the resident groups may use, from ComfyUI's own memory figures; and how many host
bytes the packed host copies may use.

``plan_blocks`` is the one place that turns the settings and the memory free into a resident budget;
the patcher's ``model_size``, the handle's build and ``load`` all call it. Which groups that budget
keeps resident is the core's rule (``offload_core.plan_residency``). ``host_budget`` is the one place
that turns the settings and the host memory available into a host budget, once, when the handle is built:
the RAM available and a container's limit (its memory cgroup's), whichever is tighter; ``page_cache_room``
gives the groups left in place their page cache at each run.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch
from torch import nn

import comfy.model_management as mm

from ..offload_core import (FileMappings, GroupOffloadHandle, device_footprint, flatten, packed_nbytes, plan_residency,
                            split_into_groups)
from ..offload_core.hostlimits import cgroup_limits
from .model_state import state_of
from .settings import GB, OffloadSettings

# ComfyUI's sampler runs cond and uncond as one call only while 1.5 × that call's estimated memory is
# free (``samplers._calc_cond_batch``); with less, each streamed group is copied once per half.
BATCH_ROOM = 1.5


def run_activations(base_model: nn.Module) -> int:
    """ComfyUI's estimate of the device memory the forwards of ``base_model``'s last sampling run hold (from the
    latent's shape: the memory_required that _prepare_sampling passes to load_models_gpu); 0 before any run."""
    return state_of(base_model).run_activations or 0


def inference_reserve(base_model: nn.Module) -> float:
    """Device memory ``auto`` leaves free: the room ComfyUI's sampler asks for before it batches the
    run's conds (``BATCH_ROOM`` × the run's activations) and its extra reserve, never less than its
    minimum inference reserve. Batching comes before residency, as under Dynamic VRAM."""
    activations = BATCH_ROOM * run_activations(base_model)
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


# --- host memory ----------------------------------------------------------------------------------

# The RAM ``host_memory = auto`` leaves free beside the packed host copies, for what comes after the model
# is built: the text encoder ComfyUI loads for the prompt (Qwen-Image's is 9 GB in fp8), the VAE, the
# latents and images, the OS, and the page cache that groups left in place are read through (what it holds
# of the model file is read at RAM speed rather than the disk's). A share of RAM, so that it grows with the
# models a machine runs, and at least 4 GB on a small one: 4.8 GB of 32 GB, 9.6 GB of 64 GB, 19 GB of 128 GB.
HOST_HEADROOM_MIN = 4 * GB
HOST_HEADROOM_SHARE = 0.15


def pinning_enabled() -> bool:
    """False under ``--cpu`` or ``--disable-pinned-memory``, where ComfyUI pins nothing."""
    return mm.MAX_PINNED_MEMORY > 0


def host_headroom(total_bytes: int) -> int:
    """The RAM ``auto`` leaves to the rest of the machine, out of ``total_bytes``."""
    return max(HOST_HEADROOM_MIN, int(HOST_HEADROOM_SHARE * total_bytes))


def anonymous_host_bytes(blocks: list[nn.Module]) -> int:
    """Host memory the blocks' tensors hold outside file mappings (ComfyUI's own tensors, on the node's path on
    ComfyUI 0.3.75): packing a group lets its tensors go, so these bytes cost packed host copies nothing."""
    mappings = FileMappings()
    storages: dict[int, int] = {}
    for module in blocks:
        for tensor in (*module.parameters(), *module.buffers()):
            for part in flatten(tensor)[1]:  # a quantized weight's data and scales
                if part.device.type == "cpu" and mappings.find(part) is None:
                    storage = part.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class HostRoom:
    """Host memory this process may take, and the limit that says so (the readout names it)."""

    bytes: int
    bound_by: str


RAM_AVAILABLE = "RAM available"
PINNED_LIMIT = "ComfyUI's pinned-memory limit"


def host_limits() -> list[tuple[HostRoom, int]]:
    """Under each limit this process has, what it may still take of host memory (before any headroom) and the
    limit's whole size: the RAM available (``psutil``) and each memory cgroup's room (a container's limit, which
    ``psutil`` does not see)."""
    memory = psutil.virtual_memory()
    return [(HostRoom(int(memory.available), RAM_AVAILABLE), int(memory.total)),
            *((HostRoom(limit.room, limit.name), limit.limit) for limit in cgroup_limits())]


def auto_host_room(freed_by_packing: int) -> HostRoom:
    """What ``host_memory = auto`` may pack now, and the limit that bound it: under each limit the process has
    (``host_limits``), its room less ``host_headroom`` of its size, plus what packing frees
    (``anonymous_host_bytes``); and no more than ComfyUI's pinned-memory limit where it pins (a packed copy past
    it could never be pinned). What other models hold pinned does not count: the model that runs takes their
    pins (``handles._make_pin_room``). Never below 0."""
    tightest = _tightest_room(freed_by_packing)
    return HostRoom(max(0, tightest.bytes), tightest.bound_by)


def _tightest_room(freed_by_packing: int) -> HostRoom:
    """``auto_host_room`` before it is held at 0 (below 0: that much short already)."""
    rooms = [HostRoom(room.bytes - host_headroom(total) + freed_by_packing, room.bound_by)
             for room, total in host_limits()]
    if pinning_enabled():
        rooms.append(HostRoom(int(mm.MAX_PINNED_MEMORY), PINNED_LIMIT))
    tightest = min(rooms, key=lambda room: room.bytes)
    return HostRoom(int(tightest.bytes), tightest.bound_by)


@dataclass(frozen=True)
class HostBudget:
    """The packed host copies a model may hold (None: all of it fits), what set it, and how many bytes of it the
    text encoders' packed copies give up first (``handles.take_text_encoders_packing``)."""

    bytes: int | None
    bound_by: str
    taken_from_text_encoders: int = 0


#: The limit the readout names for a text encoder whose packed copies went to the diffusion model's host budget.
GIVEN_TO_THE_DIFFUSION_MODEL = "the diffusion model (given up for its host budget)"


def host_budget(settings: OffloadSettings, block_bytes: int, *, packed_elsewhere: int, freed_by_packing: int,
                givable: int = 0) -> HostBudget:
    """The packed host copies a model about to be built may hold, in bytes (``apply_group_offload``'s
    ``host_budget``); None when all ``block_bytes`` fit, which packs every group as before host budgets.

    ``auto``: ``auto_host_room(freed_by_packing)``. ``budget``: ``host_gb``, one budget for every offloaded
    model, less what the others already hold packed (``packed_elsewhere``). ``givable``: the packed bytes of
    others that are the first given up for this model (a diffusion model's build: the text encoders' packed
    copies that can stream from their files instead, ``GroupOffloadHandle.returnable_bytes``); they count as
    room, and ``taken_from_text_encoders`` says how much of them the budget needs.
    """
    without = _room(settings, packed_elsewhere, freed_by_packing)
    room = _room(settings, packed_elsewhere - givable, freed_by_packing + givable)
    room_bytes = max(0, room.bytes)
    taken = min(givable, max(0, min(block_bytes, room_bytes) - without.bytes))
    return HostBudget(None if block_bytes <= room_bytes else room_bytes, room.bound_by, taken)


def _room(settings: OffloadSettings, packed_elsewhere: int, freed_by_packing: int) -> HostRoom:
    """``host_budget``'s room, not held at 0."""
    if settings.host_memory == "budget":
        return HostRoom(settings.host_bytes() - packed_elsewhere, "host_gb")
    return _tightest_room(freed_by_packing)


def page_cache_room(handle: GroupOffloadHandle, base_model: nn.Module) -> HostRoom:
    """The page cache the groups a run gathers in place may hold (``GroupOffloadHandle.keep_cached``), as the run
    starts: the least room under the process's limits (``host_limits``; the page cache counts as room, the kernel
    reclaims it first), less what the run is yet to add to anonymous memory where ComfyUI computes on the CPU: the
    streaming buffers it has not made yet and the activations (ComfyUI's estimate for the run). An expectation, not
    a bound: a room too large costs reads from the disk (the kernel drops cached pages for the run), never a kill."""
    tightest = min((room for room, _ in host_limits()), key=lambda room: room.bytes)
    to_come = 0
    if handle.config.onload_device.type == "cpu":
        to_come = max(0, handle.device_bytes_needed() - handle.stats()["slab_bytes"])
        to_come += run_activations(base_model)
    return HostRoom(max(0, tightest.bytes - to_come), tightest.bound_by)

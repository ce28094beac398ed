"""``GroupOffloadPatcher``: a ModelPatcher whose diffusion blocks stream from pinned host mirrors.

ComfyUI's memory manager keeps working as it does for every model; only these of its questions get
different answers:

- ``model_size``  the device footprint this model asks for: the weights outside the blocks, plus the
  resident groups and streaming slabs it plans for (``auto`` plans against the device's whole
  memory less the sampling run's activations, so ComfyUI makes room as for any large model). The
  streamed bytes stay in host memory, already pinned, so they are not asked for twice;
- ``load``        ComfyUI loads everything but the blocks its usual way; the blocks get the engine,
  with as many groups resident as the budget ComfyUI grants and the really free memory allow, less
  what the run's activations need (ComfyUI's estimate from the latent's shape, see ``plan_for_run``);
- ``partially_unload`` / ``unpatch_model``  give the engine's device memory back first;
- ``detach``      (unload) gives the device memory back and keeps the engine: its packed, pinned host
  mirrors stay, so that loading this model again (two models taking turns) costs only device copies;
- ``pinned_memory_size`` / ``partially_unload_ram``  report and release the pinned host memory.

The offload device is always the CPU (under ``--gpu-only`` / ``--highvram`` ComfyUI's is the GPU),
so ComfyUI never moves the blocks onto the device whole. A plain clone of the same model (the node
bypassed, say) must find plain modules: a guard on the diffusion model takes the engine off when
such a patcher runs it. When the last GroupOffloadPatcher of a model is garbage-collected, the
engine, its host mirrors and its pins go with it (see ``_own_engine``).

Two of ComfyUI's wrappers on the patcher keep a sampling run from running out of GPU memory part-way:
``PREPARE_SAMPLING`` (before ComfyUI loads the model for a run) has ``auto`` plan for that run's
activations, and ``APPLY_MODEL`` runs a whole diffusion-model call again, with less of the model on
the GPU, when it runs out (``offload_core.call_backing_off``): a group's forward cannot be resumed
part-way, and the same call computes the same output. The fallback holds for the rest of the run.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import sys
import uuid
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension
import comfy.sampler_helpers
import comfy.utils
from comfy.model_patcher import ModelPatcher, get_key_weight
from comfy.weight_adapter import WeightAdapterBase

from ..offload_core import (GroupOffloadHandle, UnpackableTensorError, apply_group_offload, call_backing_off,
                            check_offloadable, device_footprint, format_bytes, handle_of, packed_nbytes,
                            plan_residency)
from .blocks import block_entry_methods, block_list_owners, block_list_paths, find_blocks
from .memory import OffloadSettings, resident_budget
from .telemetry import finish_run, post_cfg_step, start_run

log = logging.getLogger(__name__)

# Newest ComfyUI computes LoRA in a per-device dtype (fp16 where it is fast); 0.3.75 in float32.
_lora_dtype: Callable[[torch.device], torch.dtype] = getattr(mm, "lora_compute_dtype", lambda device: torch.float32)
# The seed of a patched weight's stochastic rounding, from its key. Newest ComfyUI moved it to comfy.utils
# and logs a warning from the old name at every call; 0.3.75 has only the old name.
_string_to_seed: Callable[[str], int] = (getattr(comfy.utils, "string_to_seed", None)
                                         or comfy.model_patcher.string_to_seed)
# Computing a patched weight holds about this many temporaries of the weight's size in the LoRA dtype.
_PATCH_TEMPORARIES = 3
_cpu_notice_given = False


class ComfyPinner:
    """Pins the mirrors of one diffusion model through ComfyUI's ``pin_memory``, so that its
    pinned-memory total and limit count them.

    ComfyUI 0.3.75 pins only tensors whose type is named ``Parameter`` (or ``QuantizedTensor``); a
    mirror is handed over as a Parameter over the same storage, which ComfyUI registers in place.
    ComfyUI's limit (``MAX_PINNED_MEMORY``) is kept here: newest ComfyUI's ``pin_memory`` registers
    past it once it has evicted what it can of its own. Past the limit, other offloaded models give
    their pins up first (see ``_make_pin_room``); what still does not fit stays in pageable memory.
    """

    def __init__(self, owner: nn.Module) -> None:
        self._owner = weakref.ref(owner)

    @staticmethod
    def enabled() -> bool:
        """False under ``--cpu`` or ``--disable-pinned-memory``, where ComfyUI pins nothing."""
        return mm.MAX_PINNED_MEMORY > 0

    def pin(self, buffer: torch.Tensor) -> bool:
        return _make_pin_room(buffer.nbytes, keep=self._owner()) and bool(
            mm.pin_memory(nn.Parameter(buffer, requires_grad=False)))

    def unpin(self, buffer: torch.Tensor) -> None:
        mm.unpin_memory(buffer)


def _warn_if_unpinned(handle: GroupOffloadHandle) -> None:
    """One warning per load when some streamed groups copy from pageable memory."""
    streamed = [g for g in handle.groups if not g.resident]
    pinned = [g for g in streamed if g.mirror.pinned]
    if len(pinned) == len(streamed) or not ComfyPinner.enabled():
        return
    log.warning("Group Offload: %d of %d streamed groups are pinned (%s of %s); ComfyUI's pinned-memory limit is %s, "
                "%s of it in use. The others stream from pageable memory, with slower copies: unload other models, "
                "load the model as fp8, or set residency to keep more groups on the GPU",
                len(pinned), len(streamed), format_bytes(sum(g.nbytes for g in pinned)),
                format_bytes(sum(g.nbytes for g in streamed)), format_bytes(mm.MAX_PINNED_MEMORY),
                format_bytes(mm.TOTAL_PINNED_MEMORY))


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
    """The bytes the modules' tensors hold (a quantized weight's data and scales, at their own size)."""
    return sum(packed_nbytes(t) for m in modules for t in (*m.parameters(), *m.buffers()))


def _slab_bytes(group_bytes: list[int], prefetch: int) -> int:
    """The streaming buffers alone, as with every group streamed: room a resident budget must leave."""
    return device_footprint(group_bytes, [False] * len(group_bytes), prefetch)


def _raw_group_bytes(blocks: list[nn.Module], blocks_per_group: int) -> list[int]:
    """Each group's bytes before packing (the packed mirrors add alignment)."""
    return [_module_bytes(blocks[i : i + blocks_per_group]) for i in range(0, len(blocks), blocks_per_group)]


class GroupOffloadPatcher(ModelPatcher):
    offload_settings: OffloadSettings

    def clone(self, *args, **kwargs) -> "GroupOffloadPatcher":
        if kwargs.get("force_deepcopy") and getattr(self, "cached_patcher_init", None) is None:
            raise ValueError("This offloaded model cannot be deep-copied: the loader that made it cannot load it "
                             "again; load it with Load Diffusion Model or Load Diffusion Model (Group Offload)")
        clone = super().clone(*args, **kwargs)
        clone.offload_settings = self.offload_settings
        _own_engine(clone)
        return clone

    # --- what ComfyUI asks --------------------------------------------------------------------

    def model_size(self) -> int:
        blocks = self.blocks()
        if not blocks:  # ComfyUI's own load is running, with the blocks hidden
            return mm.module_size(self.model)
        other_bytes = mm.module_size(self.model) - _module_bytes(blocks)
        patch_bytes = BlockPatches.device_bytes_for(self.model, self._block_patches(), self.load_device)
        group_bytes = self._group_bytes(blocks)
        wanted = _wanted_resident_bytes(self.offload_settings, self.load_device, other_bytes + patch_bytes, group_bytes,
                                        _inference_reserve(self.model))
        return other_bytes + patch_bytes + device_footprint(group_bytes, plan_residency(group_bytes, wanted),
                                                            self.offload_settings.prefetch)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        with _blocks_hidden(self.model.diffusion_model):
            super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                         force_patch_weights=force_patch_weights, full_load=True)
        other_bytes = mm.module_size(self.model) - _module_bytes(self.blocks())
        handle = self.engine(device_to)
        # The last load's device memory, its patch tensors too, goes back first: the free figure counts it as free.
        handle.set_onload_patch(None)
        free = mm.get_free_memory(device_to) - _inference_reserve(self.model)
        patches = BlockPatches(self.model, self._block_patches(), handle.config.onload_device)
        slabs = _slab_bytes([g.nbytes for g in handle.groups], handle.config.prefetch)
        handle.set_resident_bytes(resident_budget(self.offload_settings, lowvram_model_memory, full_load,
                                                  other_bytes, slabs + patches.device_bytes, free))
        _warn_if_unpinned(handle)
        handle.set_onload_patch(patches, patches.keys(), device_bytes=patches.device_bytes)
        handle.onload_resident()
        self.model.model_loaded_weight_memory = other_bytes + handle.device_bytes_needed()
        self.model.model_lowvram = False
        stats = handle.stats()
        log.info("Group Offload: %d of %d groups resident (%.2f GB), %.2f GB streamed per pass (%.2f GB pinned, "
                 "%.1f s spent pinning so far), prefetch %d", stats["resident_groups"], stats["groups"],
                 stats["resident_bytes"] / 1e9, stats["streamed_bytes_per_pass"] / 1e9, stats["pinned_bytes"] / 1e9,
                 stats["pin_seconds"], handle.config.prefetch)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self._release_engine_memory()
        if freed < memory_to_free:
            freed += super().partially_unload(device_to, memory_to_free - freed, force_patch_weights=force_patch_weights)
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if not unpatch_weights:
            return super().unpatch_model(device_to, unpatch_weights)
        self._release_engine_memory()
        # ComfyUI restores the patched weights, then moves the whole model to ``device_to``. The blocks
        # are the engine's to place, and a quantized layer's ``.to()`` would give it a new Parameter,
        # which the engine no longer re-points: the move happens here, without them.
        super().unpatch_model(None, unpatch_weights)
        if device_to is not None:
            with _blocks_hidden(self.model.diffusion_model):
                self.model.to(device_to)
            self.model.device = device_to

    def detach(self, unpatch_all=True):
        # Unloading (``unpatch_all``) gives the engine's device memory back (``unpatch_model``) and
        # keeps the engine, packed and pinned: loading this model again, as when two offloaded
        # models take turns, costs only device copies. ``unpatch_all=False`` comes before every
        # sampling run (load_models_gpu detaches the requested model itself, or a clone about to
        # take over): park the engine, so that a plain clone finds pristine host weights and this
        # one takes its device copies up again for free.
        model = super().detach(unpatch_all)
        handle = self.current_engine()
        if not unpatch_all and handle is not None and getattr(self.model, "current_patcher", None) in (None, self):
            handle.park()  # (a stale clone being garbage-collected detaches too: it must not park a running engine)
        return model

    def pinned_memory_size(self) -> int:
        """Host memory the engine holds page-locked (newest ComfyUI asks every model)."""
        handle = self.current_engine()
        return 0 if handle is None else handle.stats()["pinned_bytes"]

    def partially_unload_ram(self, ram_to_unload, subsets=None) -> int:
        """Give the pinned host memory back under memory pressure; the next load pins it again."""
        handle = self.current_engine()
        return 0 if handle is None else handle.unpin()

    def pre_run(self):
        super().pre_run()
        _refuse_cuda_graphs(self.model_options)
        handle = self.current_engine()
        _LAST_RUN[self.model.diffusion_model] = next(_runs_started)
        if handle is not None:
            handle.pin_streamed()  # takes back, from the models run longer ago, pins given up while this one waited
            start_run(self.model.diffusion_model, handle, self.offload_settings.node_id,
                      cpu_only=torch.device(self.load_device).type == "cpu")

    def cleanup(self):
        _log_back_offs(finish_run(self.model.diffusion_model))
        super().cleanup()

    def plan_for_run(self, activation_bytes: int) -> None:
        """Before ComfyUI loads this model for a sampling run: ``auto`` plans for ``activation_bytes``
        of activations (ComfyUI's estimate for the run). The plan in effect is made again when the run
        needs other room than the last one (its latent may be smaller) or the last run backed off."""
        handle = self.current_engine()
        backed_off = handle is not None and handle.backed_off
        replan = self.offload_settings.residency == "auto" and _RUN_ACTIVATIONS.get(self.model) != activation_bytes
        _RUN_ACTIVATIONS[self.model] = activation_bytes
        if backed_off or replan:
            self._release_engine_memory()
            self.model.model_lowvram = True  # so that load_models_gpu calls load(), which plans for this run

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
        built_for = None if handle is None else (handle.config.blocks_per_group, handle.config.prefetch,
                                                 handle.config.onload_device)
        if handle is not None and built_for != (settings.blocks_per_group, settings.prefetch, torch.device(device)):
            remove_engine(self.model)  # the new engine adopts the packed host buffers as they are
            handle = None
        if handle is None:
            handle = build_engine(self.model, self.blocks(), device, settings)
        return handle

    def _release_engine_memory(self) -> int:
        handle = self.current_engine()
        if handle is None or not handle.holds_device_memory():
            return 0
        held = handle.device_bytes_needed()
        handle.set_onload_patch(None)  # gives the device memory back, the patch's own too; load() sets it again
        self.model.model_loaded_weight_memory = max(0, self.model.model_loaded_weight_memory - held)
        self.model.model_lowvram = True  # so that the next load_models_gpu calls load() again
        return held

    def _group_bytes(self, blocks: list[nn.Module]) -> list[int]:
        handle = handle_of(blocks[0])
        if handle is not None:
            return [g.nbytes for g in handle.groups]
        return _raw_group_bytes(blocks, self.offload_settings.blocks_per_group)

    def _block_patches(self) -> dict[str, list]:
        """This patcher's weight patches (LoRA...) of block weights; ComfyUI's own load patches the rest."""
        prefixes = tuple(f"diffusion_model.{path}." for path in block_list_paths(self.model.diffusion_model))
        return {key: patches for key, patches in self.patches.items() if key.startswith(prefixes)}


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a ComfyUI weight patch, or part of one) with ``fn`` applied to every tensor in it."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, WeightAdapterBase):
        mapped = copy.copy(value)
        mapped.weights = _map_tensors(value.weights, fn)
        return mapped
    if isinstance(value, tuple):
        return tuple(_map_tensors(item, fn) for item in value)
    if isinstance(value, list):
        return [_map_tensors(item, fn) for item in value]
    return value


class BlockPatches:
    """The blocks' weight patches (LoRA...) for one load, applied on the device to each fresh copy.

    Their tensors are moved to the device once, here, instead of at every onload. No patcher is held:
    ComfyUI runs a clone with the same ``patches_uuid`` (ModelSamplingAuraFlow after the loader, say)
    on the weights this load patched, without loading again, and the clone that loaded may be gone by
    then; a clone with other patches makes ComfyUI unpatch and load again.
    """

    def __init__(self, model: nn.Module, patches: dict[str, list], device: torch.device) -> None:
        self._model = weakref.ref(model)  # the engine lives on the model: no reference cycle through it
        self._patches = {key: _map_tensors(p, lambda t: t.to(device)) for key, p in patches.items()}
        self.device_bytes = self.device_bytes_for(model, self._patches, device)

    @staticmethod
    def device_bytes_for(model: nn.Module, patches: dict[str, list], device: torch.device) -> int:
        """Device memory for ``patches``: their tensors, and the temporaries of the largest patched weight."""
        tensors: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            tensors.append(tensor)
            return tensor

        _map_tensors(list(patches.values()), collect)
        largest = max((comfy.utils.get_attr(model, key).numel() for key in patches), default=0)
        return sum(t.nbytes for t in tensors) + _PATCH_TEMPORARIES * largest * _lora_dtype(device).itemsize

    def keys(self) -> list[str]:
        return list(self._patches)

    def __call__(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` patched exactly as ComfyUI's own load patches it."""
        _, set_func, convert_func = get_key_weight(self._model(), key)
        temp = mm.cast_to_device(weight, weight.device, _lora_dtype(weight.device), copy=True)
        if convert_func is not None:  # a quantized weight: dequantized
            temp = convert_func(temp, inplace=True)
        out = comfy.lora.calculate_weight(self._patches[key], temp, key)
        seed = _string_to_seed(key)
        if set_func is not None:  # its layer's own way back (a quantized weight: quantized again)
            return set_func(out, inplace_update=False, seed=seed, return_weight=True)
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=seed)


_GUARDS: "weakref.WeakKeyDictionary[nn.Module, list[torch.utils.hooks.RemovableHandle]]" = weakref.WeakKeyDictionary()
# Base model -> the engine on its blocks, found even while a wrapper around the one that backs off has
# swapped the diffusion model or its blocks for compiled ones (TorchCompileModel, per-block compiles).
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[GroupOffloadHandle]]" = weakref.WeakKeyDictionary()


def _guard(base_model: nn.Module, handle: GroupOffloadHandle) -> None:
    """Hooks on the diffusion model: the engine goes when a plain ModelPatcher drives it, and its first
    forward must run blocks through the engine."""
    diffusion_model = base_model.diffusion_model
    for hook in _GUARDS.pop(diffusion_model, []):
        hook.remove()
    model_ref, handle_ref = weakref.ref(base_model), weakref.ref(handle)

    def check_patcher(module, args):
        patcher = getattr(model_ref(), "current_patcher", None)
        if patcher is not None and not isinstance(patcher, GroupOffloadPatcher):
            log.info("Group Offload: a plain patcher runs this model now; removing the offload hooks")
            remove_engine(model_ref())

    checked = False

    @torch.compiler.disable
    def check_blocks_ran(module, args, output):
        nonlocal checked
        engine = handle_ref()
        if checked or engine is None:
            return
        checked = True
        if engine.stats()["hook_calls"]:
            return
        ran = (f"Group Offload: {type(module).__name__} ran without running any of its blocks through "
               f"{' / '.join(engine.config.entry_methods)}")
        if output is not None:
            raise RuntimeError(f"{ran}, so they computed from host memory instead of streaming; it runs them some "
                               f"other way: connect the model to the sampler without Group Offload")
        error = sys.exc_info()[1]  # the forward raised: this hook runs while it propagates
        if error is not None:
            error.add_note(f"{ran} before this error. If it is a device mismatch, the model runs its blocks some "
                           f"other way, which Group Offload cannot stream: connect it to the sampler without it.")

    _ENGINES[base_model] = handle_ref
    _GUARDS[diffusion_model] = [diffusion_model.register_forward_pre_hook(check_patcher),
                                diffusion_model.register_forward_hook(check_blocks_ran, always_call=True)]


# torch.compile settings that replay CUDA graphs (ComfyUI keeps TorchCompileModel's under this key).
_CUDA_GRAPH_BACKENDS = {"cudagraphs"}
_CUDA_GRAPH_MODES = {"reduce-overhead", "max-autotune"}


def _refuse_cuda_graphs(model_options: dict[str, Any]) -> None:
    """A CUDA graph replays the weight addresses it recorded, and a streamed group lands in whichever
    buffer is free: every step would record again (or read another group's weights)."""
    compiled = model_options.get("torch_compile_kwargs") or {}
    backend, mode = compiled.get("backend"), compiled.get("mode")
    setting = (f"backend {backend!r}" if backend in _CUDA_GRAPH_BACKENDS
               else f"mode {mode!r}" if mode in _CUDA_GRAPH_MODES else None)
    if setting is not None:
        raise ValueError(f"Group Offload cannot run a model compiled with CUDA graphs (TorchCompileModel's {setting}): "
                         "a graph replays the addresses of the weights it recorded, and streamed blocks move between "
                         "buffers at every step; use the inductor backend")


# Diffusion model -> when its engine last started a sampling run (a counter): the least recent gives its pins up first.
_LAST_RUN: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_runs_started = itertools.count(1)


def _make_pin_room(nbytes: int, keep: nn.Module | None) -> bool:
    """Whether ``nbytes`` more fit ComfyUI's pinned-memory limit, once ComfyUI has evicted what it evicts
    of its own (newest) and other offloaded models gave up pins: those ComfyUI has unloaded first, then
    the least recently run, never ``keep``."""
    ensure_registerable = getattr(mm, "ensure_pin_registerable", None)
    if ensure_registerable is not None:
        ensure_registerable(nbytes)
    for handle in _engines_giving_pins_first(keep):
        if _pin_shortfall(nbytes) <= 0:
            break
        handle.unpin(at_least=_pin_shortfall(nbytes))
    return _pin_shortfall(nbytes) <= 0


def _pin_shortfall(nbytes: int) -> int:
    """Bytes past ComfyUI's limit if ``nbytes`` more were pinned (ComfyUI's own count: every pin, not only ours)."""
    return mm.TOTAL_PINNED_MEMORY + nbytes - mm.MAX_PINNED_MEMORY


def _engines_giving_pins_first(keep: nn.Module | None) -> list[GroupOffloadHandle]:
    loaded = {id(getattr(m.model.model, "diffusion_model", None)) for m in mm.current_loaded_models if m.model is not None}
    others = [m for m in list(_GUARDS) if m is not keep]  # every other diffusion model with an engine
    others.sort(key=lambda m: (id(m) in loaded, _LAST_RUN.get(m, 0)))
    handles = [handle_of(find_blocks(m)[0]) for m in others]
    return [h for h in handles if h is not None]


# Base model -> how many GroupOffloadPatchers (the node's clone and every clone of it) can drive its engine.
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def _own_engine(patcher: GroupOffloadPatcher) -> None:
    """Remove the engine once the last GroupOffloadPatcher of its model is garbage-collected.

    The model may outlive them all (the plain patcher it was cloned from stays in ComfyUI's cache, and
    ComfyUI then unloads that one in their place); nothing would ever give the engine's device copies
    and pinned memory back otherwise. The callback holds the model, which the patcher holds anyway: so
    it lives no longer for it, and is still there to unpin when both go in one garbage collection.
    """
    model = patcher.model
    _OWNERS[model] = _OWNERS.get(model, 0) + 1
    weakref.finalize(patcher, _disown_engine, model).atexit = False


def _disown_engine(model: nn.Module) -> None:
    owners = _OWNERS.pop(model, 1) - 1
    if owners:
        _OWNERS[model] = owners
    else:
        remove_engine(model)


def remove_engine(base_model: nn.Module) -> None:
    """Hooks and pinned memory gone; the weights stay, as ordinary host memory."""
    blocks = find_blocks(base_model.diffusion_model)
    handle = handle_of(blocks[0]) if blocks else None
    if handle is not None:
        handle.remove()
    for hook in _GUARDS.pop(base_model.diffusion_model, []):
        hook.remove()
    _ENGINES.pop(base_model, None)


# Base model -> ComfyUI's estimate of the device memory the forwards of its last sampling run hold
# (from the latent's shape: the memory_required that _prepare_sampling passes to load_models_gpu).
_RUN_ACTIVATIONS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


# ComfyUI's sampler runs cond and uncond as one call only while 1.5 × that call's estimated memory is
# free (``samplers._calc_cond_batch``); with less, each streamed group is copied once per half.
BATCH_ROOM = 1.5


def _inference_reserve(base_model: nn.Module) -> float:
    """Device memory ``auto`` leaves free: the room ComfyUI's sampler asks for before it batches the
    run's conds (``BATCH_ROOM`` × the run's activations) and its extra reserve, never less than its
    minimum inference reserve. Batching comes before residency, as under Dynamic VRAM."""
    activations = BATCH_ROOM * _RUN_ACTIVATIONS.get(base_model, 0)
    return max(mm.minimum_inference_memory(), activations + mm.extra_reserved_memory())


def _plan_for_the_run(executor, patcher: GroupOffloadPatcher, noise_shape, conds, *args, **kwargs):
    """ComfyUI's ``PREPARE_SAMPLING`` wrapper: before ComfyUI loads the model, the patcher learns the
    activations of this run as ComfyUI estimates them for ``load_models_gpu`` (the same call)."""
    patcher.plan_for_run(int(comfy.sampler_helpers.estimate_memory(patcher, noise_shape, conds)[0]))
    return executor(patcher, noise_shape, conds, *args, **kwargs)


def _apply_model_backing_off(executor, *args, **kwargs):
    """ComfyUI's ``APPLY_MODEL`` wrapper: the whole diffusion-model call (only this model's) runs again,
    with less of the model on the GPU, each time it runs out of GPU memory."""
    base_model = executor.class_obj
    handle = _ENGINES[base_model]()  # (``load`` built it before any forward)
    return call_backing_off(handle, lambda: executor(*args, **kwargs), advice=lambda: _what_would_fit(base_model, handle))


def _what_would_fit(base_model: nn.Module, handle: GroupOffloadHandle) -> str:
    """The end of the error once no fallback is left: what the model holds on the GPU then, and the room
    this run's activations would need beside it."""
    other_weights = mm.module_size(base_model) - handle.stats()["host_bytes"]
    held = handle.residency().device_bytes + other_weights
    total = mm.get_total_memory(handle.config.onload_device)
    room = total - held - mm.extra_reserved_memory()
    activations = _RUN_ACTIVATIONS.get(base_model, 0)
    if activations > room > 0:
        fits = (f"so a latent of about {room / activations:.0%} of this one's size would fit: lower the resolution, "
                f"the frame count or the batch size")
    else:
        fits = "which would fit: other models or programs hold the rest of the GPU's memory; unload them"
    buffer = (f"; with prefetch 0 the model needs one streaming buffer "
              f"({format_bytes(max(g.nbytes for g in handle.groups))}) less") if handle.prefetch else ""
    return (f"At the last plan the model held {format_bytes(held)} of the GPU's {format_bytes(total)}; ComfyUI "
            f"estimates this run's activations at {format_bytes(activations)}, {fits}{buffer}.")


def _log_back_offs(run: dict[str, Any] | None) -> None:
    """One line for a sampling run that ran out of GPU memory and backed off."""
    if run is None or not run["back_offs"]:
        return
    log.warning("Group Offload: the GPU ran out of memory in this sampling run; the model call ran again with less "
                "of the model on the GPU, %d time(s), down to %d of %d groups resident with prefetch %d. The next run "
                "plans afresh; should this happen at every run, use residency budget with a smaller resident_gb",
                run["back_offs"], run["resident_groups"], run["groups"], run["prefetch"])


def _wanted_resident_bytes(settings: OffloadSettings, device: torch.device, other_bytes: int,
                           group_bytes: list[int], reserve: float) -> int:
    """The resident budget asked for before ComfyUI grants one: ``auto`` plans against the device's
    whole memory less ``reserve`` (``_inference_reserve``), as much as the card could hold."""
    capacity = mm.get_total_memory(torch.device(device)) - reserve
    slabs = _slab_bytes(group_bytes, settings.prefetch)
    return resident_budget(settings, 0, True, other_bytes, slabs, capacity - other_bytes)


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


def build_engine(model: nn.Module, blocks: list[nn.Module], device: torch.device, settings: OffloadSettings,
                 fill=None) -> GroupOffloadHandle:
    """Pack the blocks into host mirrors (with a ComfyUI progress bar), pin the ones planned to
    stream, and hook them."""
    global _cpu_notice_given
    if torch.device(device).type == "cpu" and not _cpu_notice_given:
        _cpu_notice_given = True
        log.info("Group Offload: ComfyUI runs on the CPU, so offloading brings nothing here; "
                 "the whole mechanism still runs, with host-to-host copies")
    _cast_to_model_dtypes(blocks)
    bar = comfy.utils.ProgressBar(len(blocks))
    other_bytes = mm.module_size(model) - _module_bytes(blocks)
    group_bytes = _raw_group_bytes(blocks, settings.blocks_per_group)
    handle = apply_group_offload(
        model, blocks, device,
        offload_device="cpu",
        blocks_per_group=settings.blocks_per_group,
        prefetch=settings.prefetch,
        resident_bytes=_wanted_resident_bytes(settings, device, other_bytes, group_bytes,  # so it pins what will stream
                                              _inference_reserve(model)),
        pin_memory=ComfyPinner.enabled(),
        entry_methods=block_entry_methods(model.diffusion_model),
        fill=fill,
        pinner=ComfyPinner(model.diffusion_model),
        progress=lambda done, total: bar.update_absolute(done, total),
    )
    _guard(model, handle)
    return handle


# Dynamic model (shared by all its clones) -> its non-dynamic twin, as ``clone(model_override=...)`` takes it.
_NON_DYNAMIC_TWINS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _non_dynamic_clone(model: ModelPatcher) -> ModelPatcher:
    """A plain clone of a Dynamic VRAM (comfy-aimdo) patcher, whose weights the engine can pack.

    ComfyUI makes one by loading the model again through the loader that made it; the weights it
    loads are kept for every later clone of the same model (as ComfyUI's ``get_non_dynamic_delegate``
    does for one patcher), so that host memory holds them once however often the node runs.
    """
    try:
        clone = model.clone(disable_dynamic=True, model_override=_NON_DYNAMIC_TWINS.get(model.model))
    except RuntimeError as error:
        raise ValueError("Group Offload needs this model without Dynamic VRAM and its loader cannot provide "
                         "that; use Load Diffusion Model (Group Offload), or start ComfyUI with "
                         "--disable-dynamic-vram") from error
    _NON_DYNAMIC_TWINS[model.model] = clone.get_clone_model_override()
    return clone


def _check_offloadable(blocks: list[nn.Module]) -> None:
    try:
        check_offloadable(blocks)
    except UnpackableTensorError as error:
        if error.tensor_type.__name__ != "GGMLTensor":
            raise
        raise ValueError("Group Offload cannot stream GGUF models: ComfyUI-GGUF keeps their weights as GGMLTensor, "
                         "which cannot be rebuilt from packed bytes; use the model's safetensors file (fp8_scaled, "
                         "fp8mixed, bf16...) with Load Diffusion Model (Group Offload)") from error


_WRAPPER_KEY = "group_offload"
_WRAPPERS = {comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING: _plan_for_the_run,
             comfy.patcher_extension.WrappersMP.APPLY_MODEL: _apply_model_backing_off}


def make_offloaded(model: ModelPatcher, settings: OffloadSettings) -> GroupOffloadPatcher:
    """A clone of ``model`` that offloads its blocks; the input stays as it was."""
    settings.validate()
    _check_offloadable(find_blocks(model.model.diffusion_model))  # fail now, in this node, not in the sampler
    clone = _non_dynamic_clone(model) if getattr(model, "is_dynamic", lambda: False)() else model.clone()
    clone.__class__ = GroupOffloadPatcher
    clone.offload_settings = settings
    clone.offload_device = torch.device("cpu")  # ComfyUI's is the GPU under --gpu-only / --highvram
    _own_engine(clone)
    if post_cfg_step not in clone.model_options.get("sampler_post_cfg_function", []):
        clone.set_model_sampler_post_cfg_function(post_cfg_step)  # marks steps for the telemetry
    for kind, wrapper in _WRAPPERS.items():
        clone.remove_wrappers_with_key(kind, _WRAPPER_KEY)  # (once, however often the model was offloaded)
        clone.add_wrapper_with_key(kind, _WRAPPER_KEY, wrapper)
    # A new identity for its weights: ComfyUI then unpatches whatever another clone left on the
    # device before this one loads, instead of taking that state as already loaded.
    clone.patches_uuid = uuid.uuid4()
    return clone

"""``GroupOffloadPatcher``: a ModelPatcher whose diffusion blocks stream from pinned host mirrors.

ComfyUI's memory manager keeps working as it does for every model; only these of its questions get
different answers:

- ``model_size``  the device footprint this model asks for: the weights outside the blocks, plus the
  resident groups and streaming slabs it plans for (``auto`` plans against the device's whole
  memory less the sampling run's activations, so ComfyUI makes room as for any large model). The
  streamed bytes stay in host memory, already pinned, so they are not asked for twice;
- ``load``        ComfyUI loads everything but the blocks its usual way; the blocks get the handle,
  with as many groups resident as the budget ComfyUI grants and the really free memory allow, less
  what the run's activations need (ComfyUI's estimate from the latent's shape, see ``plan_for_run``);
- ``partially_unload`` / ``unpatch_model``  give the handle's device memory back first;
- ``detach``      (unload) gives the device memory back and keeps the handle: its packed, pinned host
  mirrors stay, so that loading this model again (two models taking turns) costs only device copies;
- ``pinned_memory_size`` / ``partially_unload_ram``  report and release the pinned host memory.

The offload device is always the CPU (under ``--gpu-only`` / ``--highvram`` ComfyUI's is the GPU),
so ComfyUI never moves the blocks onto the device whole. A plain clone of the same model (the node
bypassed, say) must find plain modules: a guard on the diffusion model takes the handle off when
such a patcher runs it. When the last GroupOffloadPatcher of a model is garbage-collected, the
handle, its host mirrors and its pins go with it (``handles.own_handle``).

Two of ComfyUI's wrappers on the patcher keep a sampling run from running out of GPU memory part-way:
``PREPARE_SAMPLING`` (before ComfyUI loads the model for a run) has ``auto`` plan for that run's
activations, and ``APPLY_MODEL`` runs a whole diffusion-model call again, with less of the model on
the GPU, when it runs out (``offload_core.call_backing_off``): a group's forward cannot be resumed
part-way, and the same call computes the same output. The fallback holds for the rest of the run.

The rooms beside this one: ``handles.py`` (the handle's life in ComfyUI), ``lora.py`` (patches on the
device), ``memory.py`` (the byte budget), ``settings.py`` (the node's inputs), ``model_state.py`` (what is kept
per model).
"""
from __future__ import annotations

import contextlib
import logging
import uuid
import weakref
from typing import Iterator

import torch
from torch import nn

import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension
from comfy.model_patcher import ModelPatcher

from ..offload_core import GroupOffloadHandle, check_offloadable, format_bytes, handle_of
from .blocks import (block_list_owners, block_list_paths, blocks_owner, carry_owner, find_blocks, is_text_encoder,
                     owner_path, refuse_weight_caches)
from .handles import (build_handle, built_for, host_limit, mark_run_started, own_handle, remove_handle,
                      stop_watching, warn_if_unpinned)
from .lora import BlockPatches, encoded_keys, patch_compute_dtype, patch_encoded
from .memory import module_bytes, page_cache_room, plan_blocks, raw_group_bytes, room_now, room_on_the_card
from .model_state import ModelState, state_of
from .sampling_run import apply_model_backing_off, log_back_offs, plan_for_the_run, refuse_cuda_graphs
from .settings import OffloadSettings
from .telemetry import finish_run, post_cfg_step, start_run

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _blocks_hidden(blocks_owner: nn.Module) -> Iterator[None]:
    """Take the block lists out of the module tree, so ComfyUI's loader sees only the rest."""
    lists = block_list_owners(blocks_owner)
    saved = [(owner, attribute, getattr(owner, attribute)) for owner, attribute in lists]
    try:
        for owner, attribute, blocks in saved:
            setattr(owner, attribute, type(blocks)())  # empty, of the same kind
        yield
    finally:
        for owner, attribute, blocks in saved:
            setattr(owner, attribute, blocks)


class GroupOffloadPatcher(ModelPatcher):
    """A ModelPatcher whose blocks a ``GroupOffloadHandle`` streams; in front of a loader's own patcher class, if
    any (``_offload_class``). Its overrides of ComfyUI's, and what each protects:

    - ``clone``               the settings and the handle's ownership go to every clone; a deep copy only
                              where the loader can load the model again;
    - ``model_size``          ComfyUI makes room for what the blocks hold on the device, not their host bytes;
    - ``load``                ComfyUI's loader never moves the blocks: the handle places them (no ``super()``
                              for the blocks, which ComfyUI's load must not see);
    - ``partially_load``      no re-patch forced by the loader's patcher (it gives the resident groups up);
    - ``partially_unload``    the handle's device memory goes first, then ComfyUI's own;
    - ``unpatch_model``       the blocks are the handle's to place: ComfyUI moves only the rest of the model;
    - ``detach``              parks the handle before a run, so a plain clone finds pristine host weights;
    - ``patch_hooks``         weight hooks on the blocks are refused: ComfyUI would write them in place;
    - ``pinned_memory_size`` / ``partially_unload_ram``  ComfyUI counts and releases the handle's pinned mirrors;
    - ``pre_run`` / ``cleanup``  no CUDA graphs; pins taken back; the run's telemetry starts and ends; a writer
                              of a mapped file waits for the run (``GroupOffloadHandle.reading_sources``);
    - ``get_key_patches`` / ``model_state_dict`` / ``state_dict_for_saving`` / ``patch_weight_to_device``
                              merges, saves and LoRA extraction get the pristine host weights, each patch once,
                              after the file check; a block weight patched in place is refused.
    """

    offload_settings: OffloadSettings

    def clone(self, *args, **kwargs) -> "GroupOffloadPatcher":
        if kwargs.get("force_deepcopy") and getattr(self, "cached_patcher_init", None) is None:
            raise ValueError("This offloaded model cannot be deep-copied (as training nodes do): the loader that "
                             "made it cannot load it again. Load it with a loader that can: Load Diffusion Model or "
                             "Load Diffusion Model (Group Offload) for a safetensors file; for a .gguf file, "
                             "ComfyUI-GGUF's Unet Loader (Dynamic VRAM), in the ComfyUI-GGUF versions that have it "
                             "(Unet Loader (GGUF) cannot)")
        clone = super().clone(*args, **kwargs)
        carry_owner(self.model, clone.model)  # (a deep copy loads the model again)
        clone.__class__ = type(self)  # (the loader's patcher behind this class may clone as its own: ComfyUI-GGUF's does)
        clone.offload_settings = self.offload_settings
        own_handle(clone)
        return clone

    # --- what ComfyUI asks --------------------------------------------------------------------

    def model_size(self) -> int:
        # No super() past the hidden blocks: ComfyUI's size is the host bytes of every weight, and the
        # streamed ones never take device memory whole.
        blocks = self.blocks()
        if not blocks:  # ComfyUI's own load is running, with the blocks hidden
            return mm.module_size(self.model)
        other_bytes = mm.module_size(self.model) - module_bytes(blocks)
        patch_bytes = BlockPatches.device_bytes_for(self.model, self._block_patches(), self.load_device)
        plan = plan_blocks(self.offload_settings, self._group_bytes(blocks),
                           room_on_the_card(self.model, self.load_device, other_bytes), patch_bytes=patch_bytes)
        return other_bytes + patch_bytes + plan.device_bytes()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        with _blocks_hidden(blocks_owner(self.model)):
            super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                         force_patch_weights=force_patch_weights, full_load=True)
        other_bytes = mm.module_size(self.model) - module_bytes(self.blocks())
        handle = self.handle(device_to)
        # The last load's device memory, its patch tensors too, goes back first: the free figure counts it as free.
        self._patches_off_the_device(handle)
        free = room_now(self.model, device_to)
        device = handle.config.onload_device
        patches = BlockPatches(self.model, self._block_patches(), device, patch_compute_dtype(self, device))
        plan = plan_blocks(self.offload_settings, [g.nbytes for g in handle.snapshot()], free, other_bytes=other_bytes,
                           patch_bytes=patches.device_bytes, granted_bytes=None if full_load else lowvram_model_memory)
        handle.set_resident_bytes(plan.resident_bytes)
        warn_if_unpinned(handle)
        handle.set_onload_patch(patches, patches.keys(), device_bytes=patches.device_bytes)
        patch_encoded(self, patches.encoded, handle.config.onload_device)
        self._set_cast_flags()
        with handle.reading_sources():
            handle.check_sources()  # (also outside a sampling run: ModelSave loads the model too)
            handle.onload_resident()
        # ComfyUI 0.3.75's ModelSave loads with patched weights, then reads the model's own state dict: its
        # next read gives the blocks' weights as this load patched them.
        state_of(self.model).read_after_load = weakref.ref(self) if force_patch_weights else None
        self.model.model_loaded_weight_memory = other_bytes + handle.device_bytes_needed()
        self.model.model_lowvram = False
        stats = handle.stats()
        log.info("Group Offload: %d of %d groups resident (%.2f GB), %.2f GB streamed per pass (%.2f GB pinned, "
                 "%.1f s spent pinning so far), prefetch %d", stats["resident_groups"], stats["groups"],
                 stats["resident_bytes"] / 1e9, stats["streamed_bytes_per_pass"] / 1e9, stats["pinned_bytes"] / 1e9,
                 stats["pin_seconds"], handle.config.prefetch)

    def _set_cast_flags(self) -> None:
        """The blocks' layers get the flags ComfyUI's load gives every layer it loads whole (the blocks are
        hidden from it): a forced cast (ModelComputeDtype: weights cast to the compute dtype at each
        forward) and the weight wrappers of ``add_weight_wrapper``."""
        for name, module in self.model.named_modules():
            if not (hasattr(module, "comfy_cast_weights") and self._is_block_key(f"{name}.")):
                continue
            comfy.model_patcher.wipe_lowvram_weight(module)
            module.comfy_force_cast_weights = self.force_cast_weights
            if self.force_cast_weights:
                module.prev_comfy_cast_weights = module.comfy_cast_weights
                module.comfy_cast_weights = True
            for kind in ("weight", "bias"):
                if hasattr(module, f"{kind}_function"):  # (emptied by the wipe)
                    getattr(module, f"{kind}_function").extend(self.weight_wrapper_patches.get(f"{name}.{kind}", []))

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        # A re-patch the loader's patcher forces at every load (newer ComfyUI-GGUF's) is passed by: it unpatches the
        # model (unpatch_model), which gives the resident groups up, to redo nothing here (the blocks are never
        # patched in place, the rest of the model loads whole, every weight patched). ComfyUI's own request stands
        # (ModelSave's), and new patches still unpatch the model.
        return ModelPatcher.partially_load(self, device_to, extra_memory, force_patch_weights=force_patch_weights)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.release_handle_memory()
        if freed < memory_to_free:
            freed += super().partially_unload(device_to, memory_to_free - freed, force_patch_weights=force_patch_weights)
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if not unpatch_weights:
            return super().unpatch_model(device_to, unpatch_weights)
        state_of(self.model).read_after_load = None
        self.release_handle_memory()
        # ComfyUI restores the patched weights, then moves the whole model to ``device_to``. The blocks
        # are the handle's to place, and a quantized layer's ``.to()`` would give it a new Parameter,
        # which the handle no longer re-points: the move happens here, without them.
        super().unpatch_model(None, unpatch_weights)
        if device_to is not None:
            with _blocks_hidden(blocks_owner(self.model)):
                self.model.to(device_to)
            self.model.device = device_to

    def detach(self, unpatch_all=True):
        # Unloading (``unpatch_all``) gives the handle's device memory back (``unpatch_model``) and
        # keeps the handle, packed and pinned: loading this model again, as when two offloaded
        # models take turns, costs only device copies. ``unpatch_all=False`` comes before every
        # sampling run (load_models_gpu detaches the requested model itself, or a clone about to
        # take over): park the handle, so that a plain clone finds pristine host weights and this
        # one takes its device copies up again for free.
        model = super().detach(unpatch_all)
        handle = self.current_handle()
        if not unpatch_all and handle is not None and getattr(self.model, "current_patcher", None) in (None, self):
            handle.park()  # (a stale clone being garbage-collected detaches too: it must not park a running handle)
        return model

    def patch_hooks(self, hooks):
        # ComfyUI writes a weight hook's patched weights into the model's tensors in place, and back. The
        # blocks' are the handle's: host copies kept pristine, or read-only views of the mapped file, where
        # a write faults. Refused before anything is written.
        if hooks is not None and self._of_blocks(self.get_combined_hook_patches(hooks)):
            raise ValueError("Group Offload cannot apply weight hooks (Create Hook LoRA, hooks set on a "
                             "conditioning) to the blocks it streams: ComfyUI writes hooked weights into the "
                             "model's tensors in place, and the blocks' are Group Offload's host copies or "
                             "read-only pages of the model file. Load the LoRA on the model with a LoRA loader "
                             "(LoraLoaderModelOnly) instead; Group Offload applies it on the GPU")
        return super().patch_hooks(hooks)

    def pinned_memory_size(self) -> int:
        """Host memory the handle holds page-locked (newest ComfyUI asks every model)."""
        # No super(): ComfyUI's counts the weights it pinned itself, and it pins none of the blocks.
        handle = self.current_handle()
        return 0 if handle is None else handle.stats()["pinned_bytes"]

    def partially_unload_ram(self, ram_to_unload, subsets=None) -> int:
        """Give the pinned host memory back under memory pressure; the next load pins it again."""
        # No super(): ComfyUI's unpins the weights it pinned itself, and it pins none of the blocks.
        handle = self.current_handle()
        return 0 if handle is None else handle.unpin()

    def pre_run(self):
        super().pre_run()
        refuse_cuda_graphs(self.model_options)
        handle = self.current_handle()
        mark_run_started(self.model)
        self._run_reads.close()
        if handle is not None:
            self._run_reads.enter_context(handle.reading_sources())  # a writer a lease holds waits for the run
            handle.pin_streamed()  # takes back, from the models run longer ago, pins given up while this one waited
            _keep_page_cache(handle, self.model)
            start_run(self.model, handle, self.offload_settings.node_id,
                      cpu_only=torch.device(self.load_device).type == "cpu", host_limit=host_limit(self.model))

    def cleanup(self):
        stop_watching(state_of(self.model))  # (after a call ComfyUI interrupted: see stop_watching)
        log_back_offs(finish_run(self.model))
        self._run_reads.close()
        super().cleanup()

    # --- ComfyUI's readers of the weights, outside the pack's sampling run ------------------------
    # Merges, ModelSave, LoRA extraction and custom nodes read the model's weights through these. The
    # blocks' Parameters may show a run's patched device copies, or pages of a file changed since: all
    # of them get the pristine host weights instead, after the file check, each patch applied once.

    def get_key_patches(self, filter_prefix=None):
        with _reading(self.model, None):  # (ComfyUI reads only the keys of the state dict here)
            patches = super().get_key_patches(filter_prefix)
        for key, weight in self._block_weights([k for k in patches if self._is_block_key(k)], patched=False).items():
            (_, convert), *applied = patches[key]
            patches[key] = [(weight, convert), *applied]  # ComfyUI applies this patcher's patches to it
        return patches

    def model_state_dict(self, filter_prefix=None):
        with _reading(self.model, self):
            return super().model_state_dict(filter_prefix)

    def state_dict_for_saving(self, *args, **kwargs):
        # (newest ComfyUI's ModelSave; 0.3.75 reads the model's own state dict after ``load``)
        with _reading(self.model, self):
            return super().state_dict_for_saving(*args, **kwargs)

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        if not self._is_block_key(key):
            return super().patch_weight_to_device(key, device_to, inplace_update, **kwargs)
        if kwargs.get("return_weight"):  # newest ComfyUI's ModelSave, one weight at a time
            return self._block_weights([key], patched=True, device=device_to)[key]
        if inplace_update or self.weight_inplace_update:
            raise ValueError(f"Group Offload cannot patch {key} in place: the blocks' weights are its pristine host "
                             f"copies, or read-only pages of the model file, and it applies patches (LoRA...) on the "
                             f"GPU to each copy it streams. Add the patch with a LoRA loader or add_patches instead")
        return super().patch_weight_to_device(key, device_to, inplace_update, **kwargs)  # a loader's own way

    def _block_weights(self, keys: list[str], patched: bool, device: torch.device | None = None
                       ) -> dict[str, torch.Tensor]:
        """The named block weights from the host copies (``GroupOffloadHandle.host_tensors``: after the file
        check, never a view of a file), with this patcher's patches applied once when ``patched`` (computed on
        the load device; returned on ``device``, by default the host). Without a handle (a plain patcher took it
        off) the modules hold host weights themselves: none is given."""
        handle = self.current_handle()
        if handle is None or not keys:
            return {}
        weights = handle.host_tensors(keys)
        if not patched:
            return weights
        device = self.load_device
        patches = BlockPatches(self.model, {k: self.patches[k] for k in weights if k in self.patches}, device,
                               patch_compute_dtype(self, device))
        for key in patches.keys():
            weights[key] = patches(key, weights[key].to(device))
        return {key: weight.to(device or "cpu") for key, weight in weights.items()}

    def _loaded_patched(self) -> bool:
        """Whether the model's weights are, as ComfyUI sees them, patched by this patcher's last ``load``."""
        return getattr(self.model, "current_weight_patches_uuid", None) == self.patches_uuid

    def plan_for_run(self, activation_bytes: int) -> None:
        """Before ComfyUI loads this model for a sampling run: the files the groups left in place map must
        be as they were (``SourceChangedError`` fails the run with a node error, before any of their pages
        is read); ``auto`` plans for ``activation_bytes`` of activations (ComfyUI's estimate for the run).
        The plan in effect is made again when the run needs other room than the last one (its latent may
        be smaller) or the last run backed off."""
        handle = self.current_handle()
        if handle is not None and self._fits(handle, self.load_device):  # (else ``load`` builds a new one)
            handle.check_sources()
        backed_off = handle is not None and handle.backed_off
        state = state_of(self.model)
        replan = self.offload_settings.residency == "auto" and state.run_activations != activation_bytes
        state.run_activations = activation_bytes
        if backed_off or replan:
            self.release_handle_memory()
            self.model.model_lowvram = True  # so that load_models_gpu calls load(), which plans for this run

    # --- the handle ---------------------------------------------------------------------------

    def blocks(self) -> list[nn.Module]:
        return find_blocks(blocks_owner(self.model))

    def current_handle(self) -> GroupOffloadHandle | None:
        blocks = self.blocks()  # empty while ComfyUI's own load runs with the blocks hidden
        return handle_of(blocks[0]) if blocks else None

    def handle(self, device: torch.device) -> GroupOffloadHandle:
        """The handle on this model's blocks, built (or rebuilt for a new layout) on demand."""
        handle = self.current_handle()
        if handle is not None and not self._fits(handle, device):
            remove_handle(self.model)  # the new handle adopts the packed host buffers as they are
            handle = None
        if handle is None:
            _blocks_to_the_host(self.blocks(), self.offload_device)
            handle = build_handle(self.model, self.blocks(), device, self.offload_settings)
        return handle

    def _fits(self, handle: GroupOffloadHandle, device: torch.device) -> bool:
        """Whether ``handle`` is built for these settings and ``device`` (else ``handle`` builds a new one)."""
        return (built_for(self.model) == self.offload_settings.handle_layout()
                and handle.config.onload_device == torch.device(device))

    def release_handle_memory(self) -> int:
        """The handle's device memory given back, and taken off what ComfyUI counts as loaded (so that its next
        ``load_models_gpu`` calls ``load()``); returns the bytes."""
        handle = self.current_handle()
        if handle is None or not handle.holds_device_memory():
            return 0
        held = handle.device_bytes_needed()
        self._patches_off_the_device(handle)  # load() puts them back
        self.model.model_loaded_weight_memory = max(0, self.model.model_loaded_weight_memory - held)
        self.model.model_lowvram = True  # so that the next load_models_gpu calls load() again
        return held

    def _patches_off_the_device(self, handle: GroupOffloadHandle) -> None:
        """Give the device memory back, the patches' own too: the handle's, and those of the weights the model's own
        patcher patches (hung on the host again, the model still patched)."""
        handle.set_onload_patch(None)
        patch_encoded(self, {key: self.patches[key] for key in encoded_keys(self.model, self._block_patches())},
                      self.offload_device)

    def _group_bytes(self, blocks: list[nn.Module]) -> list[int]:
        handle = handle_of(blocks[0])
        if handle is not None:
            return [g.nbytes for g in handle.snapshot()]
        return raw_group_bytes(blocks, self.offload_settings.blocks_per_group)

    def _block_patches(self) -> dict[str, list]:
        """This patcher's weight patches (LoRA...) of block weights; ComfyUI's own load patches the rest."""
        return self._of_blocks(self.patches)

    def _of_blocks(self, patches: dict[str, list]) -> dict[str, list]:
        return {key: patch for key, patch in patches.items() if self._is_block_key(key)}

    def _is_block_key(self, key: str) -> bool:
        owner = owner_path(self.model)
        return key.startswith(tuple(f"{owner}.{path}." for path in block_list_paths(blocks_owner(self.model))))

    @property
    def _run_reads(self) -> contextlib.ExitStack:
        """What the sampling run in progress holds open (``pre_run`` to ``cleanup``)."""
        if "_run_reads_stack" not in self.__dict__:
            self._run_reads_stack = contextlib.ExitStack()
        return self._run_reads_stack


_META = torch.device("meta")  # (a placeholder has no bytes to bring back)


def _blocks_to_the_host(blocks: list[nn.Module], host: torch.device) -> None:
    """Blocks that a plain patcher of the model left on the device come back to the host before a handle is built
    on them: ComfyUI hands a loaded model over to a clone without moving its weights back (``load_models_gpu``
    detaches the other clones with ``unpatch_all=False``), and the build packs a tensor off the host whatever the
    host budget allows."""
    for block in blocks:
        if any(t.device not in (host, _META) for t in (*block.parameters(), *block.buffers())):
            block.to(host)


# --- the blocks in the model's own state dict --------------------------------------------------------

def _nobody() -> None:
    """The reader of a state dict of which only the keys are read."""
    return None


@contextlib.contextmanager
def _reading(base_model: nn.Module, patcher: GroupOffloadPatcher | None) -> Iterator[None]:
    """While ``patcher`` (None: nobody, only keys are read) reads ``base_model``'s state dict; the outermost wins."""
    state = state_of(base_model)
    if state.reading is not None:
        yield
        return
    state.reading = _nobody if patcher is None else weakref.ref(patcher)
    try:
        yield
    finally:
        state.reading = None


def _blocks_in_state_dict(model_state: ModelState, state: dict, prefix: str) -> None:
    """The blocks' entries of the diffusion model's state dict become the weights ComfyUI would see (the reading
    patcher's ``_block_weights``, patched if its load patched the model), when a patcher reads."""
    after_load, model_state.read_after_load = model_state.read_after_load, None
    reader = model_state.reading if model_state.reading is not None else after_load
    patcher = None if reader is None else reader()
    if patcher is None:
        return
    keys = {f"{owner_path(patcher.model)}.{key[len(prefix):]}": key for key in state if key.startswith(prefix)}
    weights = patcher._block_weights([k for k in keys if patcher._is_block_key(k)], patched=patcher._loaded_patched())
    for key, weight in weights.items():
        state[keys[key]] = weight


def _hook_state_dict(base_model: nn.Module) -> None:
    """A state-dict hook on ``base_model``'s diffusion model, once, for ``_blocks_in_state_dict``. It holds the
    model's state, never the model, and does nothing for a deep copy of the diffusion model (which has the hook)."""
    model_state = state_of(base_model)
    if model_state.state_dict_hooked:
        return
    model_state.state_dict_hooked = True
    owner = blocks_owner(base_model)
    hooked = weakref.ref(owner)

    def blocks_in_state_dict(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        if module is hooked():
            _blocks_in_state_dict(model_state, state, prefix)

    owner.register_state_dict_post_hook(blocks_in_state_dict)


# --- making one -----------------------------------------------------------------------------------


def _keep_page_cache(handle: GroupOffloadHandle, base_model: nn.Module) -> None:
    """Give the groups left in place the page cache there is room for in this run (``page_cache_room``): where
    it holds less than they need, the core keeps the first ones cached and reads the others again at each step."""
    in_place = handle.stats()["in_place_bytes"]
    if not in_place:
        return
    room = page_cache_room(handle, base_model)
    kept = handle.keep_cached(room.bytes)
    if kept < in_place:
        log.info("Group Offload: %s of page cache for the %s left in place (bound by %s): %s of them stay cached, "
                 "the others are read from the disk at each step, around the page cache where the file system reads so",
                 format_bytes(room.bytes), format_bytes(in_place), room.bound_by, format_bytes(kept))


def _non_dynamic_clone(model: ModelPatcher) -> ModelPatcher:
    """A plain clone of a Dynamic VRAM (comfy-aimdo) patcher, whose weights the handle can pack.

    ComfyUI makes one by loading the model again through the loader that made it; the weights it
    loads are kept for every later clone of the same model (as ComfyUI's ``get_non_dynamic_delegate``
    does for one patcher), so that host memory holds them once however often the node runs.
    """
    try:
        clone = model.clone(disable_dynamic=True, model_override=state_of(model.model).non_dynamic_twin)
    except RuntimeError as error:
        raise ValueError("Group Offload needs this model without Dynamic VRAM and its loader cannot provide "
                         "that; load it with Load Diffusion Model (Group Offload), which reads the file without "
                         "Dynamic VRAM") from error
    state_of(model.model).non_dynamic_twin = clone.get_clone_model_override()
    return clone


# The input patcher's class -> GroupOffloadPatcher in front of it.
_OFFLOAD_CLASSES: dict[type, type] = {ModelPatcher: GroupOffloadPatcher}


def _offload_class(patcher_class: type) -> type:
    """GroupOffloadPatcher in front of the input patcher's own class, so that a loader's patcher keeps doing
    its own way what the offloading leaves to it (ComfyUI-GGUF's patches and unpatches its quantized weights,
    and clones its options)."""
    if issubclass(patcher_class, GroupOffloadPatcher):
        return patcher_class
    if patcher_class not in _OFFLOAD_CLASSES:
        _OFFLOAD_CLASSES[patcher_class] = type(f"GroupOffload{patcher_class.__name__}",
                                               (GroupOffloadPatcher, patcher_class), {"__module__": __name__})
    return _OFFLOAD_CLASSES[patcher_class]


_WRAPPER_KEY = "group_offload"
_WRAPPERS = {comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING: plan_for_the_run,
             comfy.patcher_extension.WrappersMP.APPLY_MODEL: apply_model_backing_off}


def make_offloaded(model: ModelPatcher, settings: OffloadSettings) -> GroupOffloadPatcher:
    """A clone of ``model`` (a diffusion model's patcher, or a CLIP's whose text encoder owns its layers:
    ``own_text_encoder_layers``) that offloads its blocks; the input stays as it was."""
    settings.validate()
    owner = blocks_owner(model.model)
    check_offloadable(find_blocks(owner))  # fail now, in this node, not in the sampler
    refuse_weight_caches(owner)
    clone = _non_dynamic_clone(model) if getattr(model, "is_dynamic", lambda: False)() else model.clone()
    carry_owner(model.model, clone.model)  # (a Dynamic VRAM model's plain twin)
    clone.__class__ = _offload_class(type(clone))
    clone.offload_settings = settings
    clone.offload_device = torch.device("cpu")  # ComfyUI's is the GPU under --gpu-only / --highvram
    own_handle(clone)
    _hook_state_dict(clone.model)
    if not is_text_encoder(clone.model):  # (a text encoder is never sampled)
        _add_sampling_wrappers(clone)
    # A new identity for its weights: ComfyUI then unpatches whatever another clone left on the
    # device before this one loads, instead of taking that state as already loaded.
    clone.patches_uuid = uuid.uuid4()
    return clone


def _add_sampling_wrappers(clone: GroupOffloadPatcher) -> None:
    if post_cfg_step not in clone.model_options.get("sampler_post_cfg_function", []):
        clone.set_model_sampler_post_cfg_function(post_cfg_step)  # marks steps for the telemetry
    for kind, wrapper in _WRAPPERS.items():
        clone.remove_wrappers_with_key(kind, _WRAPPER_KEY)  # (once, however often the model was offloaded)
        clone.add_wrapper_with_key(kind, _WRAPPER_KEY, wrapper)

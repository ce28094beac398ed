"""Load a diffusion model with its blocks as views of the memory-mapped safetensors file.

Which tensors are block tensors is found first, on the model ComfyUI detects from the file's shapes,
built on the meta device: those inside the lists the block finder finds there (as the node finds
them).  ComfyUI then builds the model (detection, dtypes, ops) from a state dict in which every
large block tensor is a meta tensor of the right shape and dtype, and loads it with the blocks' own
tensors on the meta device too, so that it allocates nothing for them.  The blocks then get views of
the file's mapping (page cache, not anonymous memory): the groups within the host budget are
packed from them into host mirrors, the others stream from the file.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from torch import nn

import comfy.model_base
import comfy.model_detection
import comfy.model_management as mm
import comfy.sd
import comfy.supported_models_base
import comfy.utils

from .blocks import block_list_paths
from ..offload_core import flatten, map_file
from .handles import build_handle
from .patcher import GroupOffloadPatcher, make_offloaded
from .safetensors_file import SafetensorsFile
from .settings import OffloadSettings

_META = torch.device("meta")
_ACCEPTS_DISABLE_DYNAMIC = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters
_INSTEAD = "use Load Diffusion Model followed by Group Offload (no copy-back)"

log = logging.getLogger(__name__)


class AsLoaded(NamedTuple):
    """A file's state dict as ComfyUI's ``load_diffusion_model_state_dict`` has it when it detects the model."""

    state_dict: dict[str, torch.Tensor]
    metadata: dict | None
    file_keys: dict[str, str | None]  # each key -> the file key of its tensor (None: made by ComfyUI, in no file)


def as_comfyui_loads(state_dict: dict[str, torch.Tensor], metadata: dict | None, model_options: dict) -> AsLoaded:
    """``state_dict`` after ComfyUI's key conversion at load, the same steps as its ``load_diffusion_model_state_dict``.

    ComfyUI strips the model's prefix and (newest ComfyUI) converts old scaled-fp8 names
    (``scale_weight`` -> ``weight_scale``), adding a ``comfy_quant`` per layer.
    """
    origin = {id(tensor): key for key, tensor in state_dict.items()}
    convert = getattr(comfy.utils, "convert_old_quants", None)
    if convert is None or model_options.get("custom_operations") is not None:
        convert = lambda sd, prefix, metadata: (sd, metadata)  # noqa: E731 (as this ComfyUI loads: no conversion)
    converted, metadata = convert(dict(state_dict), "", metadata=metadata)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(converted)
    stripped = comfy.utils.state_dict_prefix_replace(converted, {prefix: ""}, filter_keys=True)
    if stripped:
        converted, metadata = convert(stripped, "", metadata=metadata)
    return AsLoaded(converted, metadata, {key: origin.get(id(tensor)) for key, tensor in converted.items()})


def block_keys(loaded: AsLoaded, name: str) -> tuple[set[str], dict[str, str | None]]:
    """The model's block keys, as its ``load_model_weights`` names them, and each model key's file key.

    The lists are those ``block_list_paths`` finds (as for the node) on the model ComfyUI detects from
    ``loaded``, built on the meta device; only shapes and dtypes are read, so the large tensors may be
    meta tensors. The model's config may rename keys as it loads (Flux's ``_norm.scale`` ->
    ``_norm.weight``): each model key is traced back to its file key through that step too.
    """
    diffusion_model, model_config = _built_on_meta(loaded, name)
    origin = {id(tensor): loaded.file_keys[key] for key, tensor in loaded.state_dict.items()}
    as_named = model_config.process_unet_state_dict(dict(loaded.state_dict))
    prefixes = tuple(f"{path}." for path in block_list_paths(diffusion_model))
    file_keys = {key: origin.get(id(tensor)) for key, tensor in as_named.items()}
    return {key for key in as_named if key.startswith(prefixes)}, file_keys


def _built_on_meta(loaded: AsLoaded, name: str) -> tuple[nn.Module, comfy.supported_models_base.BASE]:
    """The diffusion model ComfyUI detects from ``loaded``, built and loaded on the meta device, and its config."""
    # Detection may pop from both (0.3.75: the scaled_fp8 marker, the _quantization_metadata header).
    state_dict, metadata = dict(loaded.state_dict), None if loaded.metadata is None else dict(loaded.metadata)
    try:
        model_config = comfy.model_detection.model_config_from_unet(state_dict, "", metadata=metadata)
        model = None if model_config is None else _meta_model(model_config, state_dict)
    except Exception as error:  # in detection, or a model that cannot be built on the meta device
        raise ValueError(f"{name}: ComfyUI could not build its model on the meta device, where this loader finds "
                         f"the blocks before loading them ({type(error).__name__}: {error}); {_INSTEAD}") from error
    if model is None:
        raise ValueError(f"{name}: ComfyUI detects no diffusion model under its own key names in it (a "
                         f"diffusers-format file is renamed as it loads), so its blocks cannot be found before "
                         f"it loads; {_INSTEAD}")
    return model.diffusion_model, model_config


def _meta_model(model_config: comfy.supported_models_base.BASE, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """ComfyUI's model for ``model_config`` on the meta device, loaded from ``state_dict`` as ComfyUI loads
    it (quantized layers, and every Linear under Dynamic VRAM, get their weights only then)."""
    log.info("Group Offload: %s builds on the meta device to find its blocks", type(model_config).__name__)
    # Built for the meta device rather than under it (as the default device, it makes PixArt's
    # constructor fail and Stable Cascade's take a minute); the few parameters some classes make on
    # the CPU whatever the device (CogVideoX's) are moved after.
    model = model_config.get_model(state_dict, "", device=_META).to(_META)
    with warnings.catch_warnings():  # the small tensors read at once are copied into meta parameters: no-ops
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        model.load_model_weights(state_dict, "")
    return model


def _check_block_keys(path: str, diffusion_model: nn.Module, file_keys: set[str]) -> None:
    """The block tensors of the built model must be the file's block tensors, under the same names."""
    model_keys = {f"{path}.{key}" for path in block_list_paths(diffusion_model)
                  for key in diffusion_model.get_submodule(path).state_dict()}
    if missing := model_keys - file_keys:
        raise ValueError(f"The blocks ComfyUI builds from {Path(path).name} do not have the file's keys (ComfyUI "
                         f"renames them, or makes tensors of its own: the model's {min(missing)} is not in the "
                         f"file), so they cannot be read straight into host memory; {_INSTEAD}")
    if extra := file_keys - model_keys:
        raise ValueError(f"{len(extra)} block tensors of {Path(path).name} belong to no block of "
                         f"{type(diffusion_model).__name__} (e.g. {min(extra)}); {_INSTEAD}")


def _read_later(st: SafetensorsFile, key: str) -> bool:
    """Whether a block tensor goes straight into its host mirror (while the blocks are found, every such
    tensor is a meta tensor): the matrices. ComfyUI reads the values of some small ones while it builds
    the model (a layer's ``comfy_quant`` JSON, an old file's ``scale_input``, the spread of a Z-Image
    norm that decides whether fp16 is allowed), so scalars and vectors, a sliver of the bytes, are read
    at once."""
    return len(st.shape(key)) >= 2


def _inner_tensor_keys(path: str, diffusion_model: nn.Module) -> dict[str, list[str]]:
    """For each quantized block weight (a wrapper tensor subclass), the keys its inner tensors (data
    and scales) are saved under, by the layer's own ``state_dict``."""
    keys: dict[str, list[str]] = {}
    for blocks in block_list_paths(diffusion_model):
        for name, module in diffusion_model.get_submodule(blocks).named_modules(prefix=blocks):
            saved: dict[int, str] | None = None
            for tensor_name, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
                flat, inner = flatten(tensor)
                if flat is None:  # a plain tensor: its own key
                    continue
                if saved is None:
                    saved = {id(t): key for key, t in module.state_dict(prefix=f"{name}.", keep_vars=True).items()}
                if any(id(t) not in saved for t in inner):
                    raise ValueError(f"{Path(path).name}: ComfyUI does not save the parts of {name}.{tensor_name} "
                                     f"({type(tensor).__name__}) under keys of their own, so they cannot be read "
                                     f"straight into host memory; {_INSTEAD}")
                keys[f"{name}.{tensor_name}"] = [saved[id(t)] for t in inner]
    return keys


def load_offloaded(path: str, model_options: dict, settings: OffloadSettings) -> GroupOffloadPatcher:
    """ComfyUI's ``load_diffusion_model``, with the blocks' weights left in the mapped file.

    The block keys are those inside the block lists of the model ComfyUI detects from the file, found on
    the meta device first. Quantized layers (``comfy_quant`` files, and old scaled-fp8 ones that newest
    ComfyUI converts) are mapped the same way: each inner tensor of a quantized weight (data, scales)
    from its own key. Packed now as far as the host budget allows.
    """
    offloaded = _offloaded_on_the_file(path, model_options, settings)
    build_handle(offloaded.model, offloaded.blocks(), offloaded.load_device, settings)
    return offloaded


def _offloaded_on_the_file(path: str, model_options: dict, settings: OffloadSettings) -> GroupOffloadPatcher:
    """``load_offloaded`` but for the handle, which the patcher builds at its first load."""
    st = SafetensorsFile(path)
    mapping = map_file(path)  # read-only: the tensors ComfyUI reads are views of it, nothing else is read
    state_dict = {key: st.placeholder(key) if _read_later(st, key) else st.tensor(mapping, key) for key in st.entries}
    loaded = as_comfyui_loads(state_dict, st.metadata, model_options)
    blocks, file_keys = block_keys(loaded, Path(path).name)
    later = {file_keys[key] for key in blocks}
    for key, tensor in state_dict.items():  # the meta tensors outside the blocks are read now
        if tensor.is_meta and key not in later:
            state_dict[key] = st.tensor(mapping, key)
    extra = {"disable_dynamic": True} if _ACCEPTS_DISABLE_DYNAMIC else {}
    # Newest ComfyUI takes the offload device from the options: under --gpu-only / --highvram its
    # default is the GPU, where it would move the whole model (0.3.75 always uses its default).
    model_options = {**model_options, "offload_device": torch.device("cpu")}
    on_meta = {key for key in blocks if file_keys.get(key) is not None and _read_later(st, file_keys[key])}
    with _offload_device_on_the_cpu(), _blocks_loaded_on_meta(on_meta):
        patcher = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options,
                                                           metadata=st.metadata, **extra)
    if patcher is None:
        raise RuntimeError(f"ERROR: Could not detect model type of: {path}")
    del state_dict
    diffusion_model = patcher.model.diffusion_model
    inner_keys = _inner_tensor_keys(path, diffusion_model)
    _check_block_keys(path, diffusion_model, blocks)
    _map_blocks(diffusion_model, st, mapping, file_keys, inner_keys)
    copy_out_of(mapping, diffusion_model)
    offloaded = make_offloaded(patcher, settings)
    if hasattr(offloaded, "cached_patcher_init"):  # newest ComfyUI's deep clones load the model again through it
        offloaded.cached_patcher_init = (_load_again, (path, model_options, settings))
    return offloaded


@contextlib.contextmanager
def _blocks_loaded_on_meta(keys: set[str]) -> Iterator[None]:
    """While ComfyUI loads the model it built: the block tensors the state dict has as meta tensors are
    meta tensors in the model too, so that loading them allocates and copies nothing (a layer that makes
    its weight of the state dict's tensor, a quantized or lazily loaded one, makes it of the meta tensor)."""
    load_model_weights = comfy.model_base.BaseModel.load_model_weights

    def loading_blocks_on_meta(model: comfy.model_base.BaseModel, *args, **kwargs):
        for key in keys:
            module_path, _, name = key.rpartition(".")
            module = model.diffusion_model.get_submodule(module_path)
            for table in (module._parameters, module._buffers):
                tensor = table.get(name)
                if isinstance(tensor, torch.Tensor) and type(tensor.data) is torch.Tensor and not tensor.is_meta:
                    meta = torch.empty_like(tensor, device=_META)
                    table[name] = nn.Parameter(meta, tensor.requires_grad) if table is module._parameters else meta
        with warnings.catch_warnings():  # the meta placeholders "copied" into meta parameters: no-ops
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            return load_model_weights(model, *args, **kwargs)

    comfy.model_base.BaseModel.load_model_weights = loading_blocks_on_meta
    try:
        yield
    finally:
        comfy.model_base.BaseModel.load_model_weights = load_model_weights


def _map_blocks(diffusion_model: nn.Module, st: SafetensorsFile, mapping: torch.Tensor,
                file_keys: dict[str, str | None], inner_keys: dict[str, list[str]]) -> None:
    """Every block tensor left on the meta device becomes a view of the mapped file (a quantized weight,
    rebuilt over views of its inner tensors' keys)."""
    for key, module, table, attr in tensor_slots(diffusion_model, in_blocks=True):
        inner = flatten(table[attr])[1]
        if any(t.is_meta for t in inner):  # (the others were read at once, being small, or made by ComfyUI)
            replace_tensor(module, table, attr, [st.view(mapping, _file_key(st, file_keys, part), like)
                                           for part, like in zip(inner_keys.get(key, [key]), inner)])


def copy_out_of(mapping: torch.Tensor, diffusion_model: nn.Module) -> None:
    """The tensors outside the blocks still in the file's read-only mapping (a quantized layer keeps the
    parts the state dict gave it) get memory of their own: ComfyUI may patch those in place (weight
    hooks), and a write to the mapping faults. Only the blocks' writes go elsewhere (to device copies)."""
    start, end = mapping.data_ptr(), mapping.data_ptr() + mapping.numel()
    for _, module, table, attr in tensor_slots(diffusion_model, in_blocks=False):
        inner = flatten(table[attr])[1]
        if any(start <= t.data_ptr() < end for t in inner):
            replace_tensor(module, table, attr, [t.clone() for t in inner])


def tensor_slots(diffusion_model: nn.Module, in_blocks: bool) -> Iterator[tuple[str, nn.Module, dict, str]]:
    """(key, module, table, attribute) of every parameter and buffer inside (or outside) the block lists."""
    paths = block_list_paths(diffusion_model)
    prefixes = tuple(f"{path}." for path in paths)
    for name, module in diffusion_model.named_modules():
        if (name in paths or name.startswith(prefixes)) != in_blocks:
            continue
        for table in (module._parameters, module._buffers):
            for attr in [attr for attr, tensor in table.items() if tensor is not None]:
                yield f"{name}.{attr}", module, table, attr


def replace_tensor(module: nn.Module, table: dict, attr: str, parts: list[torch.Tensor]) -> None:
    """``table[attr]`` becomes a tensor over ``parts`` (a quantized weight's, rebuilt), as ComfyUI made it."""
    tensor = table[attr]
    flat = flatten(tensor)[0]
    with torch.inference_mode(tensor.is_inference()):  # of its kind: torch picks kernels by it too
        replaced = parts[0] if flat is None else flat.rebuild(parts)
        if table is module._parameters:
            replaced = nn.Parameter(replaced, requires_grad=tensor.requires_grad)
            for attribute, value in tensor.__dict__.items():  # what ComfyUI marked its weight with
                replaced.__dict__.setdefault(attribute, value)  # (a quantized one's parts are its own)
    table[attr] = replaced


def _file_key(st: SafetensorsFile, file_keys: dict[str, str | None], key: str) -> str:
    if file_keys.get(key) is None:
        raise ValueError(f"{Path(st.path).name} has no tensor for block weight {key}; {_INSTEAD}")
    return file_keys[key]


@contextlib.contextmanager
def _offload_device_on_the_cpu() -> Iterator[None]:
    """ComfyUI 0.3.75 moves the model it builds to ``unet_offload_device()``, which ``--gpu-only`` and
    ``--highvram`` make the GPU, before the blocks reach their host mirrors: the whole model would land
    on the GPU. While it builds, its offload device is the CPU, as the offloaded patcher's is."""
    if mm.unet_offload_device().type == "cpu":
        yield
        return
    default = mm.unet_offload_device
    mm.unet_offload_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        mm.unet_offload_device = default


def _load_again(path: str, model_options: dict, settings: OffloadSettings,
                disable_dynamic: bool = True) -> GroupOffloadPatcher:
    """``load_offloaded`` as ComfyUI calls a loader to load a model again (it never makes a dynamic patcher), with no
    handle yet: the clone ComfyUI makes of it builds the one handle at its first load, for its own settings and
    load device."""
    return _offloaded_on_the_file(path, model_options, settings)

"""LoRA (any ComfyUI weight patch) on the blocks, computed on the device into each fresh copy: the host
mirrors stay pristine, so one packed model serves every clone whatever its patches.

A weight whose bytes are not its values (a plain tensor subclass over integer storage: ComfyUI-GGUF's
quantized ``GGMLTensor``) cannot be patched by computing on them. The model's own patcher patches it
its own way (``patch_encoded``), once per load: ComfyUI-GGUF's hangs the patches on the weight, and its
layers add them as they dequantize, wherever its bytes lie. Their tensors go to the device once per load
too, as every other patch's."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
from torch import nn

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
from comfy.model_patcher import ModelPatcher, get_key_weight
from comfy.weight_adapter import WeightAdapterBase

from ..offload_core import plain_subclass

# Newest ComfyUI computes LoRA in a per-device dtype (fp16 where it is fast); 0.3.75 in float32.
_lora_dtype: Callable[[torch.device], torch.dtype] = getattr(mm, "lora_compute_dtype", lambda device: torch.float32)
# The seed of a patched weight's stochastic rounding, from its key. Newest ComfyUI moved it to comfy.utils
# and logs a warning from the old name at every call; 0.3.75 has only the old name.
_string_to_seed: Callable[[str], int] = (getattr(comfy.utils, "string_to_seed", None)
                                         or comfy.model_patcher.string_to_seed)
# Computing a patched weight holds about this many temporaries of the weight's size in the LoRA dtype.
_PATCH_TEMPORARIES = 3


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

    def __init__(self, model: nn.Module, patches: dict[str, list], device: torch.device,
                 compute_dtype: torch.dtype) -> None:
        self._model = weakref.ref(model)  # the handle lives on the model: no reference cycle through it
        self._compute_dtype = compute_dtype
        on_device = {key: _map_tensors(p, lambda t: t.to(device)) for key, p in patches.items()}
        encoded = set(encoded_keys(model, patches))
        #: the patches of the weights whose bytes are not their values: the model's own patcher hangs them on
        #: those weights (``patch_encoded``)
        self.encoded = {key: p for key, p in on_device.items() if key in encoded}
        self._patches = {key: p for key, p in on_device.items() if key not in encoded}
        self.device_bytes = self.device_bytes_for(model, patches, device)

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
        temp = mm.cast_to_device(weight, weight.device, self._compute_dtype, copy=True)
        if convert_func is not None:  # a quantized weight: dequantized
            temp = convert_func(temp, inplace=True)
        out = comfy.lora.calculate_weight(self._patches[key], temp, key)
        seed = _string_to_seed(key)
        if set_func is not None:  # its layer's own way back (a quantized weight: quantized again)
            return set_func(out, inplace_update=False, seed=seed, return_weight=True)
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=seed)


def patch_compute_dtype(patcher: ModelPatcher, device: torch.device) -> torch.dtype:
    """The dtype the model's own patcher computes a patched weight in, so that the pack's patch is its patch:
    ComfyUI's asks ``lora_compute_dtype`` (newest ComfyUI: float16 on fp16-capable cards); a patcher that
    patches weights its own way (ComfyUI-GGUF's, and the patchers derived from ComfyUI's before it had a
    LoRA dtype) computes in float32."""
    return _lora_dtype(device) if not _patches_its_own_way(patcher) else torch.float32


def _patches_its_own_way(patcher: ModelPatcher) -> bool:
    """Whether the patcher behind the pack's own class overrides ComfyUI's ``patch_weight_to_device``."""
    owner = next(cls for cls in type(patcher).__mro__
                 if "patch_weight_to_device" in vars(cls) and not cls.__module__.startswith(__package__))
    return owner is not ModelPatcher


def _encoded(weight: torch.Tensor) -> bool:
    """A plain subclass whose storage holds no floating-point values (ComfyUI-GGUF's quantized blocks, uint8).
    Decided by the storage's element type, not by ``dtype``: a subclass may report there the dtype it computes
    in, as newer ComfyUI-GGUF's does."""
    return plain_subclass(weight) is not None and not torch.Tensor.dtype.__get__(weight).is_floating_point


def encoded_keys(model: nn.Module, patches: dict[str, list]) -> list[str]:
    """The keys of ``patches`` whose weights' bytes are not their values: the model's own patcher patches them."""
    return [key for key in patches if _encoded(comfy.utils.get_attr(model, key))]


def patch_encoded(patcher: ModelPatcher, patches: dict[str, list], patches_on: torch.device) -> None:
    """Have the model's own patcher patch the weights of ``patches`` (whose bytes are not their values) its own
    way, with these patches, whose tensors lie on ``patches_on``; each weight must stay the object it was (the
    handle re-points its bytes at every layout).

    A patcher keeps what it does not load on its offload device, the host where Group Offload runs:
    ComfyUI-GGUF's hangs a quantized weight's patches there (unless ``patch_on_device``), and they are copied to
    the device at every forward. For the call, its patches are these and its offload device ``patches_on``: at
    each load, the patches already on the device the blocks compute on (the device memory planned for them);
    the patcher's own, on the host, once that memory is given back."""
    own_way = _patches_its_own_way(patcher)
    saved = patcher.patches, patcher.offload_device
    patcher.patches, patcher.offload_device = {**patcher.patches, **patches}, patches_on
    try:
        for key in patches:
            _patch_own_way(patcher, key, own_way)
    finally:
        patcher.patches, patcher.offload_device = saved


def _patch_own_way(patcher: ModelPatcher, key: str, own_way: bool) -> None:
    weight = comfy.utils.get_attr(patcher.model, key)
    if own_way:
        patcher.patch_weight_to_device(key, device_to=weight.device)
    if not own_way or comfy.utils.get_attr(patcher.model, key) is not weight:
        raise ValueError(f"Group Offload cannot apply this LoRA to {key}: its weight is a {type(weight).__name__}, "
                         f"whose bytes are not its values, and the model's patcher ({type(patcher).__name__}) "
                         f"does not patch such a weight in place; load the model with the loader made for its "
                         f"format")

"""LoRA (any ComfyUI weight patch) on the blocks, computed on the device into each fresh copy: the host
mirrors stay pristine, so one packed model serves every clone whatever its patches."""
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
from comfy.model_patcher import get_key_weight
from comfy.weight_adapter import WeightAdapterBase

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

    def __init__(self, model: nn.Module, patches: dict[str, list], device: torch.device) -> None:
        self._model = weakref.ref(model)  # the handle lives on the model: no reference cycle through it
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

"""Load a diffusion model with its blocks read from the safetensors file straight into host mirrors.

ComfyUI builds the model (detection, dtypes, ops) from a state dict in which every block tensor is a
zero-byte placeholder of the right shape and dtype; the real block weights are then read from the
file, group by group, into the packed mirrors.  Host memory holds the weights about once: each
group's first allocation is released as soon as its mirror is filled.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import safetensors
import torch

import comfy.sd
import comfy.utils

from .blocks import BLOCK_LISTS
from .memory import OffloadSettings
from .patcher import GroupOffloadPatcher, build_engine, make_offloaded, remove_engine

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_BLOCK_NAMES = sorted({name for names in BLOCK_LISTS.values() for name in names})
# "<prefix>transformer_blocks.<i>." where the prefix is whole dotted segments (e.g. "model.diffusion_model.")
_BLOCK_KEY = re.compile(rf"^(?P<prefix>(?:\w+\.)*?)(?:{'|'.join(_BLOCK_NAMES)})\.\d+\.")
_ACCEPTS_DISABLE_DYNAMIC = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters


class SafetensorsFile:
    """The header of a .safetensors file, and reads of single tensors into given memory."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + size

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self.entries[key]["dtype"]]

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.entries[key]["shape"])

    def placeholder(self, key: str) -> torch.Tensor:
        """A zero-byte stand-in with the tensor's shape and dtype."""
        return torch.empty((), dtype=self.dtype(key)).expand(self.shape(key))

    def read_into(self, file, key: str, out: torch.Tensor) -> None:
        """Read ``key`` into ``out``, converting its dtype the way ``Tensor.copy_`` does."""
        if self.shape(key) != out.shape:
            raise ValueError(f"{key} has shape {list(self.shape(key))} in {self.path}, the model expects {list(out.shape)}")
        target = out if self.dtype(key) == out.dtype else torch.empty(out.shape, dtype=self.dtype(key))
        start, end = self.entries[key]["data_offsets"]
        buffer = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        file.seek(self.data_start + start)
        if file.readinto(buffer) != end - start:
            raise ValueError(f"{self.path} is truncated: could not read {key}")
        if target is not out:
            out.copy_(target)


def _is_quantized(st: SafetensorsFile) -> bool:
    """Quantized layers (ComfyUI's ``comfy_quant`` format, or old scaled fp8 that newer ComfyUI converts
    to it on load) become tensor subclasses, whose keys and bytes the mirrors cannot take as they are."""
    if "_quantization_metadata" in (st.metadata or {}) or any(k.endswith(".comfy_quant") for k in st.entries):
        return True
    converts_scaled_fp8 = hasattr(comfy.utils, "convert_old_quants")
    return converts_scaled_fp8 and any(k.endswith("scaled_fp8") for k in st.entries)


def load_offloaded(path: str, model_options: dict, settings: OffloadSettings) -> GroupOffloadPatcher:
    """ComfyUI's ``load_diffusion_model``, with the blocks going straight into pinned host mirrors."""
    st = SafetensorsFile(path)
    if _is_quantized(st):
        raise ValueError(f"{Path(path).name} holds quantized weights, which Group Offload cannot stream yet; "
                         f"load it with Load Diffusion Model")
    block_keys = {key: m.group("prefix") for key in st.entries if (m := _BLOCK_KEY.match(key))}
    if not block_keys:
        raise ValueError(f"{Path(path).name} has no transformer blocks this loader knows; "
                         f"use Load Diffusion Model followed by Group Offload (no copy-back)")
    state_dict = {}
    with safetensors.safe_open(path, framework="pt") as f:
        for key in st.entries:
            state_dict[key] = st.placeholder(key) if key in block_keys else f.get_tensor(key)
    extra = {"disable_dynamic": True} if _ACCEPTS_DISABLE_DYNAMIC else {}
    # Newest ComfyUI takes the offload device from the options: under --gpu-only / --highvram its
    # default is the GPU, where it would move the whole model (0.3.75 always uses its default).
    model_options = {**model_options, "offload_device": torch.device("cpu")}
    patcher = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options, metadata=st.metadata, **extra)
    if patcher is None:
        raise RuntimeError(f"ERROR: Could not detect model type of: {path}")
    del state_dict
    offloaded = make_offloaded(patcher, settings)
    prefix = next(iter(block_keys.values()))
    unread = set(block_keys)

    with open(path, "rb") as file:
        def fill(name: str, view: torch.Tensor) -> None:
            key = prefix + name.removeprefix("diffusion_model.")
            if key not in st.entries:
                raise ValueError(f"{Path(path).name} has no tensor {key} for block weight {name}; "
                                 f"use Load Diffusion Model followed by Group Offload (no copy-back)")
            st.read_into(file, key, view)
            unread.discard(key)

        build_engine(offloaded.model, offloaded.blocks(), offloaded.load_device, settings, fill=fill)
    if unread:
        remove_engine(offloaded.model)
        raise ValueError(f"{len(unread)} block tensors of {Path(path).name} belong to no block of "
                         f"{type(offloaded.model.diffusion_model).__name__} (e.g. {min(unread)})")
    return offloaded

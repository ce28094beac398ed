"""Load a diffusion model with its blocks read from the safetensors file straight into host mirrors.

ComfyUI builds the model (detection, dtypes, ops) from a state dict in which every block tensor is a
zero-byte placeholder of the right shape and dtype; the real block weights are then read from the
file, group by group, into the packed mirrors.  Host memory holds the weights about once: each
group's first allocation is released as soon as its mirror is filled.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import re
from pathlib import Path
from typing import Iterator

import safetensors
import torch
from torch import nn

import comfy.model_detection
import comfy.model_management as mm
import comfy.sd
import comfy.utils

from .blocks import BLOCK_LISTS, block_list_paths
from .memory import OffloadSettings
from .patcher import GroupOffloadPatcher, build_engine, make_offloaded

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_BLOCK_NAMES = sorted({name for names in BLOCK_LISTS.values() for name in names})
# "transformer_blocks.<i>." right after the diffusion model's prefix: a block list of the diffusion
# model itself, not one nested in another module (Chroma's distilled_guidance_layer.layers.<i>).
_BLOCK_KEY = re.compile(rf"(?:{'|'.join(_BLOCK_NAMES)})\.\d+\.")
_ACCEPTS_DISABLE_DYNAMIC = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters
MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts


class SafetensorsFile:
    """The header of a .safetensors file, checked against the file, and reads of single tensors into given memory."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        file_bytes = os.path.getsize(self.path)
        if file_bytes < 8:
            raise self._invalid("it is empty" if file_bytes == 0 else f"it is only {file_bytes} bytes long")
        with open(self.path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise self._invalid(f"its header claims {length} bytes, more than a safetensors header may have")
            if length > file_bytes - 8:
                raise self._invalid(f"its header claims {length} bytes, the whole file has {file_bytes}")
            header = self._parse_header(f.read(length))
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + length
        self._check_layout(file_bytes - self.data_start)

    def _invalid(self, problem: str) -> ValueError:
        return ValueError(f"{Path(self.path).name} is not a valid safetensors file ({problem}); make sure it is a "
                          f".safetensors file and was downloaded completely")

    def _parse_header(self, raw: bytes) -> dict:
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            raise self._invalid("its header is not JSON") from None
        if not isinstance(header, dict):
            raise self._invalid("its header is not a JSON object")
        metadata = header.get("__metadata__", {})
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise self._invalid("its __metadata__ is not a map of strings")
        return header

    def _check_layout(self, data_bytes: int) -> None:
        """Known dtypes, sizes that match shapes, and tensors that lie inside the data and do not overlap."""
        spans = []
        for key, entry in self.entries.items():
            if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
                raise self._invalid(f"its entry for {key} lacks dtype, shape or data_offsets")
            if entry["dtype"] not in _DTYPES:
                raise self._invalid(f"{key} has dtype {entry['dtype']!r}; this loader reads {', '.join(_DTYPES)}")
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise self._invalid(f"{key} has shape {shape!r}, not a list of sizes")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise self._invalid(f"{key} has data_offsets {offsets!r}, not [start, end]")
            needed = math.prod(shape) * _DTYPES[entry["dtype"]].itemsize
            if offsets[1] - offsets[0] != needed:
                raise self._invalid(f"{key} spans {offsets[1] - offsets[0]} bytes but its shape and dtype need {needed}")
            spans.append((offsets[0], offsets[1], key))
        end, last = 0, None
        for start, stop, key in sorted(spans):
            if start < end:
                raise self._invalid(f"{key} overlaps {last}")
            end, last = stop, key
        if end > data_bytes:
            raise self._invalid(f"it is truncated: its tensors need {end} bytes of data, it holds {data_bytes}")

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


def block_keys(keys: list[str]) -> tuple[str, set[str]]:
    """The diffusion model's prefix in ``keys`` (as ComfyUI strips it) and the keys of its blocks."""
    prefix = comfy.model_detection.unet_prefix_from_state_dict(keys)
    if not any(key.startswith(prefix) for key in keys):
        prefix = ""  # ComfyUI then keeps the keys as they are
    return prefix, {key for key in keys if key.startswith(prefix) and _BLOCK_KEY.match(key, len(prefix))}


def _check_block_keys(path: str, diffusion_model: nn.Module, file_keys: set[str]) -> None:
    """The block tensors of the built model must be the file's block tensors, under the same names."""
    model_keys = {f"{path}.{key}" for path in block_list_paths(diffusion_model)
                  for key in diffusion_model.get_submodule(path).state_dict()}
    if missing := model_keys - file_keys:
        raise ValueError(f"ComfyUI renames the keys of {Path(path).name} when it loads it (the model's {min(missing)} "
                         f"is not in the file), so its blocks cannot be read straight into host memory; use Load "
                         f"Diffusion Model followed by Group Offload (no copy-back)")
    if extra := file_keys - model_keys:
        raise ValueError(f"{len(extra)} block tensors of {Path(path).name} belong to no block of "
                         f"{type(diffusion_model).__name__} (e.g. {min(extra)}); use Load Diffusion Model "
                         f"followed by Group Offload (no copy-back)")


def load_offloaded(path: str, model_options: dict, settings: OffloadSettings) -> GroupOffloadPatcher:
    """ComfyUI's ``load_diffusion_model``, with the blocks going straight into pinned host mirrors."""
    st = SafetensorsFile(path)
    if _is_quantized(st):
        raise ValueError(f"{Path(path).name} holds quantized weights, which Group Offload cannot stream yet; "
                         f"load it with Load Diffusion Model")
    prefix, blocks_in_file = block_keys(list(st.entries))
    if not blocks_in_file:
        raise ValueError(f"{Path(path).name} has no transformer blocks this loader knows; "
                         f"use Load Diffusion Model followed by Group Offload (no copy-back)")
    state_dict = {}
    with safetensors.safe_open(path, framework="pt") as f:
        for key in st.entries:
            state_dict[key] = st.placeholder(key) if key in blocks_in_file else f.get_tensor(key)
    extra = {"disable_dynamic": True} if _ACCEPTS_DISABLE_DYNAMIC else {}
    # Newest ComfyUI takes the offload device from the options: under --gpu-only / --highvram its
    # default is the GPU, where it would move the whole model (0.3.75 always uses its default).
    model_options = {**model_options, "offload_device": torch.device("cpu")}
    with _offload_device_on_the_cpu():
        patcher = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options,
                                                           metadata=st.metadata, **extra)
    if patcher is None:
        raise RuntimeError(f"ERROR: Could not detect model type of: {path}")
    del state_dict
    _check_block_keys(path, patcher.model.diffusion_model, {key.removeprefix(prefix) for key in blocks_in_file})
    offloaded = make_offloaded(patcher, settings)

    with open(path, "rb") as file:
        def fill(name: str, view: torch.Tensor) -> None:
            key = prefix + name.removeprefix("diffusion_model.")
            if key not in st.entries:
                raise ValueError(f"{Path(path).name} has no tensor {key} for block weight {name}; "
                                 f"use Load Diffusion Model followed by Group Offload (no copy-back)")
            st.read_into(file, key, view)

        build_engine(offloaded.model, offloaded.blocks(), offloaded.load_device, settings, fill=fill)
    if hasattr(offloaded, "cached_patcher_init"):  # newest ComfyUI's deep clones load the model again through it
        offloaded.cached_patcher_init = (_load_again, (path, model_options, settings))
    return offloaded


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
    """``load_offloaded`` as ComfyUI calls a loader to load a model again (it never makes a dynamic patcher)."""
    return load_offloaded(path, model_options, settings)

"""Load CLIP (Group Offload): ComfyUI's ``load_clip``, with the text encoder's layers left in the mapped files.

ComfyUI's own loading runs unchanged (its key renames, detection, classes, dtypes and quantized layers), on
state dicts whose tensors are views of each file's read-only mapping (``offload_core.map_file``). While it loads,
the copies of the files' matrices into the model's tensors are recorded instead of made (``_DeferredCopies``):
once the model is built and its layers found, the layers' tensors become the views themselves (page cache, not
anonymous memory) and the other copies are made as ComfyUI would have made them. The model's tensors are made
empty, as ComfyUI's layers make them, so the memory of the ones never copied into is never touched. The host
budget then packs what it allows of the layers; the others stream from the files' pages.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import comfy.sd
import comfy.utils

from ..offload_core import flatten, map_file
from .blocks import own_text_encoder_layers
from .handles import build_handle
from .loader import copy_out_of, replace_tensor, tensor_slots
from .safetensors_file import SafetensorsFile
from .settings import OffloadSettings
from .text_encoder import make_offloaded_clip

_ACCEPTS_DISABLE_DYNAMIC = "disable_dynamic" in inspect.signature(comfy.sd.load_clip).parameters


class _DeferredCopies(TorchFunctionMode):
    """Records, instead of making them, the copies of the mapped files' matrices into other tensors: each
    destination's id -> (destination, source view)."""

    def __init__(self, mappings: list[torch.Tensor]) -> None:
        super().__init__()
        self._spans = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in mappings]
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2 and not kwargs and self._deferrable(*args):
            self.copies[id(args[0])] = args
            return args[0]
        return func(*args, **kwargs)

    def _deferrable(self, destination: torch.Tensor, source: torch.Tensor) -> bool:
        """A plain matrix copied whole from a file (ComfyUI reads the smaller tensors' values as it builds)."""
        if type(source) is not torch.Tensor or source.dim() < 2 or destination.shape != source.shape:
            return False
        if flatten(destination)[0] is not None or destination.is_meta:  # (a quantized weight: made of its parts)
            return False
        return any(start <= source.data_ptr() < end for start, end in self._spans)


def _mapped_state_dicts(paths: list[str]) -> tuple[dict[str, tuple[dict, dict | None]], list[torch.Tensor]]:
    """Each file's tensors as views of its read-only mapping, with its metadata; and the mappings."""
    loaded, mappings = {}, []
    for path in paths:
        if not path.lower().endswith(".safetensors"):
            raise ValueError(f"Load CLIP (Group Offload) reads .safetensors files, not {Path(path).name}; load "
                             f"a .gguf text encoder with ComfyUI-GGUF's CLIPLoader (GGUF) and connect it to Group "
                             f"Offload (text encoder)")
        st, mapping = SafetensorsFile(path), map_file(path)
        loaded[str(Path(path).resolve())] = ({key: st.tensor(mapping, key) for key in st.entries}, st.metadata)
        mappings.append(mapping)
    return loaded, mappings


@contextlib.contextmanager
def _files_read_as_views(loaded: dict[str, tuple[dict, dict | None]]) -> Iterator[None]:
    """While ComfyUI loads: its ``load_torch_file`` gives the views for the files in ``loaded``."""
    original = comfy.utils.load_torch_file

    def load_torch_file(ckpt, safe_load=False, device=None, return_metadata=False):
        found = loaded.get(str(Path(ckpt).resolve()))
        if found is None:
            return original(ckpt, safe_load=safe_load, device=device, return_metadata=return_metadata)
        state_dict, metadata = dict(found[0]), found[1]
        return (state_dict, metadata) if return_metadata else state_dict

    comfy.utils.load_torch_file = load_torch_file
    try:
        yield
    finally:
        comfy.utils.load_torch_file = original


def load_offloaded_clip(paths: list[str], clip_type: Any, model_options: dict, settings: OffloadSettings,
                        embedding_directory: Any = None) -> comfy.sd.CLIP:
    """ComfyUI's ``load_clip`` of ``paths`` (its CLIPLoader's), with the text encoder's layers left in the mapped
    files and streamed by Group Offload (text encoder)."""
    loaded, mappings = _mapped_state_dicts(paths)
    # Built on the CPU, never loaded to the GPU whole (ComfyUI does where the card has room); a plain patcher.
    model_options = {**model_options, "initial_device": torch.device("cpu"), "offload_device": torch.device("cpu")}
    extra = {"disable_dynamic": True} if _ACCEPTS_DISABLE_DYNAMIC else {}
    deferred = _DeferredCopies(mappings)
    with _files_read_as_views(loaded), deferred:
        clip = comfy.sd.load_clip(ckpt_paths=paths, embedding_directory=embedding_directory, clip_type=clip_type,
                                  model_options=model_options, **extra)
    text_encoders = clip.patcher.model
    try:
        own_text_encoder_layers(text_encoders)
    except ValueError:
        _make_copies(deferred.copies)  # (the CLIP as ComfyUI loads it, for the error only)
        raise
    _layers_to_the_files(text_encoders, deferred.copies)
    _make_copies(deferred.copies)
    for mapping in mappings:
        copy_out_of(mapping, text_encoders)
    offloaded = make_offloaded_clip(clip, settings)
    build_handle(offloaded.patcher.model, offloaded.patcher.blocks(), offloaded.patcher.load_device, settings)
    if hasattr(offloaded.patcher, "cached_patcher_init"):  # newest ComfyUI loads the model again through it
        offloaded.patcher.cached_patcher_init = (_load_again, (paths, clip_type, model_options, settings,
                                                               embedding_directory))
    return offloaded


def _layers_to_the_files(text_encoders: nn.Module, copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The layers' tensors whose copy was deferred become the files' views (of the model's dtype: a file of
    another dtype is converted, into memory of its own, as ComfyUI's copy converts it)."""
    for _, module, table, attr in tensor_slots(text_encoders, in_blocks=True):
        destination, source = copies.pop(id(table[attr]), (None, None))
        if destination is not None:
            replace_tensor(module, table, attr, [source.to(destination.dtype)])


def _make_copies(copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The deferred copies of the tensors outside the layers, made as ComfyUI would have made them."""
    with torch.no_grad():
        for destination, source in copies.values():
            destination.copy_(source)
    copies.clear()


def _load_again(paths: list[str], clip_type: Any, model_options: dict, settings: OffloadSettings,
                embedding_directory: Any, disable_dynamic: bool = True):
    """``load_offloaded_clip`` as ComfyUI calls a loader to load a model again: its patcher."""
    return load_offloaded_clip(paths, clip_type, model_options, settings, embedding_directory).patcher

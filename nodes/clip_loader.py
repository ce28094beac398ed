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
from torch.utils._pytree import tree_leaves

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


# Torch functions that read no tensor's values (metadata, aliases: ComfyUI's ``module_size`` detaches every weight).
_READS_NO_VALUES = frozenset({
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
    torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.data_ptr, torch.Tensor.detach, torch.Tensor.requires_grad_,
    torch._has_compatible_shallow_copy_type,
})
# Those that give the tensor itself where nothing is to be read (a module moved where it already is).
_SELF_WHEN_NOTHING_READ = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.contiguous})
_CLONES = frozenset({torch.Tensor.clone, torch.clone})


def _storage_key(tensor: object) -> int | None:
    """The address of a plain tensor's (or Parameter's) storage, shared by its aliases; None for anything else."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
        return None
    return tensor.untyped_storage().data_ptr() or None


def _same_region(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _reads_values(func, args: tuple) -> bool:
    """Whether ``func`` may read or write the values of its tensors (setting ``.data`` to an alias does not)."""
    if func in _READS_NO_VALUES or getattr(func, "__name__", None) == "__get__":  # (a property: shape, dtype...)
        return False
    if getattr(func, "__name__", None) == "__set__":
        return len({_storage_key(a) for a in args if isinstance(a, torch.Tensor)}) > 1
    return True


class _DeferredCopies(TorchFunctionMode):
    """Records, instead of making them, the copies of the mapped files' matrices into tensors of the model: a
    ``copy_`` into a tensor, or a ``clone`` (Dynamic VRAM's Linear and Embedding load so), which then gives a new
    empty tensor. A record is kept by its destination's storage (the record keeps it alive, so no other tensor
    can take its address; a Parameter made over the destination shares it). Until the records are taken
    (``record_of``) or made (``make_copies``), a recorded destination that any other torch function reads or
    writes gets its copy first, so a later write stands and a read sees the file's values."""

    def __init__(self, mappings: list[torch.Tensor]) -> None:
        super().__init__()
        self._spans = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in mappings]
        self._records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (destination, source)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2 and not kwargs and self._deferrable(*args):
            self._record(*args)
            return args[0]
        if func in _CLONES and len(args) == 1 and not kwargs and self._deferrable(args[0], args[0]):
            destination = torch.empty_like(args[0])
            self._record(destination, args[0])
            return destination
        used = {key for t in tree_leaves((args, kwargs)) if (key := _storage_key(t)) in self._records}
        if used and func in _SELF_WHEN_NOTHING_READ and (result := func(*args, **kwargs)) is args[0]:
            return result
        if used and _reads_values(func, args):
            self._flush(used)
        return func(*args, **kwargs)

    def _deferrable(self, destination: torch.Tensor, source: torch.Tensor) -> bool:
        """A plain matrix copied whole from a file (ComfyUI reads the smaller tensors' values as it builds)."""
        if type(source) is not torch.Tensor or source.dim() < 2 or destination.shape != source.shape:
            return False
        if flatten(destination)[0] is not None or destination.is_meta:  # (a quantized weight: made of its parts)
            return False
        if _storage_key(destination) is None:
            return False
        return any(start <= source.data_ptr() < end for start, end in self._spans)

    def _record(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """The copy recorded, in place of an earlier one into the same region (overwritten whole); an earlier
        one into another region of the same storage is made first."""
        key = _storage_key(destination)
        earlier = self._records.get(key)
        if earlier is not None and not _same_region(earlier[0], destination):
            self._flush({key})
        self._records[key] = (destination, source)

    def _flush(self, keys: set[int]) -> None:
        with torch.no_grad():
            for key in keys:
                destination, source = self._records.pop(key)
                destination.copy_(source)

    def record_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(destination, source) of the copy recorded into exactly ``tensor`` (or an alias of it), if any."""
        record = self._records.get(_storage_key(tensor))
        return record if record is not None and _same_region(record[0], tensor) else None

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """The records into ``tensors`` dropped: nothing holds their destinations any more."""
        for tensor in tensors:
            self._records.pop(_storage_key(tensor), None)

    def make_copies(self) -> None:
        """The recorded copies still to make, made as ComfyUI would have made them."""
        self._flush(set(self._records))


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
    files and streamed by Group Offload (text encoder), packed now as far as the host budget allows."""
    offloaded = _clip_on_the_files(paths, clip_type, model_options, settings, embedding_directory)
    build_handle(offloaded.patcher.model, offloaded.patcher.blocks(), offloaded.patcher.load_device, settings)
    return offloaded


def _clip_on_the_files(paths: list[str], clip_type: Any, model_options: dict, settings: OffloadSettings,
                       embedding_directory: Any) -> comfy.sd.CLIP:
    """``load_offloaded_clip`` but for the handle, which its patcher builds at its first load."""
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
        deferred.make_copies()  # (the CLIP as ComfyUI loads it, for the error only)
        raise
    _layers_to_the_files(text_encoders, deferred)
    deferred.make_copies()
    for mapping in mappings:
        copy_out_of(mapping, text_encoders)
    offloaded = make_offloaded_clip(clip, settings)
    if hasattr(offloaded.patcher, "cached_patcher_init"):  # newest ComfyUI loads the model again through it
        offloaded.patcher.cached_patcher_init = (_load_again, (paths, clip_type, model_options, settings,
                                                               embedding_directory))
    return offloaded


def _layers_to_the_files(text_encoders: nn.Module, deferred: _DeferredCopies) -> None:
    """The layers' tensors whose copy was deferred become the files' views (of the model's dtype: a file of
    another dtype is converted, into memory of its own, as ComfyUI's copy converts it). Their records go, but for
    a destination that a tensor of the model still holds (tied to a layer's): that one is copied still."""
    replaced = []
    for _, module, table, attr in tensor_slots(text_encoders, in_blocks=True):
        record = deferred.record_of(table[attr])
        if record is not None:
            replaced.append(record[0])
            replace_tensor(module, table, attr, [record[1].to(record[0].dtype)])
    held = {_storage_key(t) for t in (*text_encoders.parameters(), *text_encoders.buffers())}
    deferred.forget([destination for destination in replaced if _storage_key(destination) not in held])


def _load_again(paths: list[str], clip_type: Any, model_options: dict, settings: OffloadSettings,
                embedding_directory: Any, disable_dynamic: bool = True):
    """``load_offloaded_clip`` as ComfyUI calls a loader to load a model again: its patcher, with no handle yet.
    ComfyUI clones it (a deep copy, a multi-GPU copy) and the clone builds the one handle at its first load, for its
    own settings and load device (built here, it would be built again there whenever those differ)."""
    return _clip_on_the_files(paths, clip_type, model_options, settings, embedding_directory).patcher

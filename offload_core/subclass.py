"""Tensor subclasses in packed buffers: wrapper subclasses travel as their inner tensors.

A quantized weight (comfy-kitchen's ``QuantizedTensor``, torchao's tensors) is a *wrapper
subclass*: an outer tensor without storage of its own, whose bytes are inner tensors (the data and
every scale) described by PyTorch's ``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol. Each
inner tensor gets its own segment in a group's buffer, and the outer tensor is rebuilt from views of
that buffer (host mirror or device slab) with its flatten context: never dequantized, never cloned.

Any other tensor subclass (one whose meaning lives outside its bytes and that cannot be rebuilt from
them, such as ComfyUI-GGUF's ``GGMLTensor``) is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class UnpackableTensorError(ValueError):
    """A tensor that a packed buffer cannot hold; ``tensor_type`` says which kind it is."""

    def __init__(self, qualname: str, tensor_type: type) -> None:
        super().__init__(f"{qualname} is a {tensor_type.__name__}, a tensor subclass that does not implement "
                         f"PyTorch's wrapper-subclass protocol (__tensor_flatten__ / __tensor_unflatten__); group "
                         f"offloading packs plain tensors and wrapper subclasses only")
        self.qualname = qualname
        self.tensor_type = tensor_type


def is_wrapper(tensor: torch.Tensor) -> bool:
    return hasattr(type(tensor), "__tensor_flatten__")


def require_packable(tensor: torch.Tensor, qualname: str) -> None:
    """Raise ``UnpackableTensorError`` unless ``tensor`` is plain or a wrapper of plain inner tensors."""
    if is_wrapper(tensor):
        flat, inner = flatten(tensor)
        for name, t in zip(flat.names, inner):
            if type(t) is not torch.Tensor:
                raise UnpackableTensorError(f"{qualname} (its inner tensor {name})", type(t))
    elif type(tensor.data) is not torch.Tensor:
        raise UnpackableTensorError(qualname, type(tensor))


@dataclass(frozen=True)
class Flattened:
    """How to rebuild a wrapper subclass from its inner tensors, wherever they lie."""

    cls: type
    names: tuple[str, ...]
    context: Any
    size: torch.Size
    stride: tuple[int, ...]

    def rebuild(self, inner: list[torch.Tensor]) -> torch.Tensor:
        return self.cls.__tensor_unflatten__(dict(zip(self.names, inner)), self.context, self.size, self.stride)


def flatten(tensor: torch.Tensor) -> tuple[Flattened | None, list[torch.Tensor]]:
    """The recipe to rebuild ``tensor`` (None for a plain tensor) and the tensors that hold its bytes."""
    if not is_wrapper(tensor):
        return None, [tensor]
    names, context = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return Flattened(type(tensor), tuple(names), context, tensor.shape, tensor.stride()), inner


def packed_nbytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` really holds: its inner tensors' for a wrapper (data and scales), not
    ``numel() * element_size()``, which counts a quantized weight at its compute dtype."""
    return sum(t.numel() * t.element_size() for t in flatten(tensor)[1])


def first_inner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory says where ``tensor`` lives (a wrapper has no storage of its own)."""
    return flatten(tensor)[1][0]

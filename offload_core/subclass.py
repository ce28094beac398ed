"""Tensor subclasses in packed buffers: each travels as the plain tensors that hold its bytes.

A quantized weight (comfy-kitchen's ``QuantizedTensor``, torchao's tensors) is a *wrapper
subclass*: an outer tensor without storage of its own, whose bytes are inner tensors (the data and
every scale) described by PyTorch's ``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol. Each
inner tensor gets its own segment in a group's buffer, and the outer tensor is rebuilt from views of
that buffer (host mirror or device slab) with its flatten context: never dequantized, never cloned.

A *plain subclass* (ComfyUI-GGUF's ``GGMLTensor``: ``uint8`` blocks, plus ``tensor_type``,
``tensor_shape`` and ``patches``) holds its bytes in its own storage and its meaning in its
attributes. It packs as those bytes; a Parameter of it keeps its object, whose bytes are re-pointed
at each layout (``.data``), so its attributes, and those set later (a LoRA's ``patches``), stay with
it; a buffer of it is rebuilt as the same class over the view, sharing the original's attributes.
That is sound only when the bytes and the attributes are all there is (``plain_subclass_problem``):
no ``__torch_dispatch__`` of its own, no ``__slots__``, no tensor among its attributes. Any other
subclass is refused.
"""
from __future__ import annotations

import copyreg
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class UnpackableTensorError(ValueError):
    """A tensor that a packed buffer cannot hold; ``tensor_type`` says which kind it is, ``reason`` why."""

    def __init__(self, qualname: str, tensor_type: type, reason: str) -> None:
        super().__init__(f"{qualname} is a {tensor_type.__name__}, a tensor subclass that group offloading cannot "
                         f"rebuild from packed bytes: {reason}. It packs plain tensors, wrapper subclasses "
                         f"(PyTorch's __tensor_flatten__ / __tensor_unflatten__) and plain subclasses whose meaning "
                         f"is their own bytes and their attributes")
        self.qualname = qualname
        self.tensor_type = tensor_type


def is_wrapper(tensor: torch.Tensor) -> bool:
    return hasattr(type(tensor), "__tensor_flatten__")


def plain_subclass(tensor: torch.Tensor) -> type | None:
    """The subclass ``tensor`` is, when it holds its own bytes (not a wrapper); None for a plain tensor."""
    cls = type(tensor)
    if issubclass(cls, nn.Parameter):  # (bitsandbytes' Parameter subclass, say, holds plain data)
        cls = type(tensor.data)
    return None if cls is torch.Tensor or is_wrapper(tensor) else cls


def plain_subclass_problem(tensor: torch.Tensor) -> str | None:
    """Why a plain subclass cannot be rebuilt from its bytes and its attributes; None when it can."""
    cls = type(tensor)
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return "it runs its own __torch_dispatch__, so its operations mean more than its bytes"
    if copyreg._slotnames(cls):
        return f"it keeps state in __slots__ ({', '.join(copyreg._slotnames(cls))})"
    tensors = [name for name, value in vars(tensor).items() if isinstance(value, torch.Tensor)]
    if tensors:
        return (f"its attribute {tensors[0]} is a tensor, which its packed bytes would leave behind (a "
                f"wrapper subclass names such tensors in __tensor_flatten__)")
    return None


def require_packable(tensor: torch.Tensor, qualname: str) -> None:
    """Raise ``UnpackableTensorError`` unless ``tensor`` is plain, a wrapper of plain inner tensors or a
    plain subclass rebuildable from its bytes and attributes."""
    if is_wrapper(tensor):
        flat, inner = flatten(tensor)
        for name, t in zip(flat.names, inner):
            if type(t) is not torch.Tensor:
                raise UnpackableTensorError(f"{qualname} (its inner tensor {name})", type(t),
                                            "a wrapper's inner tensors must be plain tensors")
        return
    cls = plain_subclass(tensor)
    problem = None if cls is None else plain_subclass_problem(tensor)
    if problem is not None:
        raise UnpackableTensorError(qualname, cls, problem)


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


@dataclass(frozen=True, eq=False)
class Attributed:
    """How to rebuild a plain subclass over a view of its bytes: its class, and the original's attributes,
    shared (not copied), so that every layout's tensor is the same weight to whoever sets one later."""

    cls: type
    attributes: dict[str, Any]

    def rebuild(self, inner: list[torch.Tensor]) -> torch.Tensor:
        tensor = inner[0].as_subclass(self.cls)
        tensor.__dict__ = self.attributes
        return tensor


def flatten(tensor: torch.Tensor) -> tuple[Flattened | Attributed | None, list[torch.Tensor]]:
    """The recipe to rebuild ``tensor`` (None for a plain tensor) and the plain tensors that hold its bytes."""
    if not is_wrapper(tensor):
        cls = plain_subclass(tensor)
        if cls is None:
            return None, [tensor]
        return Attributed(cls, tensor.__dict__), [tensor.as_subclass(torch.Tensor)]
    names, context = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return Flattened(type(tensor), tuple(names), context, tensor.shape, tensor.stride()), inner


def packed_nbytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` really holds: its inner tensors' for a wrapper (data and scales), its raw
    bytes for a plain subclass, not ``numel() * element_size()`` of its shape, which counts a quantized
    weight at its compute dtype (or a ``GGMLTensor`` at its dequantized shape)."""
    return sum(t.numel() * t.element_size() for t in flatten(tensor)[1])


def first_inner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory says where ``tensor`` lives (a wrapper has no storage of its own)."""
    return flatten(tensor)[1][0]

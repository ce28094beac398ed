"""A group of consecutive blocks and the tensors it owns.

The group decides *how* its tensors move: it re-points every parameter and buffer at a set of
views (of the host mirror, of a device slab, or of its own resident buffer).  It never copies on
its own; the scheduler in ``engine.py`` decides *when*.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .mirror import HostMirror, Pinner, pack_layout, packed_buffer, segment_views

#: Writes a tensor's weights into its host-mirror view (the loader reads a file straight in).
FillFn = Callable[[str, torch.Tensor], None]


class _Binding:
    """Every place one packed tensor is referenced from: a Parameter, and/or buffer slots."""

    __slots__ = ("qualname", "param", "buffer_slots")

    def __init__(self, qualname: str, param: nn.Parameter | None) -> None:
        self.qualname = qualname
        self.param = param
        self.buffer_slots: list[tuple[dict, str]] = []

    def points_at(self, tensor: torch.Tensor) -> bool:
        current = self.param if self.param is not None else self.buffer_slots[0][0][self.buffer_slots[0][1]]
        return current.data_ptr() == tensor.data_ptr()

    def point_at(self, tensor: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = tensor
        for slots, name in self.buffer_slots:
            slots[name] = tensor


def _require_plain(tensor: torch.Tensor, qualname: str) -> None:
    """Only plain tensors can live in a packed byte buffer; a tensor subclass (e.g. a quantized
    weight that carries its own scales) would lose what it holds besides its data."""
    if type(tensor.data) is not torch.Tensor:
        raise ValueError(f"{qualname} is a {type(tensor.data).__name__}; group offloading packs plain tensors "
                         f"only, so quantized weights cannot be offloaded yet")


def check_offloadable(blocks: list[nn.Module]) -> None:
    """Raise ``ValueError`` if a block holds a tensor that cannot be packed into a host mirror."""
    for block in blocks:
        for name, tensor in (*block.named_parameters(), *block.named_buffers()):
            _require_plain(tensor, name)


def _collect(blocks: list[nn.Module], qualnames: dict[int, str]) -> tuple[list[_Binding], list[torch.Tensor]]:
    """The group's tensors, each once: a tied parameter (one Parameter object) stays one binding."""
    by_id: dict[int, _Binding] = {}
    bindings, tensors = [], []
    for block in blocks:
        for module in block.modules():
            prefix = qualnames[id(module)]
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    binding = by_id.get(id(tensor))
                    if binding is None:
                        _require_plain(tensor, prefix + name)
                        binding = _Binding(prefix + name, tensor if kind == "param" else None)
                        by_id[id(tensor)] = binding
                        bindings.append(binding)
                        tensors.append(tensor)
                    if kind == "buffer":
                        binding.buffer_slots.append((table, name))
    # Parameters first: ``ModuleGroup.bind`` zips them with the leading views in one tight loop.
    order = sorted(range(len(bindings)), key=lambda i: bindings[i].param is None)
    return [bindings[i] for i in order], [tensors[i] for i in order]


class ModuleGroup:
    """Consecutive blocks whose tensors travel together in one packed copy."""

    def __init__(self, index: int, blocks: list[nn.Module], qualnames: dict[int, str], fill: FillFn | None) -> None:
        self.index = index
        self.blocks = blocks
        self.bindings, tensors = _collect(blocks, qualnames)
        # The buffers are of the tensors' own kind: a Parameter made under inference mode (as ComfyUI
        # makes them) cannot take a normal tensor as its ``.data``, nor a normal Parameter an inference
        # one (it would fail in backward once offloading is removed), whatever mode this runs under.
        self.inference = any(t.is_inference() for t in tensors)
        with torch.inference_mode(self.inference):
            self._pack(tensors, fill)
        self._params = [b.param for b in self.bindings if b.param is not None]
        self._buffer_slots = [(slots, name, i) for i, b in enumerate(self.bindings) for slots, name in b.buffer_slots]
        self.resident = False
        self.slab: torch.Tensor | None = None  # the device buffer the group occupies, if any
        self.ready: torch.cuda.Event | None = None  # recorded when the copy into ``slab`` is done
        self.parked = False  # on the device, but the modules point at the mirror until the next use
        self.running = 0  # forwards of its blocks in progress
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # slab data_ptr -> layout in it

    def _pack(self, tensors: list[torch.Tensor], fill: FillFn | None) -> None:
        segments, nbytes = pack_layout(tensors)
        adopted = None if fill is not None else packed_buffer(tensors, segments, nbytes)
        self.mirror = HostMirror(segments, nbytes, adopted)
        for i, (binding, view) in enumerate(zip(self.bindings, self.mirror.views)):
            if fill is not None:
                fill(binding.qualname, view)
            elif adopted is None:
                view.copy_(tensors[i])
            binding.point_at(view)
            tensors[i] = None  # the old storage goes now: host memory holds at most one tensor twice

    @property
    def nbytes(self) -> int:
        return self.mirror.nbytes

    @property
    def onloaded(self) -> bool:
        return self.slab is not None

    def qualnames(self) -> list[str]:
        return [b.qualname for b in self.bindings]

    def pin(self, pinner: Pinner, drain: Callable[[], None] | None = None) -> bool:
        return self.mirror.pin(pinner, drain)

    def bind(self, views: list[torch.Tensor]) -> None:
        """Point every parameter and buffer at ``views``; the hot path, so two plain loops."""
        for param, view in zip(self._params, views):
            param.data = view
        for slots, name, i in self._buffer_slots:
            slots[name] = views[i]

    def _device_layout(self, slab: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The part of ``slab`` the group fills, and its per-tensor views; cached, since building
        views costs more than the whole re-pointing."""
        key = slab.data_ptr()
        if key not in self._views:
            self._views[key] = (slab[: self.nbytes], segment_views(slab, self.mirror.segments))
        return self._views[key]

    def device_views(self, slab: torch.Tensor) -> list[torch.Tensor]:
        return self._device_layout(slab)[1]

    def onload_(self, slab: torch.Tensor, non_blocking: bool) -> list[torch.Tensor]:
        """Copy the mirror into ``slab`` (one copy) and point the modules at it."""
        target, views = self._device_layout(slab)
        target.copy_(self.mirror.buffer, non_blocking=non_blocking)
        self.bind(views)
        self.slab = slab
        return views

    def offload_(self) -> torch.Tensor | None:
        """Point the modules back at the mirror (no copy) and hand the slab back."""
        self.bind(self.mirror.views)
        slab, self.slab, self.ready, self.parked = self.slab, None, None, False
        return slab

    def park(self) -> None:
        """Point the modules at the mirror but keep the device copy, for ``unpark`` to take up again."""
        self.bind(self.mirror.views)
        self.parked = True

    def unpark(self) -> None:
        self.bind(self.device_views(self.slab))
        self.parked = False

    def drop_device_views(self) -> None:
        """Forget the cached views, so that freed slabs are not kept alive by them."""
        self._views.clear()

    def release(self) -> None:
        """Drop device views and pinned memory; the modules keep computing from ordinary host memory.

        Tensors that someone else has re-pointed meanwhile (moved to another device, say) stay as they are.
        """
        if self.slab is not None:
            for binding, view, mirror_view in zip(self.bindings, self.device_views(self.slab), self.mirror.views):
                if binding.points_at(view):
                    binding.point_at(mirror_view)
        self.slab, self.ready, self.parked = None, None, False
        self.drop_device_views()
        self.mirror.unpin()

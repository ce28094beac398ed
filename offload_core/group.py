"""A group of consecutive blocks and the tensors it owns.

The group decides *how* its tensors move: it re-points every parameter and buffer at a set of
views (of the host mirror, of a device slab, or of its own resident buffer).  It copies only when
the transfers (``transfers.py``) ask it to; the hooks (``hooks.py``) decide *when*.
"""
from __future__ import annotations

import copyreg
from concurrent.futures import Future
from typing import Callable, Sequence

import torch
from torch import nn

from .hostmem import FileMappings, SourceFiles
from .mirror import CopyFn, HostMirror, InPlaceMirror, Pinner, pack_layout, packed_buffer, segment_views, slot_bytes
from .subclass import Attributed, Flattened, first_inner, flatten, is_wrapper, require_packable

#: Writes a tensor's weights into its host-mirror copy (the loader reads a file straight in); a
#: wrapper subclass comes rebuilt over its mirror views, so that writing its inner tensors fills them.
FillFn = Callable[[str, torch.Tensor], None]

HOST = -1  # the layout key of the host mirror; a device slab's is its data_ptr


class _Binding:
    """Every place one packed tensor is referenced from: a Parameter, and/or buffer slots.

    ``first`` / ``last`` delimit its inner tensors in the group's packed layout (one for a plain tensor).
    """

    __slots__ = ("qualname", "param", "buffer_slots", "first", "last")

    def __init__(self, qualname: str, param: nn.Parameter | None) -> None:
        self.qualname = qualname
        self.param = param
        self.buffer_slots: list[tuple[dict, str]] = []
        self.first = self.last = 0

    def current(self) -> torch.Tensor:
        return self.param if self.param is not None else self.buffer_slots[0][0][self.buffer_slots[0][1]]

    def shows(self, views: list[torch.Tensor]) -> bool:
        """Whether the module still sees the layout of ``views`` (nobody re-pointed it meanwhile)."""
        return first_inner(self.current()).data_ptr() == views[self.first].data_ptr()

    def tensor_over(self, views: list[torch.Tensor]) -> torch.Tensor:
        """This tensor as it lies in ``views`` (a layout's per-segment views)."""
        return views[self.first]

    def show(self, key: int, views: list[torch.Tensor]) -> None:
        """Point the module at this tensor's part of ``views`` (the layout ``key`` names)."""
        tensor = views[self.first]
        if self.param is not None:
            self.param.data = tensor
        for slots, name in self.buffer_slots:
            slots[name] = tensor


class _WrapperBinding(_Binding):
    """A wrapper subclass (a quantized weight), or a buffer of a plain subclass: rebuilt per layout from its views.

    A Parameter keeps its identity: its content is exchanged (as ``torch.utils.swap_tensors`` does,
    see ``show``) with a tensor rebuilt for the wanted layout, which then holds the layout shown
    before, for the next exchange back (assigning ``.data`` would replace only the outer shell, not
    the inner tensors).
    """

    __slots__ = ("flat", "inference", "_held", "_shown", "_lean")

    def __init__(self, qualname: str, param: nn.Parameter | None, flat: Flattened | Attributed,
                 inference: bool) -> None:
        super().__init__(qualname, param)
        self.flat = flat
        self.inference = inference
        self._held: dict[int, torch.Tensor] = {}  # layout key -> a tensor holding that layout
        self._shown: int | None = None  # the layout the Parameter shows; None: its original tensors
        self._lean = _SWAP_IMPL is not None and not copyreg._slotnames(flat.cls)

    def tensor_over(self, views: list[torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode(self.inference):
            tensor = self.flat.rebuild(views[self.first : self.last])
        if self.param is not None:
            tensor._is_param = True  # what ``nn.Parameter`` marks a subclass with; it travels with the swap
        return tensor

    def show(self, key: int, views: list[torch.Tensor]) -> None:
        if self.param is None:
            tensor = self._held.get(key)
            if tensor is None:
                tensor = self._held[key] = self.tensor_over(views)
            for slots, name in self.buffer_slots:
                slots[name] = tensor
            return
        if key == self._shown:
            return
        holder = self._held.pop(key, None)
        if holder is None:
            holder = self.tensor_over(views)
        param = self.param
        if self._lean and param._use_count() == 1:
            # swap_tensors at a quarter of its cost (1 µs, not 4: paid per quantized weight, twice per
            # group and pass): one class, no slots, so the Python state and the C++ tensor are all there
            # is. Weak references to the Parameter (torch.compile's guards) stay with it, as they should.
            param.__dict__, holder.__dict__ = holder.__dict__, param.__dict__
            _SWAP_IMPL(param, holder)
        else:  # another user of the C++ tensor (an autograd graph): swap_tensors decides, or refuses clearly
            torch.utils.swap_tensors(param, holder)
        if self._shown is not None:  # (the original tensors are let go)
            self._held[self._shown] = holder
        self._shown = key

    def forget_device_layouts(self) -> None:
        self._held = {key: t for key, t in self._held.items() if key == HOST}

    def forget_host_layout(self) -> None:
        """The host copy is another from now on: the next ``show(HOST, ...)`` rebuilds over its views."""
        self._held.clear()
        if self.param is not None and self._shown == HOST:
            self._shown = None  # (the layout it shows now goes at the next exchange)


def _file_views(inner: list[torch.Tensor], mappings: FileMappings,
                sources: SourceFiles) -> list[torch.Tensor | None] | None:
    """Aliases of those of ``inner`` that lie in read-only file mappings (each file then needed in ``sources``),
    None for the others; None where none does."""
    found = [mappings.find(t) for t in inner]
    found = [None if mapping is None or mapping.writable else mapping for mapping in found]  # (a written page
    if all(mapping is None for mapping in found):  # is not the file's)
        return None
    for mapping, tensor in zip(found, inner):
        if mapping is not None:
            sources.add(mapping, tensor)
    return [None if mapping is None else t.detach() for mapping, t in zip(found, inner)]


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


_SWAP_IMPL = getattr(torch._C, "_swap_tensor_impl", None)  # what ``torch.utils.swap_tensors`` ends with


def split_into_groups(blocks: Sequence[nn.Module], blocks_per_group: int) -> list[list[nn.Module]]:
    """Consecutive blocks, ``blocks_per_group`` to a group (the last one may hold fewer): the one place
    that cuts blocks into groups."""
    return [list(blocks[i : i + blocks_per_group]) for i in range(0, len(blocks), blocks_per_group)]


def check_offloadable(blocks: list[nn.Module]) -> None:
    """Raise ``UnpackableTensorError`` if a block holds a tensor that cannot be packed into a host mirror."""
    for block in blocks:
        for name, tensor in (*block.named_parameters(), *block.named_buffers()):
            require_packable(tensor, name)


def check_unshared(model: nn.Module, chunks: list[list[nn.Module]], qualnames: dict[int, str]) -> None:
    """Raise ``ValueError`` for a tensor that two groups, or a group and the rest of ``model``, hold
    (``qualnames``: each module's name in ``model``, with its trailing dot).

    Each group streams its own copy of its tensors: a shared one would be read from another group's
    slab while that slab is being refilled, or from a host mirror by a kernel on the device.
    """
    owner: dict[int, tuple[int, str]] = {}
    for index, chunk in enumerate(chunks):
        for module in (m for block in chunk for m in block.modules()):
            for name, tensor in _own_tensors(module):
                first = owner.setdefault(id(tensor), (index, qualnames[id(module)] + name))
                if first[0] != index:
                    raise ValueError(f"{qualnames[id(module)] + name} is the same tensor as {first[1]} in another "
                                     f"group: a tensor shared between groups cannot be streamed (raise blocks_per_group "
                                     f"so that both blocks form one group, or untie it)")
    inside = {id(m) for chunk in chunks for block in chunk for m in block.modules()}
    for module in (m for m in model.modules() if id(m) not in inside):
        for name, tensor in _own_tensors(module):
            if id(tensor) in owner:
                raise ValueError(f"{owner[id(tensor)][1]} is also held outside the offloaded blocks, as "
                                 f"{qualnames[id(module)] + name}: a tensor the rest of the model uses cannot be streamed")


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for table in (module._parameters, module._buffers) for name, t in table.items() if t is not None]


def _collect(blocks: list[nn.Module], qualnames: dict[int, str]) -> list[tuple[str, torch.Tensor, bool, list]]:
    """The group's tensors, each once, as (qualname, tensor, is a Parameter, buffer slots): a tied
    parameter (one Parameter object) stays one entry."""
    by_id: dict[int, int] = {}
    found: list[tuple[str, torch.Tensor, bool, list[tuple[dict, str]]]] = []
    for block in blocks:
        for module in block.modules():
            prefix = qualnames[id(module)]
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if id(tensor) not in by_id:
                        require_packable(tensor, prefix + name)
                        by_id[id(tensor)] = len(found)
                        found.append((prefix + name, tensor, kind == "param", []))
                    if kind == "buffer":
                        found[by_id[id(tensor)]][3].append((table, name))
    # Plain Parameters first: ``ModuleGroup.bind`` zips them with the leading views in one tight loop.
    return sorted(found, key=lambda entry: (not entry[2], is_wrapper(entry[1])))


#: Where a group's tensors lie: the file mappings, and the files they map (kept in place beyond the host budget
#: or, packed, the files the group can be given back to).
InPlace = tuple[FileMappings, SourceFiles]


class ModuleGroup:
    """Consecutive blocks whose tensors travel together in one packed copy (on the device; on the host,
    a packed mirror, or the tensors where they are when not ``packed``).

    ``files``: where the tensors may lie in mapped files. A group kept in place reads them there. Given
    ``returnable_files``, a packed group keeps aliases of its tensors that lie in read-only file mappings
    (``returnable_bytes``), so that its packed mirror can be given up later (``return_to_files``); their files are
    added to ``returnable_files``, whose identity the caller seals.
    """

    def __init__(self, index: int, blocks: list[nn.Module], qualnames: dict[int, str], fill: FillFn | None,
                 files: InPlace | None = None, packed: bool = True, returnable_files: SourceFiles | None = None,
                 ) -> None:
        self.index = index
        self.blocks = blocks
        found = _collect(blocks, qualnames)
        flattened = [flatten(tensor) for _, tensor, _, _ in found]
        inner = [t for _, tensors in flattened for t in tensors]
        # The buffers are of the tensors' own kind: a Parameter made under inference mode (as ComfyUI
        # makes them) cannot take a normal tensor as its ``.data``, nor a normal Parameter an inference
        # one (it would fail in backward once offloading is removed), whatever mode this runs under.
        self.inference = any(t.is_inference() for t in inner)
        self.bindings: list[_Binding] = []
        for (qualname, tensor, is_param, slots), (flat, tensors) in zip(found, flattened):
            param = tensor if is_param else None
            # A Parameter of a plain subclass keeps its object (and its attributes): only its bytes are re-pointed.
            repointed = flat is None or (param is not None and isinstance(flat, Attributed))
            binding = _Binding(qualname, param) if repointed else _WrapperBinding(qualname, param, flat, self.inference)
            binding.buffer_slots = slots
            binding.first = self.bindings[-1].last if self.bindings else 0
            binding.last = binding.first + len(tensors)
            self.bindings.append(binding)
        del found, flattened
        # A packed group's tensors in their files, None for those outside them (``returnable_bytes``).
        self._file_views: list[torch.Tensor | None] | None = None
        with torch.inference_mode(self.inference):
            if packed:
                if fill is None and files is not None and returnable_files is not None:
                    self._file_views = _file_views(inner, files[0], returnable_files)
                self._pack(inner, fill)
            else:
                self._keep_in_place(inner, *files)
        plain = [b for b in self.bindings if type(b) is _Binding]
        self._params = [b.param for b in plain if b.param is not None]
        self._buffer_slots = [(slots, name, b.first) for b in plain for slots, name in b.buffer_slots]
        self._wrappers = [b for b in self.bindings if type(b) is not _Binding]
        self.resident = False
        self.slab: torch.Tensor | None = None  # the device buffer the group occupies, if any
        self.ready: torch.cuda.Event | None = None  # recorded when the copy into ``slab`` is done
        self.pending: Future | None = None  # a staged copy the gather worker has yet to queue; its result: ``ready``
        self.parked = False  # on the device, but the modules point at the mirror until the next use
        self.running = 0  # forwards of its blocks in progress
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # slab data_ptr -> layout in it

    def _pack(self, inner: list[torch.Tensor | None], fill: FillFn | None) -> None:
        segments, nbytes = pack_layout(inner)
        adopted = None if fill is not None else packed_buffer(inner, segments, nbytes)
        self.mirror = HostMirror(segments, nbytes, adopted)
        views = self.mirror.views
        for binding in self.bindings:
            if fill is not None:
                fill(binding.qualname, binding.tensor_over(views))
            elif adopted is None:
                for i in range(binding.first, binding.last):
                    views[i].copy_(inner[i])
            binding.show(HOST, views)
            inner[binding.first : binding.last] = [None] * (binding.last - binding.first)  # the old storage
            # goes now: host memory holds at most one tensor twice

    def _keep_in_place(self, inner: list[torch.Tensor], mappings: FileMappings, sources: SourceFiles) -> None:
        segments, nbytes = pack_layout(inner)
        # Aliases, not the tensors themselves: a Parameter re-pointed at a slab must not take its mirror along.
        self.mirror = InPlaceMirror(segments, nbytes, [t.detach() for t in inner], mappings, sources)
        for binding in self.bindings:
            binding.show(HOST, self.mirror.views)

    @property
    def returnable_bytes(self) -> int:
        """The packed bytes ``return_to_files`` would free (0: it cannot give its packed mirror up): the slots of
        the tensors that lie in files."""
        if self._file_views is None:
            return 0
        slots = slot_bytes(self.mirror.segments, self.mirror.nbytes)
        return sum(slot for slot, view in zip(slots, self._file_views) if view is not None)

    def return_to_files(self, mappings: FileMappings, sources: SourceFiles) -> int:
        """Give the packed mirror (and its pin) up: the tensors are their file views again (those that were in no
        file, a norm's vector say, copied out of the mirror), kept in place from now on; returns the bytes of
        them in files (``returnable_bytes``: the host memory freed, but for the copies). The group must be off the
        device (``offload_``)."""
        freed = self.returnable_bytes
        self.mirror.unpin()
        with torch.inference_mode(self.inference):
            views = [view if view is not None else packed.clone()
                     for view, packed in zip(self._file_views, self.mirror.views)]
            self._file_views = None
            for binding in self._wrappers:
                binding.forget_host_layout()
            self._keep_in_place(views, mappings, sources)
        return freed

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

    def host_tensors(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The named tensors of this group over its host copy (``HostMirror.own_view``: never a view of a file)."""
        views = list(self.mirror.views)
        tensors = {}
        for binding in self.bindings:
            if binding.qualname in names:
                parts = range(binding.first, binding.last)
                views[binding.first : binding.last] = [self.mirror.own_view(i) for i in parts]
                with torch.inference_mode(self.inference):
                    tensors[binding.qualname] = binding.tensor_over(views)
        return tensors

    def bind(self, key: int, views: list[torch.Tensor]) -> None:
        """Point every parameter and buffer at ``views`` (the layout ``key`` names); the hot path."""
        for param, view in zip(self._params, views):
            param.data = view
        for slots, name, i in self._buffer_slots:
            slots[name] = views[i]
        for binding in self._wrappers:
            binding.show(key, views)

    def _device_layout(self, slab: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The part of ``slab`` the group fills, and its per-tensor views; cached, since building
        views costs more than the whole re-pointing."""
        key = slab.data_ptr()
        if key not in self._views:
            # Views made under inference mode are inference tensors (the runs are): of the tensors' own kind
            # instead, or torch may take another kernel for them than for ComfyUI's weights (see ``__init__``).
            with torch.inference_mode(self.inference):
                self._views[key] = (slab[: self.nbytes], segment_views(slab, self.mirror.segments))
        return self._views[key]

    def device_views(self, slab: torch.Tensor) -> list[torch.Tensor]:
        return self._device_layout(slab)[1]

    def fill(self, slab: torch.Tensor, non_blocking: bool, source: torch.Tensor | None = None) -> int:
        """Copy the group's bytes into ``slab``: from ``source`` (a staging buffer holding them) in one copy,
        else from the mirror (a packed one in one copy; tensors in place one by one, on the host: no
        ``non_blocking``). Returns the bytes a gather read from a disk."""
        target = self._device_layout(slab)[0]
        if source is not None or self.mirror.packed:
            target.copy_(self.mirror.buffer if source is None else source, non_blocking=non_blocking)
            return 0
        return self.gather_into(target, _copy)

    def gather_into(self, target: torch.Tensor, copy: CopyFn) -> int:
        """The group's bytes into ``target`` (a host buffer) by ``copy``; the bytes read from a disk."""
        return self.mirror.gather_into(target, copy)

    def show(self, slab: torch.Tensor) -> None:
        """Point the modules at their views of ``slab`` (the bytes arrive there before they run)."""
        self.bind(slab.data_ptr(), self.device_views(slab))
        self.slab = slab

    def device_tensor(self, index: int) -> torch.Tensor:
        """What the modules see of binding ``index`` while the group is on the device."""
        binding = self.bindings[index]
        return binding.current() if type(binding) is not _Binding else self.device_views(self.slab)[binding.first]

    def offload_(self) -> torch.Tensor | None:
        """Point the modules back at the mirror (no copy) and hand the slab back."""
        self.bind(HOST, self.mirror.views)
        slab, self.slab, self.ready, self.pending, self.parked = self.slab, None, None, None, False
        return slab

    def park(self) -> None:
        """Point the modules at the mirror but keep the device copy, for ``unpark`` to take up again."""
        self.bind(HOST, self.mirror.views)
        self.parked = True

    def unpark(self) -> None:
        self.bind(self.slab.data_ptr(), self.device_views(self.slab))
        self.parked = False

    def drop_device_views(self) -> None:
        """Forget the cached views, so that freed slabs are not kept alive by them."""
        self._views.clear()
        for binding in self._wrappers:
            binding.forget_device_layouts()

    def release(self) -> None:
        """Drop device views and pinned memory; the modules keep computing from ordinary host memory.

        Tensors that someone else has re-pointed meanwhile (moved to another device, say) stay as they are.
        """
        if self.slab is not None:
            views = self.device_views(self.slab)
            for binding in self.bindings:
                if binding.shows(views):
                    binding.show(HOST, self.mirror.views)
        self.slab, self.ready, self.pending, self.parked = None, None, None, False
        self.drop_device_views()
        self.mirror.unpin()

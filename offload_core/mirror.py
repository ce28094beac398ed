"""Packed host mirrors: every tensor of a group in one contiguous (optionally pinned) byte buffer.

A group's parameters and buffers are laid out back to back in a single ``uint8`` buffer, each
segment aligned so that it can be viewed as its own dtype.  One buffer per group means one
host-to-device copy per group, whatever mix of dtypes it holds.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from .gather import dense_on_host
from .hostmem import FileMappings, FilePages, FileRead, SourceFiles, advise_will_need, uncached_bytes

log = logging.getLogger(__name__)

ALIGNMENT = 256  # bytes; what CUDA's allocator guarantees, so device views stay kernel-friendly


@dataclass(frozen=True)
class Segment:
    """Where one tensor lives inside a packed buffer."""

    offset: int
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def pack_layout(tensors: list[torch.Tensor]) -> tuple[list[Segment], int]:
    """Aligned segments for ``tensors`` and the total size of the buffer that holds them."""
    segments, cursor = [], 0
    for t in tensors:
        segments.append(Segment(cursor, t.dtype, t.shape))
        cursor += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    return segments, cursor


def slot_bytes(segments: list[Segment], nbytes: int) -> list[int]:
    """Each segment's slot in a buffer of ``nbytes`` (its bytes and the alignment after it), as a group counts them."""
    ends = [s.offset for s in segments[1:]] + [nbytes]
    return [end - s.offset for s, end in zip(segments, ends)]


def segment_views(buffer: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """Typed, shaped views of ``buffer`` (a flat ``uint8`` tensor) for each segment."""
    return [_bytes_of(buffer, s).view(s.dtype).view(s.shape) for s in segments]


class Pinner(Protocol):
    """Registers host memory for DMA in place (no copy, exact size) and releases it again."""

    def pin(self, buffer: torch.Tensor) -> bool: ...

    def unpin(self, buffer: torch.Tensor) -> None: ...


#: ``cudaHostRegisterPortable``: page-locked for every CUDA context, as torch and ComfyUI register.
HOST_REGISTER_PORTABLE = 1


class CudaHostRegister:
    """Pins existing host memory with ``cudaHostRegister``, portable, from the onload device's context.

    torch's own pinned allocator rounds every block up to a power of two (a 680 MB group would pin
    1 GiB); registering the buffer we already have pins exactly its size and copies nothing.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        cuda = device is not None and torch.device(device).type == "cuda"
        self.device = torch.device(device) if cuda else None  # (a CPU "device" in the tests has no context)

    def pin(self, buffer: torch.Tensor) -> bool:
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            return False
        with torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext():
            return torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, HOST_REGISTER_PORTABLE) == 0

    def unpin(self, buffer: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


#: Copies host bytes into a host buffer: (target, source) -> None (the runtime's ``host_copy``).
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


@runtime_checkable
class ManyCopy(Protocol):
    """A ``CopyFn`` that also copies many pairs, and does reads around the page cache, in one call
    (``gather.HostCopy``): a gather's whole group."""

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> None: ...

    def many(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             reads: Sequence[FileRead] = ()) -> None: ...


class HostMirror:
    """The host copy of one group: a packed buffer, its typed views and its pinned state."""

    packed = True

    def __init__(self, segments: list[Segment], nbytes: int, buffer: torch.Tensor | None = None) -> None:
        self.segments = segments
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer
        self.views = segment_views(self.buffer, segments)
        self._unpin: weakref.finalize | None = None

    def pin(self, pinner: Pinner, drain: Callable[[], None] | None = None) -> bool:
        """Pin the buffer; ``drain`` waits for the copies that read it, before it is unpinned.

        It is unpinned by ``unpin()`` or, failing that, when the mirror is garbage-collected.
        """
        if pinner.pin(self.buffer):
            self._unpin = weakref.finalize(self, _unpin, pinner, self.buffer, drain)
            self._unpin.atexit = False  # at exit the process's memory goes anyway
        return self.pinned

    @property
    def pinned(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    def unpin(self) -> None:
        """Return the page-locked memory; the buffer stays valid as ordinary host memory."""
        if self._unpin is not None:
            self._unpin()

    def own_view(self, index: int) -> torch.Tensor:
        """Segment ``index``'s tensor in memory the pack owns: its view of the packed buffer."""
        return self.views[index]

    def gather_into(self, target: torch.Tensor, copy: CopyFn) -> int:
        """Copy the packed bytes into ``target`` (a host buffer); returns 0, the bytes read from a disk."""
        copy(target[: self.nbytes], self.buffer)
        return 0


class InPlaceMirror:
    """The host copy of a group beyond the host budget: its tensors where they already are (views of a
    mapped file, or the model's own), never copied on the host but gathered into a packed buffer (a
    staging buffer, or the device slab itself) at each onload. It is never pinned."""

    packed = False
    pinned = False

    def __init__(self, segments: list[Segment], nbytes: int, tensors: list[torch.Tensor], mappings: FileMappings,
                 sources: SourceFiles) -> None:
        self.segments = segments
        self.nbytes = nbytes
        self.views = list(tensors)
        self._file_backed = []
        self._pages: list[FilePages | None] = []  # per tensor: where its pages can be released from, if they can
        for tensor in self.views:
            mapping = mappings.find(tensor)
            self._file_backed.append(mapping is not None)
            self._pages.append(None if mapping is None else sources.add(mapping, tensor))
        self.file_backed_bytes = sum(slot for slot, mapped in zip(slot_bytes(segments, nbytes), self._file_backed) if mapped)
        # The group's leading bytes whose pages stay in the page cache between gathers (``keep_cached``); the
        # pages past them are released after each gather.
        self.cached_bytes = nbytes

    def pin(self, pinner: Pinner, drain: Callable[[], None] | None = None) -> bool:
        return False

    def unpin(self) -> None:
        pass

    def own_view(self, index: int) -> torch.Tensor:
        """Segment ``index``'s tensor in memory of its own: a copy where it lies in a mapped file (read now)."""
        return self.views[index].clone() if self._file_backed[index] else self.views[index]

    @property
    def reads_around_cache(self) -> bool:
        """Whether every mapped tensor's pages past ``cached_bytes`` are read around the page cache at a gather (its
        file reads so: ``hostmem.open_direct``), so that gathering them holds no page of the cache."""
        return all(pages is None or pages.direct is not None for pages in self._pages)

    def read_ahead(self) -> None:
        """Have the kernel start reading the mapped tensors from the disk into the page cache, ahead of the gather:
        those a gather reads through it (not those read around it, whose pages would only crowd the cache)."""
        around = self._read_around_cache(self._released_from())
        for i, view in enumerate(self.views):
            if self._file_backed[i] and i not in around:
                advise_will_need(view)

    def mapped_views(self) -> list[torch.Tensor]:
        """The tensors that lie in file mappings."""
        return [view for view, mapped in zip(self.views, self._file_backed) if mapped]

    def gather_into(self, target: torch.Tensor, copy: CopyFn) -> int:
        """Copy every tensor into its segment of ``target`` (a packed host or device buffer); returns the
        bytes whose pages the page cache did not hold as the gather began (read from the disk; a page two
        tensors share counts for each). A ``copy`` that copies many pairs at once (``gather.HostCopy``)
        is given the whole group.

        The mapped bytes past ``cached_bytes`` are not to stay in the page cache. Where their file reads so,
        they are read around it, straight from the disk into ``target`` (``FilePages.read_around_cache``): the
        group being gathered then holds no page of the cache, which is the kept groups' room. Elsewhere they
        are read through the page cache, and their pages leave it after the gather. Either way the next read
        of them goes to the disk, and the pages kept cached stay."""
        from_disk = sum(uncached_bytes(view) or 0 for view in self.mapped_views())
        released = self._released_from()
        intos = segment_views(target, self.segments)
        around = self._read_around_cache(released, intos)
        for i, skip in released.items():
            if i not in around:
                self._pages[i].read_forward(self.views[i], skip)
        copied = [i for i in range(len(intos)) if i not in around]
        reads = [self._pages[i].read_around_cache(_bytes_of(target, self.segments[i]), self.views[i], skip)
                 for i, skip in around.items()]
        if isinstance(copy, ManyCopy):
            copy.many([intos[i] for i in copied], [self.views[i] for i in copied], reads)
        else:
            for i in copied:
                copy(intos[i], self.views[i])
            for read in reads:
                read()
        for i, skip in released.items():
            self._pages[i].release(self.views[i], skip)  # (read around it: pages cached before, at a load say)
        return from_disk

    def _read_around_cache(self, released: dict[int, int],
                           intos: list[torch.Tensor] | None = None) -> dict[int, int]:
        """Of ``released`` (``_released_from``), the tensors whose bytes past ``cached_bytes`` a gather reads around
        the page cache: their file reads so, and they and their segments of the target (``intos``, where known)
        are dense host bytes."""
        return {i: skip for i, skip in released.items() if self._pages[i].direct is not None
                and dense_on_host(self.views[i]) and (intos is None or dense_on_host(intos[i]))}

    def _released_from(self) -> dict[int, int]:
        """Tensor index -> the byte of it from which its pages are released after a gather (those past
        ``cached_bytes``), for the mapped tensors that have such pages."""
        return {i: max(0, self.cached_bytes - segment.offset) for i, segment in enumerate(self.segments)
                if self._pages[i] is not None and segment.offset + segment.nbytes > self.cached_bytes}


def _bytes_of(buffer: torch.Tensor, segment: Segment) -> torch.Tensor:
    """Segment ``segment`` of ``buffer`` (a flat ``uint8`` tensor) as bytes."""
    return buffer[segment.offset : segment.offset + segment.nbytes]


def _unpin(pinner: Pinner, buffer: torch.Tensor, drain: Callable[[], None] | None) -> None:
    """The mirror's finalizer: it holds the buffer, never the mirror, so the mirror can be collected."""
    if drain is not None:
        drain()
    pinner.unpin(buffer)


def packed_buffer(tensors: list[torch.Tensor], segments: list[Segment], nbytes: int) -> torch.Tensor | None:
    """The host buffer ``tensors`` already are packed views of (left by an earlier mirror), if any."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    if storage.device.type != "cpu" or storage.nbytes() != nbytes:
        return None
    for tensor, segment in zip(tensors, segments):
        if (tensor.untyped_storage().data_ptr() != storage.data_ptr() or not tensor.is_contiguous()
                or tensor.storage_offset() * tensor.element_size() != segment.offset):
            return None
    return torch.empty(0, dtype=torch.uint8).set_(storage)

"""Host memory that is not ours to pack: memory-mapped files, where tensors lie, which pages are cached.

A group beyond the host budget keeps its tensors where they are. When they are views of a mapped
file (the loader maps the .safetensors file; newest ComfyUI maps it too), they cost no anonymous
memory: the kernel keeps the pages in its page cache, drops them under pressure and reads them
again. This module maps a file, tells which tensors lie in file mappings (``/proc/self/maps``), how
much of a range the page cache holds (``mincore``), and guards against the file changing on disk,
which would make the next read of a dropped page a SIGBUS.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
#: Where this process's mappings are listed (Linux).
PROC_MAPS = Path("/proc/self/maps")
#: Pages compared to tell a file restored on disk (same bytes, new modification time) from a changed one.
_FINGERPRINT_PAGES = 64


class SourceChangedError(ValueError):
    """A file that offloaded groups stream from changed on disk since they were mapped."""


def map_file(path: str | os.PathLike) -> torch.Tensor:
    """The whole file as a flat ``uint8`` tensor over a read-only shared mapping: its pages are the
    page cache's, never anonymous memory, and the mapping is not charged against the commit limit, so
    a file bigger than RAM + swap maps (a private writable mapping of it is refused). Nothing may write
    it: a write faults (SIGSEGV). The offloader only reads it; patches go to device copies."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)  # the tensor keeps it open
    with warnings.catch_warnings():  # read-only by design, as ComfyUI's own loader maps its files
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    offset: int  # where ``start`` lies in the file
    device: int
    inode: int
    path: str
    writable: bool  # its pages may differ from the file's (a private mapping written to)


class FileMappings:
    """This process's file mappings, as ``/proc/self/maps`` lists them when it is read (Linux; elsewhere none)."""

    def __init__(self) -> None:
        self._mappings: list[_Mapping] = []
        try:
            lines = PROC_MAPS.read_text().splitlines()
        except OSError:
            return
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                continue  # anonymous memory, the heap, the stack, [vdso]...
            start, end = (int(x, 16) for x in fields[0].split("-"))
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            self._mappings.append(_Mapping(start, end, int(fields[2], 16), os.makedev(major, minor),
                                           int(fields[4]), fields[5].removesuffix(" (deleted)"), "w" in fields[1]))
        self._mappings.sort(key=lambda m: m.start)
        self._starts = [m.start for m in self._mappings]

    def find(self, tensor: torch.Tensor) -> _Mapping | None:
        """The file mapping ``tensor``'s bytes lie in, if any."""
        if not self._mappings or tensor.device.type != "cpu" or tensor.numel() == 0:
            return None
        pointer = tensor.data_ptr()
        i = bisect.bisect_right(self._starts, pointer) - 1
        if i < 0 or pointer + _extent(tensor) > self._mappings[i].end:
            return None
        return self._mappings[i]


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from ``tensor``'s first element to past its last."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size()


class SourceFiles:
    """The files some tensors are mapped from, with what each must still be for those mappings to be read safely."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, int], _SourceFile] = {}

    def add(self, mapping: _Mapping, tensor: torch.Tensor) -> FilePages | None:
        """``tensor`` lies in ``mapping``: its file must keep holding the bytes under it. Returns where they lie
        in it, to release their pages (None where the file is gone from its path)."""
        offset = mapping.offset + tensor.data_ptr() - mapping.start
        key = (mapping.device, mapping.inode)
        if key not in self._files:
            self._files[key] = _SourceFile(mapping.path, mapping.device, mapping.inode)
        source = self._files[key]
        source.needed = max(source.needed, offset + _extent(tensor))
        return None if source._file is None else FilePages(source._file.fileno(), offset, not mapping.writable)

    def seal(self) -> None:
        """Take each file's size, time and fingerprint as they are now: what ``check`` compares with."""
        for source in self._files.values():
            source.seal()

    def check(self) -> None:
        """``SourceChangedError`` if a file shrank below its mapped bytes or changed on disk since ``seal``."""
        for source in self._files.values():
            source.check()

    @property
    def paths(self) -> list[str]:
        return [source.path for source in self._files.values()]


class _SourceFile:
    """One mapped file, asked through a descriptor opened when it was mapped: the file the mapping reads,
    whatever the path names later (a file replaced under it), and whatever device and inode stat shows
    for it (overlayfs, as in Docker, shows its own, not the ones ``/proc/self/maps`` lists)."""

    def __init__(self, path: str, device: int, inode: int) -> None:
        self.path, self.device, self.inode = path, device, inode
        self.needed = 0
        self.mtime_ns = 0
        self.fingerprint = 0
        try:
            self._file: BinaryIO | None = open(path, "rb")  # open while the mapping is read
        except OSError:
            self._file = None  # removed since it was mapped: no path can change the bytes it maps

    def seal(self) -> None:
        if self._file is not None:
            self.mtime_ns = os.fstat(self._file.fileno()).st_mtime_ns
            self.fingerprint = self._fingerprint()

    def check(self) -> None:
        if self._file is None:
            return
        stat = os.fstat(self._file.fileno())
        name = Path(self.path).name
        if stat.st_size < self.needed:
            raise SourceChangedError(
                f"{name} is now {stat.st_size} bytes on disk, but the offloaded model streams {self.needed} bytes "
                f"of it from its memory mapping: restore the file (the model runs again once it is whole), or load "
                f"the model again")
        if stat.st_mtime_ns != self.mtime_ns:
            if self._fingerprint() != self.fingerprint:
                raise SourceChangedError(
                    f"{name} changed on disk since the offloaded model mapped it: its weights would no longer be the "
                    f"ones it was loaded with. Restore the file, or load the model again")
            self.mtime_ns = stat.st_mtime_ns  # rewritten with the same bytes (restored)
            log.info("Group Offload: %s was rewritten on disk with the same bytes; streaming from it goes on", name)

    def _fingerprint(self) -> int:
        """A checksum of pages spread over the mapped bytes, read through the file, never the mapping."""
        step = max(_PAGE, self.needed // _FINGERPRINT_PAGES // _PAGE * _PAGE)
        checksum = 0
        for offset in range(0, self.needed, step):
            checksum = zlib.crc32(os.pread(self._file.fileno(), _PAGE, offset), checksum)
        return checksum


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


#: ``madvise`` advice: faults read ahead of them, never around them.
_MADV_SEQUENTIAL = 2
#: ``madvise`` advice: read these pages ahead, asynchronously.
_MADV_WILLNEED = 3
#: ``madvise`` advice: drop this process's page-table entries for these pages (a file mapping's pages are
#: read again from the file; a private mapping's written pages would be lost).
_MADV_DONTNEED = 4


def advise_will_need(tensor: torch.Tensor) -> None:
    """Ask the kernel to start reading ``tensor``'s pages into the page cache now (a no-op where it cannot)."""
    if _libc is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr() // _PAGE * _PAGE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(tensor.data_ptr() + _extent(tensor) - start), _MADV_WILLNEED)


@dataclass(frozen=True)
class FilePages:
    """Where a tensor of a file mapping lies in its file, to let the page cache drop its pages (``release``)."""

    descriptor: int  # the file, open while it is mapped (``SourceFiles``)
    offset: int  # the tensor's first byte in it
    read_only: bool  # the mapping: its pages are the file's, its page-table entries may go

    def read_forward(self, tensor: torch.Tensor) -> None:
        """Have a fault on ``tensor``'s pages read ahead of it only (``MADV_SEQUENTIAL``): by default the kernel
        also reads around a fault on a file mapping (half its read-ahead window before it, 4 MiB of an 8 MiB
        one), which would read the released pages of the tensor before it again."""
        if _libc is not None and tensor.numel() > 0:
            start = tensor.data_ptr() // _PAGE * _PAGE
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(tensor.data_ptr() + _extent(tensor) - start),
                          _MADV_SEQUENTIAL)

    def release(self, tensor: torch.Tensor) -> None:
        """Drop ``tensor``'s pages from the page cache now: this process's page-table entries for them (on a
        mapping never written), then the file's cached pages in that range (``POSIX_FADV_DONTNEED``, which
        leaves the pages some process still maps). The next read of them goes to the disk. The page its first
        byte lies in goes too, whoever else's bytes it holds."""
        if _libc is None or tensor.numel() == 0:
            return
        start = tensor.data_ptr() // _PAGE * _PAGE
        length = tensor.data_ptr() + _extent(tensor) - start
        if self.read_only:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)
        os.posix_fadvise(self.descriptor, self.offset - (tensor.data_ptr() - start), length, os.POSIX_FADV_DONTNEED)


def groups_kept_cached(sizes: list[int], room: int) -> list[bool]:
    """Which of the groups kept in place (their bytes, in the order a step gathers them) should stay in a page
    cache with ``room`` bytes for them; the others' pages are released after each gather (``FilePages.release``).

    A step reads the groups in a cycle. Where they are more than the cache holds, the kernel's LRU drops
    each page shortly before it is read again, and every step reads all of them from the disk; keeping the
    first groups that fit and releasing the others reads only the others again.
    """
    kept, used = [], 0
    for size in sizes:
        kept.append(used + size <= room)
        used += size if kept[-1] else 0
    return kept


def uncached_bytes(tensor: torch.Tensor) -> int | None:
    """How many bytes of ``tensor``'s pages the page cache does not hold (the next read goes to the disk);
    None where that cannot be asked (not Linux)."""
    if _libc is None or tensor.numel() == 0:
        return None
    start = tensor.data_ptr() // _PAGE * _PAGE
    end = tensor.data_ptr() + _extent(tensor)
    pages = -(-(end - start) // _PAGE)
    residency = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), residency) != 0:
        return None
    missing = pages - int(torch.frombuffer(residency, dtype=torch.uint8).bitwise_and(1).sum())
    return min(missing * _PAGE, tensor.numel() * tensor.element_size())

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
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # (not on Windows: no leases there)
    fcntl = None

import torch

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
#: Where this process's mappings are listed (Linux).
PROC_MAPS = Path("/proc/self/maps")


class SourceChangedError(ValueError):
    """A file that offloaded groups stream from changed on disk since they were mapped."""


# ComfyUI names an error's type by its module; the pack's are named after the folder it is installed in.
SourceChangedError.__module__ = "offload_core"


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
        kept = os.dup(file.fileno())  # the file the mapping reads, asked later whatever the path names then
    with warnings.catch_warnings():  # read-only by design, as ComfyUI's own loader maps its files
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    _KEPT[tensor.data_ptr()] = kept
    weakref.finalize(mapping, _forget_kept, tensor.data_ptr(), kept).atexit = False
    return tensor


def _forget_kept(address: int, fd: int) -> None:
    if _KEPT.get(address) == fd:
        del _KEPT[address]
    os.close(fd)


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
            self._files[key] = _SourceFile(mapping)
        source = self._files[key]
        source.needed = max(source.needed, offset + _extent(tensor))
        return None if source._fd is None else FilePages(source, offset, not mapping.writable)

    def seal(self, lease: bool = True) -> None:
        """Take each file's size, times and inode as they are now (what ``check`` compares with), and (``lease``)
        a read lease on it where the kernel grants one."""
        for source in self._files.values():
            source.seal(lease)

    def check(self) -> None:
        """``SourceChangedError`` if a file shrank below its mapped bytes, changed on disk since ``seal``, or a
        writer opened it (its lease broke)."""
        for source in self._files.values():
            source.check()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While the mappings may be read: a writer held by a lease waits (until ``let_writers_go``, or the
        kernel's lease-break-time); outside, it is let go as soon as it is noticed."""
        for source in self._files.values():
            source.readers += 1
        try:
            yield
        finally:
            for source in self._files.values():
                source.readers -= 1

    def let_writers_go(self) -> None:
        """Give up the leases a writer is waiting on: nothing reads their mappings any more."""
        for source in self._files.values():
            if source.broken:
                source.release_lease()

    @property
    def paths(self) -> list[str]:
        return [source.path for source in self._files.values()]


class _SourceFile:
    """One mapped file, asked through a descriptor on the file the mapping reads (the one ``map_file`` kept,
    or one opened when it was found): whatever the path names later (a file replaced under it, a new
    download), and whatever device and inode stat shows for it (overlayfs, as in Docker, shows its own,
    not the ones ``/proc/self/maps`` lists).

    Where the kernel grants it, a read lease (``F_SETLEASE``) holds a process that opens the file for
    writing or truncates it until the lease is given up: the pack notices first (``_LeaseWatch``), and
    lets it go once nothing reads the mapping (a writer waits at most the kernel's lease-break-time,
    /proc/sys/fs/lease-break-time, 45 s by default; past it, the kernel lets the writer go anyway).
    """

    def __init__(self, mapping: _Mapping) -> None:
        self.path = mapping.path
        self.needed = 0
        self.readers = 0  # ``SourceFiles.reading`` in progress
        self.broken = False  # a writer opened the file: it stays refused
        self.leased = False
        self._sealed: tuple[int, ...] | None = None
        try:  # (removed since it was mapped and not mapped by ``map_file``: no path can change the bytes it maps)
            self._fd: int | None = kept_descriptor(mapping.start - mapping.offset) or os.open(mapping.path, os.O_RDONLY)
        except OSError:
            self._fd = None
        if self._fd is not None:
            weakref.finalize(self, _close_leased, self._fd).atexit = False
        self.direct = None if self._fd is None else open_direct(self._fd)  # reads around the page cache
        if self.direct is not None:
            weakref.finalize(self, os.close, self.direct).atexit = False

    @property
    def descriptor(self) -> int | None:
        return self._fd

    def seal(self, lease: bool = True) -> None:
        if self._fd is None or self._sealed is not None:
            return
        self._sealed = self._identity()
        self.leased = lease and _take_read_lease(self._fd)
        if self.leased:
            _LeaseWatch.watch(self)

    def _identity(self) -> tuple[int, ...]:
        """What a write changes: size, modification time and change time (also moved by one that puts the old
        modification time back). A change of the link count moves the change time too (the path replaced by
        a new download, or removed): the file's bytes are not written by it."""
        stat = os.fstat(self._fd)
        return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_nlink, stat.st_ino, stat.st_dev

    def lease_broken(self) -> bool:
        """Whether a writer opened the file since the lease was taken (the kernel is breaking it)."""
        if self.leased and not self.broken and fcntl.fcntl(self._fd, _F_GETLEASE) != fcntl.F_RDLCK:
            self.broken = True
        return self.broken

    def release_lease(self) -> None:
        if self.leased:
            self.leased = False
            fcntl.fcntl(self._fd, _F_SETLEASE, fcntl.F_UNLCK)

    def check(self) -> None:
        if self._fd is None:
            return
        size, mtime, ctime, links, *file = self._identity()
        sealed_size, sealed_mtime, sealed_ctime, sealed_links, *sealed_file = self._sealed
        name = Path(self.path).name
        reload = ("load the model again: Free model and node cache (in ComfyUI's menu), or change an input of its "
                  "loader; the loader then maps the file as it is on disk")
        if size < self.needed:
            self.broken = True
            raise SourceChangedError(
                f"{name} is now {size} bytes on disk, but the offloaded model streams {self.needed} bytes of it from "
                f"its memory mapping, which can no longer be read. Put the whole file back (or download it again), "
                f"then {reload}")
        ctime_moved = ctime != sealed_ctime and links == sealed_links
        if self.lease_broken() or (size, mtime, file) != (sealed_size, sealed_mtime, sealed_file) or ctime_moved:
            self.broken = True
            raise SourceChangedError(
                f"{name} was written to since the offloaded model mapped it (its size, modification or change time, "
                f"or a writer that opened it, tell so; its bytes are not compared), so its weights may no longer be "
                f"the ones it was loaded with. To use the file as it is now, {reload}")


def _close_leased(fd: int) -> None:
    os.close(fd)  # (a lease goes with its descriptor)


#: ``fcntl`` commands (Linux) to set and ask a file lease, and to pick the signal a lease break sends.
_F_SETLEASE, _F_GETLEASE, _F_SETSIG = 1024, 1025, 10


def _take_read_lease(fd: int) -> bool:
    """A read lease on ``fd``, if the kernel grants one (Linux; the file's owner or CAP_LEASE; no writer has it
    open; a file system that has leases). Its break is noticed by asking (``_LeaseWatch``), never by a signal:
    the one the kernel sends is SIGURG (ignored unless handled) and, once the lease is set, to no process."""
    if fcntl is None:
        return False
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)  # (SIGIO, the default, would end the process)
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
    except OSError as error:
        log.debug("Group Offload: no read lease on a mapped file (%s); its changes are seen by stat alone", error)
        return False
    return True


class _LeaseWatch:
    """One daemon thread that asks every leased file, a few times a second, whether a writer waits on it: its
    file is marked changed (every later check refuses it) and, unless a run or a reader reads its mapping
    (``SourceFiles.reading``, which lets it go when done), the writer is let go at once."""

    _files: "weakref.WeakSet[_SourceFile]" = weakref.WeakSet()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()
    interval = 0.2

    @classmethod
    def watch(cls, source: _SourceFile) -> None:
        with cls._lock:
            cls._files.add(source)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="group-offload-lease-watch", daemon=True)
                cls._thread.start()

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(cls.interval)
            with cls._lock:
                sources = list(cls._files)
            for source in sources:
                try:
                    if source.leased and source.lease_broken() and source.readers == 0:
                        log.warning("Group Offload: %s is being written to while an offloaded model maps it; that "
                                    "model refuses to run from now on", Path(source.path).name)
                        source.release_lease()
                except OSError:  # (closed meanwhile: the model is gone)
                    source.leased = False


_KEPT: dict[int, int] = {}  # where ``map_file`` mapped a file -> a descriptor on that file, while it is mapped


def kept_descriptor(address: int) -> int | None:
    """A descriptor of its own (an open file of its own, for a lease of its own) on the file ``map_file``
    mapped at ``address``, if it did: opened again through /proc, which reaches it even once removed."""
    fd = _KEPT.get(address)
    if fd is None:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:
        return os.dup(fd)


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
    """Where a tensor of a file mapping lies in its file, to let the page cache drop its pages (``release``).
    Both methods act on the tensor's pages from its byte ``skip`` on: from the page its first byte lies in
    (``skip`` 0, whoever else's bytes it holds), else from the first page that begins past ``skip``."""

    source: _SourceFile  # the file (open while this is held)
    offset: int  # the tensor's first byte in it
    read_only: bool  # the mapping: its pages are the file's, its page-table entries may go

    @property
    def direct(self) -> int | None:
        """The file open to be read around the page cache (``open_direct``), where it can be."""
        return self.source.direct

    def read_around_cache(self, target: torch.Tensor, tensor: torch.Tensor, skip: int) -> FileRead:
        """How to gather ``tensor`` (dense, of this file's mapping) into ``target`` (a flat ``uint8`` host tensor of
        its size): its first ``skip`` bytes from the mapping, the rest around the page cache (``direct`` open)."""
        return FileRead(target, tensor.data_ptr(), self.direct, self.offset, skip)

    def read_forward(self, tensor: torch.Tensor, skip: int = 0) -> None:
        """Have a fault on ``tensor``'s pages read ahead of it only (``MADV_SEQUENTIAL``): by default the kernel
        also reads around a fault on a file mapping (half its read-ahead window before it, 4 MiB of an 8 MiB
        one), which would read the released pages of the tensor before it again."""
        if _libc is not None and (pages := _pages_from(tensor, skip)) is not None:
            _libc.madvise(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1]), _MADV_SEQUENTIAL)

    def release(self, tensor: torch.Tensor, skip: int = 0) -> None:
        """Drop ``tensor``'s pages from the page cache now: this process's page-table entries for them (on a
        mapping never written), then the file's cached pages in that range (``POSIX_FADV_DONTNEED``, which
        leaves the pages some process still maps). The next read of them goes to the disk."""
        if _libc is None or (pages := _pages_from(tensor, skip)) is None:
            return
        start, length = pages
        if self.read_only:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)
        os.posix_fadvise(self.source.descriptor, self.offset + start - tensor.data_ptr(), length, os.POSIX_FADV_DONTNEED)


def _pages_from(tensor: torch.Tensor, skip: int) -> tuple[int, int] | None:
    """(address, length) of ``tensor``'s pages from its byte ``skip`` on (``FilePages``); None if there are none."""
    if tensor.numel() == 0:
        return None
    first = tensor.data_ptr() + skip
    start = first // _PAGE * _PAGE if skip == 0 else -(-first // _PAGE) * _PAGE
    end = tensor.data_ptr() + _extent(tensor)
    return (start, end - start) if end > start else None


#: The most bytes one direct read asks for (the bounce buffer's size, less the pages its ends are rounded to).
DIRECT_CHUNK = 4 * 2**20


class _Bounce(threading.local):
    """Each thread's page-aligned buffer that direct reads land in (its pages taken at the first read)."""

    def __init__(self) -> None:
        self.buffer = mmap.mmap(-1, DIRECT_CHUNK + 2 * _PAGE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.view = memoryview(self.buffer)


_BOUNCE = _Bounce()


def open_direct(descriptor: int) -> int | None:
    """The file ``descriptor`` is open on, opened again to be read around the page cache (``O_DIRECT``), if its
    file system reads so (asked by reading its first page); None elsewhere (not Linux, a file system without
    direct reads). Such a read goes from the disk into memory of the reader's, holding no page of the cache."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        direct = os.open(f"/proc/self/fd/{descriptor}", os.O_RDONLY | flag)
    except OSError:
        return None
    try:
        os.preadv(direct, [_BOUNCE.view[:_PAGE]], 0)
    except OSError as error:
        log.debug("Group Offload: no direct reads of a mapped file (%s); its pages pass through the page cache", error)
        os.close(direct)
        return None
    return direct


@dataclass(frozen=True)
class FileRead:
    """A gather's copy of one mapped tensor whose leading ``skip`` bytes stay in the page cache: those copied from
    the mapping (its cached pages), the others read from the file around the page cache (``read_direct``), into
    ``target``. ``pieces`` splits it for threads that share a group; calling it does all of it."""

    target: torch.Tensor  # flat ``uint8``, in host memory, the tensor's size
    mapped: int  # the tensor's first byte in the mapping
    descriptor: int  # its file, opened by ``open_direct``
    offset: int  # its first byte in the file
    skip: int

    def pieces(self, most: int) -> list[Callable[[], object]]:
        """The copy in pieces of at most ``most`` bytes, the reads' split at whole pages of the file (none read twice)."""
        to, nbytes = self.target.data_ptr(), self.target.numel()
        step = max(_PAGE, most // _PAGE * _PAGE)
        pieces = [functools.partial(ctypes.memmove, to + lo, self.mapped + lo, min(most, self.skip - lo))
                  for lo in range(0, self.skip, most)]
        cuts = [self.skip, *range((self.offset + self.skip) // step * step + step - self.offset, nbytes, step), nbytes]
        return pieces + [functools.partial(read_direct, self.descriptor, self.offset + lo, hi - lo, to + lo)
                         for lo, hi in zip(cuts, cuts[1:]) if hi > lo]

    def __call__(self) -> None:
        for piece in self.pieces(DIRECT_CHUNK):
            piece()


def read_direct(descriptor: int, offset: int, nbytes: int, to: int) -> None:
    """File bytes ``offset`` to ``offset + nbytes`` into host memory at address ``to``, from a descriptor
    ``open_direct`` opened: read in whole pages (what a direct read needs) into this thread's bounce buffer,
    ``DIRECT_CHUNK`` at a time, and copied from there. ``OSError`` if the file ends before them."""
    bounce, done = _BOUNCE, 0
    end = -(-(offset + nbytes) // _PAGE) * _PAGE
    while done < nbytes:
        first = offset + done
        start = first // _PAGE * _PAGE
        got = os.preadv(descriptor, [bounce.view[: min(DIRECT_CHUNK + _PAGE, end - start)]], start)
        useful = min(got - (first - start), nbytes - done)
        if useful <= 0:
            raise OSError(f"a mapped file ended at byte {start + got}, before byte {offset + nbytes} of a tensor in it")
        ctypes.memmove(to + done, bounce.address + first - start, useful)
        done += useful


def bytes_kept_cached(sizes: list[int], room: int) -> list[int]:
    """How many leading bytes of each group kept in place (their bytes, in the order a step gathers them) should
    stay in a page cache with ``room`` bytes for them: the first groups whole while they fit, then the leading
    part of the next one; the pages past those are released after each gather (``FilePages.release``).

    A step reads the groups in a cycle. Where they are more than the cache holds, the kernel's LRU drops
    each page shortly before it is read again, and every step reads all of them from the disk; keeping the
    first bytes that fit and releasing the others reads only the others again.
    """
    kept, left = [], max(0, room)
    for size in sizes:
        kept.append(min(size, left))
        left -= kept[-1]
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

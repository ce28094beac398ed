"""Host-to-host copies for gathers: in chunks, by threads that hold neither the GIL nor an OpenMP team.

A group kept in place is gathered tensor by tensor from where its tensors lie (a mapped file's pages,
often faulted in from the page cache on the way) into a packed buffer, by the gather worker, while the
main thread launches kernels. ``torch``'s copy does it at a fraction of the memory's rate there: each
copy of a tensor opens an OpenMP team that competes with the main thread's intra-op threads for the
same cores and waits for its slowest thread (a 1 MiB copy 80 µs -> 8 ms when they oversubscribed them).

``HostCopy.many`` copies a group's plain tensors (bytes for bytes) with ``memmove`` — a ``ctypes`` call
releases the GIL and starts no thread — in chunks of at most ``CHUNK_BYTES`` that its threads take in
turn, each taking the page faults of its own chunks; it waits once, for the whole group. Anything else
(a dtype conversion, a strided view, a tensor subclass) is copied by ``torch``. The tensors a gather reads
from their file around the page cache (``hostmem.FileRead``) are split the same way: each thread's direct
reads keep the disk's queue deeper than one thread's would.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .hostmem import FileRead

#: The most bytes one chunk copies: small enough for the threads to share a group evenly, big enough that
#: taking one (the GIL, a Python loop) costs little beside copying it (~1 ms at 4 GB/s).
CHUNK_BYTES = 4 * 2**20
#: The most threads a copy uses: a few saturate the memory bus; more only take cores from the compute.
MAX_THREADS = 4

#: A chunk: a piece of a copy, done when called.
_Chunk = Callable[[], object]


def default_threads() -> int:
    """Threads for the gathers on this machine: a quarter of its usable cores, 1 to ``MAX_THREADS``. A thread
    more than the cores the main thread leaves free is preempted mid-chunk, and the group waits for it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores // 4))


def dense_on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are its bytes, back to back in host memory: dense and contiguous, not a
    quantized tensor nor a lazily conjugated or negated view (a plain subclass's too)."""
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg())


def plain_bytes(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether copying ``source`` into ``target`` is copying its bytes: same dtype and shape, both dense on the
    host (``dense_on_host``), neither a tensor subclass."""
    return (target.dtype == source.dtype and target.shape == source.shape
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and dense_on_host(t) for t in (target, source)))


class HostCopy:
    """Copies host tensors into host tensors, off the GIL and OpenMP: one pair (``copy(target, source)``)
    or many (``copy.many(targets, sources)``, a gather's). Any thread may ask; errors are raised to it (a
    fault on a file cut short is a SIGBUS, which no copy can catch: ``SourceFiles.check`` guards that)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else max(1, threads)
        self._pool: ThreadPoolExecutor | None = None  # made at the first copy that uses it
        self._lock = threading.Lock()

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.many([target], [source])

    def many(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             reads: Sequence[FileRead] = ()) -> None:
        """``targets[i]`` := ``sources[i]`` for each i, bit for bit where their bytes are their values; and each
        of ``reads``."""
        chunks: list[_Chunk] = []
        for target, source in zip(targets, sources, strict=True):
            if plain_bytes(target, source):
                chunks += _chunks(target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
            else:
                target.copy_(source)
        for read in reads:
            chunks += read.pieces(CHUNK_BYTES)
        if not chunks:
            return
        taken = iter(chunks)  # (``next`` on a list's iterator is atomic under the GIL)
        helpers = min(self.threads, len(chunks)) - 1
        others = [self._threads().submit(_copy_chunks, taken) for _ in range(helpers)]
        _copy_chunks(taken)
        for other in others:
            other.result()

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="group-offload-copy")
            return self._pool


def _chunks(to: int, start: int, nbytes: int) -> list[_Chunk]:
    return [functools.partial(ctypes.memmove, to + lo, start + lo, min(CHUNK_BYTES, nbytes - lo))
            for lo in range(0, nbytes, CHUNK_BYTES)]


def _copy_chunks(taken: Iterator[_Chunk]) -> None:
    """Copy chunks from ``taken`` until none is left."""
    for chunk in taken:
        chunk()

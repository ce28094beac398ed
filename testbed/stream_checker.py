"""A CPU stand-in for the CUDA runtime that proves cross-stream accesses are ordered.

``StreamChecker`` offers what the engine's ``Runtime`` needs (streams, ``wait_stream``, events with
``record`` / ``wait_event`` / ``query`` (never reached: it orders nothing), device allocations) plus a ``cudart`` stand-in for host
registration. Each stream keeps a vector clock: what it has waited for, directly or through
events and other streams. Used as a context manager, it observes every aten op torch runs (a
``TorchDispatchMode``) as a kernel on the current stream that reads its tensor arguments and writes
the ones its schema marks as written; the ops run for real on the CPU.

Accesses to memory it tracks (its device allocations, host buffers registered through its
``cudart``) are checked, and a ``RaceError`` is raised (and kept in ``races``) for

- a write not ordered after every earlier read and write of that memory on other streams;
- a read not ordered after every earlier write of that memory on other streams;
- unregistering host memory while a stream may still read it (the host has not waited).

``capture()`` makes the current stream capture a CUDA graph, as ``torch.cuda.graph`` does: a host sync raises
meanwhile, and so does the capturing stream's waiting on an event recorded outside the capture.

The gather worker (``submit``) is a second host thread: its jobs run at once, on a clock of their own,
ordered after what the host did before it submitted them; the host is ordered after a job once it
``wait``s for it. Host copies (``host_copy``) are the engine's own, ``gather.HostCopy``, which no dispatch
mode sees: their accesses are checked as the calling thread's.

The allocator models CUDA's caching allocator: memory belongs to the pool of the stream that was
current when it was allocated; once its tensors are gone it goes back to that pool, and the next
allocation on that stream gets the same memory back, with its history of accesses — so writing it
from another stream must first be ordered after the kernels that used it last. ``empty_cache`` checks
that nothing of another stream may still touch pooled memory, which any kernel of its own stream may
have been handed since it was freed. ``out_of_memory_at`` makes chosen allocations fail as a full
device fails them.

``allocations_on`` counts the allocations made while each stream was current: the device allocations and
every op that computes a fresh tensor from device memory (on CUDA, memory from that stream's pool). One made on a copy stream
couples the streams under cudaMallocAsync, whose pool hands memory freed on one stream to another after
an internal wait, so the engine's copy streams allocate nothing.
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from testbed.fake_cudart import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, FakeCudart
from offload_core.gather import HostCopy
from offload_core.hostmem import FileRead

HOST = "host"
COMPUTE = "compute"
WORKER = "worker"  # the gather worker: a second host thread
# What the CUDA runtime answers a capture it cannot record (cudaErrorStreamCaptureUnsupported / ...Isolation).
CAPTURE_UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"
CAPTURE_ISOLATION = "CUDA error: dependency created on uncaptured work in another stream"

#: Ops that look at tensors' metadata only (``param.data = view`` asks the first).
METADATA_OPS = {torch.ops.aten._has_compatible_shallow_copy_type.default, torch.ops.aten.is_same_size.default}



class RaceError(AssertionError):
    """Two accesses to the same memory that no stream or event orders."""


class StaleCudaError(RuntimeError):
    """A kernel launch found an error left behind by an earlier runtime call (torch's launch check)."""


@dataclass
class _Access:
    lo: int
    hi: int
    stream: str
    epoch: int
    write: bool
    op: str


@dataclass
class _Region:
    """Tracked memory: a device block (live or in its pool) or a registered host buffer."""

    name: str
    lo: int
    hi: int
    history: list[_Access] = field(default_factory=list)


@dataclass
class _Block:
    region: _Region
    memory: bytearray
    owner: str  # the stream whose pool it belongs to


class Stream:
    def __init__(self, checker: "StreamChecker", name: str) -> None:
        self.checker = checker
        self.name = name

    def wait_event(self, event: "Event") -> None:
        if event.clock is not None:  # waiting for an event never recorded is a no-op, as in CUDA
            if self.name in self.checker.capturing_streams and not event.captured:
                raise RuntimeError(CAPTURE_ISOLATION)
            self.checker._join(self.name, event.clock)

    def wait_stream(self, other: "Stream") -> None:
        self.checker._join(self.name, self.checker.clocks[other.name])

    def synchronize(self) -> None:
        self.checker._refuse_host_sync()
        self.checker._join(self.checker.issuer, self.checker.clocks[self.name])

    def query(self) -> bool:
        self.synchronize()  # on the CPU the work is done: the host learns so
        return True

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class Event:
    def __init__(self, checker: "StreamChecker") -> None:
        self.checker = checker
        self.clock: dict[str, int] | None = None
        self.captured = False  # recorded on a stream that captures a graph

    def record(self, stream: Stream | None = None) -> None:
        name = (stream or self.checker.current).name
        self.clock = dict(self.checker.clocks[name])
        self.captured = name in self.checker.capturing_streams

    def query(self) -> bool:
        """Not reached yet, as a real GPU may answer: the engine asks only to read its timers, and must never
        take an answer as an order (a ``True`` would order the host after the event and hide a race)."""
        return False

    def synchronize(self) -> None:
        self.checker._refuse_host_sync()
        if self.clock is not None:
            self.checker._join(self.checker.issuer, self.clock)

    def elapsed_time(self, end: "Event") -> float:
        return 0.0


class CheckedCudart(FakeCudart):
    """The host-registration stand-in (``fake_cudart``), with the checker watching the registered memory.

    Like the driver, a refused registration leaves an error that the next kernel launch reports.
    """

    def __init__(self, checker: "StreamChecker") -> None:
        super().__init__()
        self.checker = checker
        self.refuse = False  # refuse every registration, as a driver out of lockable memory does

    @property
    def unregistered(self) -> list[int]:
        return [ptr for call, ptr, _ in self.calls if call == "unregister"]

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        status = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED if self.refuse else super().cudaHostRegister(ptr, nbytes, flags)
        if status:
            self.checker.last_error = "cudaErrorHostMemoryAlreadyRegistered"
        else:
            self.checker._track(f"host buffer {ptr:#x}", ptr, ptr + nbytes)
        return status

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        nbytes = self.registered[ptr]
        self.checker._host_write(ptr, ptr + nbytes, "cudaHostUnregister")
        self.checker._untrack(ptr)
        return super().cudaHostUnregister(ptr)


class CheckedHostCopy:
    """The runtime's host copy, ``offload_core.gather.HostCopy`` (raw ``memmove`` by threads of its own, which
    no dispatch mode sees), its accesses checked as the calling host thread's: the host's, or the worker's."""

    def __init__(self, checker: "StreamChecker") -> None:
        self.checker = checker
        self._copy = HostCopy(threads=2)

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.many([target], [source])

    def many(self, targets: list[torch.Tensor], sources: list[torch.Tensor], reads: list[FileRead] = ()) -> None:
        checker = self.checker
        written = [*targets, *(read.target for read in reads)]  # (a file's mapping is no tracked memory)
        accesses = [(*_span(inner), write) for tensors, write in ((sources, False), (written, True))
                    for t in tensors for inner in _inner_tensors(t) if inner.numel()]
        checker._launch(checker.issuer, accesses, "host copy")
        with checker.use_stream(Stream(checker, checker.issuer)):  # what it copies by torch: the same thread's
            self._copy.many(targets, sources, reads)


class StreamChecker(TorchDispatchMode):
    """The engine's ``Runtime`` on the CPU, checking happens-before for every tracked access."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}, WORKER: {WORKER: 0}, COMPUTE: {COMPUTE: 0}}
        self.issuer = HOST  # the host thread that runs the code now: the host's own, or the gather worker
        self.jobs = 0
        self.current = Stream(self, COMPUTE)
        self.races: list[str] = []
        self.last_error: str | None = None
        self.discards = 0
        self.launches: list[tuple[str, set[str], set[str]]] = []  # (stream, regions touched, regions written), in order
        self.cudart = CheckedCudart(self)
        self.allocations = 0
        self.allocations_on: Counter[str] = Counter()  # stream current at an allocation -> allocations
        self.allocation_attempts = 0
        self.out_of_memory_at: set[int] = set()  # allocation attempts (0, 1, ...) that raise torch.OutOfMemoryError
        self.reuses = 0
        self.released = 0  # pooled blocks ``empty_cache`` gave back to the driver
        self._regions: list[_Region] = []  # sorted by ``lo``
        self._live: list[tuple[_Block, StorageWeakRef]] = []
        self._pools: list[_Block] = []
        self.host_copy = CheckedHostCopy(self)
        self.capturing_streams: set[str] = set()  # the streams capturing a CUDA graph (``capture``)
        self.captured_ops: list[str] = []  # the ops queued on a capturing stream

    # --- Runtime ---------------------------------------------------------------------------

    def new_stream(self) -> Stream:
        name = f"side{len(self.clocks) - 2}"  # (after the host, the worker and the compute stream)
        self.clocks[name] = {name: 0}
        return Stream(self, name)

    def current_stream(self) -> Stream:
        return self.current

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def new_event(self, enable_timing: bool = False) -> Event:
        return Event(self)

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device memory from the current stream's pool: freed memory of that stream first."""
        attempt, self.allocation_attempts = self.allocation_attempts, self.allocation_attempts + 1
        if attempt in self.out_of_memory_at:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes "
                                         f"(allocation attempt {attempt}, refused by the stream checker)")
        self._return_freed_blocks()
        stream = self.current.name
        fitting = [b for b in self._pools if b.owner == stream and len(b.memory) >= nbytes]
        if fitting:
            block = min(fitting, key=lambda b: len(b.memory))
            self._pools.remove(block)
            self.reuses += 1
        else:
            memory = bytearray(max(nbytes, 1))
            lo = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            block = _Block(self._track(f"device block {len(self._live) + len(self._pools)}", lo, lo + len(memory)),
                           memory, stream)
        self.allocations += 1
        self.allocations_on[stream] += 1
        tensor = torch.frombuffer(block.memory, dtype=torch.uint8)[:nbytes]
        self._live.append((block, StorageWeakRef(tensor.untyped_storage())))
        return tensor

    def submit(self, job) -> Future:
        """The gather worker runs ``job`` at once, as a thread of its own: ordered after what the host did
        before it submitted the job, but the host is ordered after the job only once it ``wait``s for it."""
        self._tick(HOST)
        self._join(WORKER, self.clocks[HOST])
        future: Future = Future()
        previous, self.issuer = self.issuer, WORKER
        try:
            future.set_result(job())
        except BaseException as error:  # noqa: B036 (handed to the waiter, as the executor does)
            future.set_exception(error)
        finally:
            self.issuer = previous
            self.jobs += 1
        future.worker_clock = dict(self.clocks[WORKER])
        return future

    def wait(self, future: Future):
        self._join(HOST, future.worker_clock)
        return future.result()

    def empty_cache(self) -> None:
        """Pooled memory goes back to the driver. Since it was freed, any kernel of the stream whose
        pool holds it may have been handed it: every access to it from another stream must be
        ordered before that stream now (the copies into a freed buffer drained first)."""
        self._return_freed_blocks()
        for block in self._pools:
            region = block.region
            self._access(block.owner, region.lo, region.hi, True, f"a kernel handed {region.name} once freed")
            self._untrack(region.lo)
        self.released += len(self._pools)
        self._pools.clear()

    def capturing(self) -> bool:
        return self.current.name in self.capturing_streams

    @contextmanager
    def capture(self) -> Iterator[None]:
        """The current stream captures a CUDA graph meanwhile, as in ``torch.cuda.graph``: what it queues is
        recorded (``captured_ops``); a host sync raises, and so does its waiting on an event recorded outside
        the capture, as the CUDA runtime answers them."""
        name = self.current.name
        self.capturing_streams.add(name)
        try:
            yield
        finally:
            self.capturing_streams.discard(name)

    def _refuse_host_sync(self) -> None:
        if self.capturing_streams:
            raise RuntimeError(CAPTURE_UNSUPPORTED)

    def discard_last_error(self) -> None:
        self.last_error = None
        self.discards += 1  # each one costs the real runtime a launch and a device sync

    # --- kernels ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.capturing():
            self.captured_ops.append(str(func))
        self._kernel(func, args, kwargs)
        if _returns_fresh_tensors(func) and self._reads_device_memory(args, kwargs):
            self.allocations_on[self.current.name] += 1
        return func(*args, **kwargs)

    def _kernel(self, func, args: tuple, kwargs: dict) -> None:
        if func in METADATA_OPS:
            return
        schema = func._schema
        writes_any = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not writes_any and any(r.alias_info is not None for r in schema.returns):
            return  # a view: no memory is touched, no kernel launched
        if self.last_error is not None:  # torch checks cudaGetLastError after each launch
            error, self.last_error = self.last_error, None
            raise StaleCudaError(f"CUDA error: {error} (reported by the launch of {func})")
        accesses = []
        for position, argument in enumerate(schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            write = argument.alias_info is not None and argument.alias_info.is_write
            tensors = value if isinstance(value, (list, tuple)) else [value]
            accesses += [(*_span(inner), write) for t in tensors if isinstance(t, torch.Tensor)
                         for inner in _inner_tensors(t) if inner.numel()]
        self._launch(self.current.name, accesses, str(func))

    def _launch(self, stream: str, accesses: list[tuple[int, int, bool]], op: str) -> None:
        """A kernel on ``stream`` (or a host thread's copy) making ``accesses`` (lo, hi, write): checked where
        they touch tracked memory."""
        regions = [(lo, hi, write, found) for lo, hi, write in accesses if (found := self._overlapping(lo, hi))]
        if regions:
            self._tick(stream)
            self.launches.append((stream, {r.name for *_, found in regions for r in found},
                                  {r.name for *_, write, found in regions if write for r in found}))
            for lo, hi, write, _ in regions:
                self._access(stream, lo, hi, write, op)

    def _reads_device_memory(self, args: tuple, kwargs: dict) -> bool:
        tensors = [inner for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                   for inner in _inner_tensors(t) if inner.numel()]
        return any(r.name.startswith("device") for t in tensors for r in self._overlapping(*_span(t)))

    # --- vector clocks ---------------------------------------------------------------------

    def _tick(self, stream: str) -> None:
        clock = self.clocks[stream]
        clock[stream] += 1
        if stream not in (HOST, WORKER):  # issued after the issuing thread's earlier work
            issuer = self.issuer
            clock[issuer] = max(clock.get(issuer, 0), self.clocks[issuer][issuer])

    def _join(self, stream: str, other: dict[str, int]) -> None:
        clock = self.clocks[stream]
        for name, epoch in other.items():
            if name != stream:
                clock[name] = max(clock.get(name, 0), epoch)

    def _ordered(self, stream: str, prior: _Access) -> bool:
        return prior.stream == stream or self.clocks[stream].get(prior.stream, 0) >= prior.epoch

    def _access(self, stream: str, lo: int, hi: int, write: bool, op: str) -> None:
        for region in self._overlapping(lo, hi):
            for prior in region.history:
                if prior.hi <= lo or prior.lo >= hi or not (write or prior.write) or self._ordered(stream, prior):
                    continue
                self._race(f"{op} {'writes' if write else 'reads'} {region.name}[{lo - region.lo}:{hi - region.lo}] "
                           f"on stream {stream}, not ordered after {prior.op}, which "
                           f"{'wrote' if prior.write else 'read'} [{prior.lo - region.lo}:{prior.hi - region.lo}] "
                           f"on stream {prior.stream}")
            access = _Access(lo, hi, stream, self.clocks[stream][stream], write, op)
            # What this access covers and is ordered after can never race with anything it does not.
            region.history = [p for p in region.history if not (
                lo <= p.lo and p.hi <= hi and (write or (p.stream == stream and not p.write)))]
            region.history.append(access)

    def _host_write(self, lo: int, hi: int, op: str) -> None:
        self._tick(HOST)
        self._access(HOST, lo, hi, True, op)

    def _race(self, message: str) -> None:
        self.races.append(message)
        raise RaceError(message)

    # --- tracked memory --------------------------------------------------------------------

    def _track(self, name: str, lo: int, hi: int) -> _Region:
        region = _Region(name, lo, hi)
        bisect.insort(self._regions, region, key=lambda r: r.lo)
        return region

    def _untrack(self, lo: int) -> None:
        self._regions = [r for r in self._regions if r.lo != lo]

    def _overlapping(self, lo: int, hi: int) -> list[_Region]:
        end = bisect.bisect_left(self._regions, hi, key=lambda r: r.lo)
        return [r for r in self._regions[:end] if r.hi > lo]

    def _return_freed_blocks(self) -> None:
        """Blocks whose tensors are all gone go back to their stream's pool (history and all)."""
        live = []
        for block, storage in self._live:
            if storage.expired():
                self._pools.append(block)
            else:
                live.append((block, storage))
        self._live = live


def _returns_fresh_tensors(func) -> bool:
    """Whether ``func`` returns tensors of its own: memory it allocates, neither a view nor its ``out``."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is None for r in returns) and any(
        "Tensor" in str(r.type) for r in returns)


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``tensor``'s bytes: a wrapper subclass (a quantized weight) has none of
    its own, and an op on it is a kernel on every one of its inner tensors."""
    if not hasattr(type(tensor), "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _inner_tensors(getattr(tensor, name))]


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``tensor`` can touch: from its first element to past its last."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size()

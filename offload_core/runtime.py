"""The device operations behind the engine's stream choreography, in one small object.

``CudaRuntime`` is plain ``torch.cuda``. The tests pass a CPU stand-in with the same methods that
checks every cross-stream access for a happens-before order (``testbed/stream_checker.py``).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol

import torch

from .gather import HostCopy

log = logging.getLogger(__name__)


class Runtime(Protocol):
    """Streams, events and device allocations, as ``torch.cuda`` offers them for one device."""

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any: ...

    def use_stream(self, stream: Any) -> AbstractContextManager: ...

    def new_event(self, enable_timing: bool = False) -> Any: ...

    def empty(self, nbytes: int) -> torch.Tensor: ...

    def host_copy(self, target: torch.Tensor, source: torch.Tensor) -> None: ...

    def submit(self, job: Callable[[], Any]) -> Future: ...

    def wait(self, future: Future) -> Any: ...

    def empty_cache(self) -> None: ...

    def discard_last_error(self) -> None: ...

    def capturing(self) -> bool: ...


class CaptureError(RuntimeError):
    """Group offloading asked to run while the current stream captures a CUDA graph."""


def refuse_capture(runtime: Runtime | None) -> None:
    """``CaptureError`` while the current stream captures a CUDA graph (``torch.cuda.graph``, a captured callable),
    before anything is queued: the hooks choose at every call which groups to copy into which device buffers and
    order them with events on a copy stream outside the capture, and wait on the host; the capture would break at
    the first wait, and a replayed graph would redo none of those choices."""
    if runtime is not None and runtime.capturing():
        raise CaptureError("Group offloading cannot run inside a CUDA graph capture: it chooses at every call which "
                           "weights to copy to the device and where, and a replayed graph would not. Run the model "
                           "without CUDA graphs (torch.compile without mode 'reduce-overhead', no torch.cuda.graph "
                           "around it), or capture it without group offloading")


class CudaRuntime:
    """``torch.cuda`` on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._worker: ThreadPoolExecutor | None = None  # made at the first staged copy
        #: Copies between host buffers, by the thread that asks and a few of its own, off the GIL and
        #: OpenMP (no stream is involved); a gather's whole group at once (``HostCopy.many``).
        self.host_copy = HostCopy()

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self, enable_timing: bool = False) -> torch.cuda.Event:
        """An event whose ``synchronize`` sleeps until it is reached (the gather worker waits on the staging
        ring's), rather than spinning a core the compute and the other gathers need."""
        return torch.cuda.Event(enable_timing=enable_timing, blocking=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def submit(self, job: Callable[[], Any]) -> Future:
        """Run ``job`` on the gather worker: one thread, so jobs run in the order they were submitted."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="group-offload-gather")
        return self._worker.submit(self._on_device, job)

    def _on_device(self, job: Callable[[], Any]) -> Any:
        with torch.cuda.device(self.device):  # a thread's current device is its own
            return job()

    def wait(self, future: Future) -> Any:
        """The host waits for a job of the worker; its result (or its error, raised)."""
        return future.result()

    def empty_cache(self) -> None:
        """Hand the caching allocator's unused memory back to the driver (after an out-of-memory)."""
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def capturing(self) -> bool:
        """Whether the current stream of ``device`` captures a CUDA graph."""
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    def discard_last_error(self) -> None:
        """Read and drop the runtime's last error (a refused ``cudaHostRegister`` leaves one).

        Left there, torch's check after the next kernel launch (``cudaGetLastError``) would report
        it as that kernel's failure. A tiny launch makes the check read it, and clear it, here.
        """
        try:
            torch.zeros(1, device=self.device).add_(1)
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:
            log.debug("discarded a CUDA error left by a refused host registration: %s", error)

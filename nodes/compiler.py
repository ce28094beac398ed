"""ComfyUI's memory compiler (v0.35 and newer): comfy-aimdo's allocation graph, which ``comfy.model_prefetch``
opens around a diffusion model's forward (``malloc_graph_begin`` ... ``malloc_graph_end``, a scope per block:
Qwen-Image 2.1, MiniMax H3 and LTX-AV do so) even for a model that opts out of Dynamic VRAM, as the offloaded
one does. As read from comfy-aimdo 0.6.0 (``malloc_graph.py``) and ComfyUI 0.38.1 (``model_prefetch.py``):

- a forward that raises leaves the graph open, scopes pushed: nothing closes it but
  ``cleanup_malloc_graph`` (ComfyUI calls it as sampling ends). A forward run again pushes into it, and
  aimdo answers a refused push, pop or pause with ``RuntimeError("aimdo memory compile error")``. So the
  back-off closes a half-open graph before the call runs again (``close_half_open``), and takes that error
  for what it is there, a call that ran out of memory (``is_out_of_memory``);
- memory allocated while the graph records and kept past it is a "rogue" allocation (freeing one makes the
  device synchronise); ComfyUI keeps what outlives a scope out of the graph with ``pause_malloc_graph``,
  and so do the handle's streaming buffers (``outside_the_compiler``).

Where this ComfyUI has no memory compiler, each of these is what it was without one.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import ContextManager

import torch

import comfy.model_management as mm

from ..offload_core.runtime import CudaRuntime

log = logging.getLogger(__name__)

COMPILE_ERROR = "aimdo memory compile error"  # comfy-aimdo's RuntimeError for a refused graph operation


def _prefetch_module():
    try:
        import comfy.model_prefetch as model_prefetch
    except ImportError:  # ComfyUI before the prefetch queue (0.3.x)
        return None
    return model_prefetch


def _open_graph():
    """This thread's memory-compiler graph if it is open (recording), else None."""
    model_prefetch = _prefetch_module()
    graphs = getattr(model_prefetch, "MALLOC_GRAPHS", None)
    graph = None if graphs is None else graphs.get(threading.get_ident())
    return graph if graph is not None and getattr(graph, "_comfy_active", False) else None


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError``; what ComfyUI takes for one (``is_oom``: an accelerator error of code 2);
    or comfy-aimdo's compile error, which a call that ran out of memory inside the compiler leaves."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    is_oom = getattr(mm, "is_oom", None)
    if is_oom is not None and is_oom(error):
        return True
    return isinstance(error, RuntimeError) and str(error).startswith(COMPILE_ERROR)


def close_half_open() -> None:
    """Abort the memory compiler's graph that a failed forward left open, so that the call running again
    starts a new one instead of pushing into it (ComfyUI's own ``cleanup_malloc_graph``)."""
    if _open_graph() is None:
        return
    log.debug("Group Offload: closing the memory compiler's graph the failed call left open")
    _prefetch_module().cleanup_malloc_graph()


def outside_the_compiler() -> ContextManager:
    """Allocations made in it stay out of an open memory-compiler graph (``pause_malloc_graph``)."""
    pause = getattr(_prefetch_module(), "pause_malloc_graph", None)
    return contextlib.nullcontext() if pause is None or _open_graph() is None else pause()


class ComfyCudaRuntime(CudaRuntime):
    """The handle's CUDA runtime, its streaming buffers allocated outside the memory compiler."""

    def empty(self, nbytes: int) -> torch.Tensor:
        with outside_the_compiler():
            return super().empty(nbytes)

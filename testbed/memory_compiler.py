"""TEST ONLY: a stand-in for ComfyUI's memory compiler (ComfyUI 0.38.1's ``comfy.model_prefetch`` over
comfy-aimdo 0.6.0's ``malloc_graph``), for ComfyUI versions and machines without it. It keeps the contract
as read from that source (none of its code):

- ``malloc_graph_begin(device)`` records a new graph for this thread, or pushes a frame onto the open one;
  ``malloc_graph_end()`` pops it; a forward that raises leaves it open (``_comfy_active``), its scopes pushed;
- ``prefetch_queue_pop(None, device, module, malloc_scope="block")`` moves to the next block's scope
  (``iterate``), with ``module`` None it leaves the last one;
- ``cleanup_malloc_graph()`` aborts an open graph and forgets it (ComfyUI calls it as sampling ends);
- ``pause_malloc_graph()``: allocations meanwhile stay out of the graph;
- the native side refuses a frame pushed while a block scope of an unfinished forward is open, as
  ``RuntimeError("aimdo memory compile error")`` (comfy-aimdo's answer to any refused graph operation).

``install(monkeypatch)`` puts it into ``comfy.model_prefetch`` (made where this ComfyUI has none).
"""
from __future__ import annotations

import sys
import threading
import types

import torch

COMPILE_ERROR = "aimdo memory compile error"


class StandInGraph:
    """comfy-aimdo's ``MallocGraph`` as ComfyUI uses it: frames, block scopes, pauses, aborts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.frames = 1
        self.scopes: list[str] = []
        self.paused = 0
        self.aborted = False
        self._comfy_active = True

    def push(self, name: str | None = None) -> None:
        if name is None and self.scopes:
            raise RuntimeError(COMPILE_ERROR)  # a new forward's frame inside an unfinished forward's block
        if name is None:
            self.frames += 1
        else:
            self.scopes.append(name)

    def pop(self) -> bool:
        if self.scopes:
            self.scopes.pop()
        else:
            self.frames -= 1
        return False

    def iterate(self, name: str | None = None) -> bool:
        if self.scopes:
            self.pop()
        if name is not None:
            self.push(name)
        return False

    def pause(self, sync: bool = False) -> None:
        self.paused += 1

    def resume(self, sync: bool = False) -> None:
        self.paused -= 1

    def abort(self) -> None:
        self.aborted = True
        self.scopes.clear()


class StandInCompiler:
    """The functions of ``comfy.model_prefetch`` that use the graph, and what they saw."""

    def __init__(self) -> None:
        self.MALLOC_GRAPHS: dict[int, StandInGraph] = {}
        self.graphs: list[StandInGraph] = []  # every graph recorded, in order

    def malloc_graph_begin(self, device: torch.device) -> None:
        graph = self.MALLOC_GRAPHS.get(threading.get_ident())
        if graph is None:
            graph = self.MALLOC_GRAPHS[threading.get_ident()] = StandInGraph(device)
            self.graphs.append(graph)
        else:
            graph.push()
        graph._comfy_active = True

    def malloc_graph_end(self) -> None:
        graph = self.MALLOC_GRAPHS.get(threading.get_ident())
        if graph is not None and graph._comfy_active:
            graph.pop()
            graph._comfy_active = graph.frames > 0

    def cleanup_malloc_graph(self) -> None:
        graph = self.MALLOC_GRAPHS.pop(threading.get_ident(), None)
        if graph is not None and graph._comfy_active:
            graph._comfy_active = False
            graph.abort()

    def prefetch_queue_pop(self, queue, device, module, dtype=None, malloc_scope=None, **kwargs) -> None:
        graph = self.MALLOC_GRAPHS.get(threading.get_ident())
        if queue is None and graph is not None and graph._comfy_active and malloc_scope is not None:
            graph.iterate(malloc_scope if module is not None else None)

    def pause_malloc_graph(self, sync: bool = False):
        compiler = self

        class Paused:
            def __enter__(self) -> None:
                graph = compiler.MALLOC_GRAPHS.get(threading.get_ident())
                if graph is not None and graph._comfy_active:
                    graph.pause(sync)

            def __exit__(self, *exc) -> None:
                graph = compiler.MALLOC_GRAPHS.get(threading.get_ident())
                if graph is not None and graph._comfy_active:
                    graph.resume(sync)

        return Paused()

    def open_graph(self) -> StandInGraph | None:
        graph = self.MALLOC_GRAPHS.get(threading.get_ident())
        return graph if graph is not None and graph._comfy_active else None


def install(monkeypatch) -> StandInCompiler:
    """The stand-in's functions in ``comfy.model_prefetch`` for the test (a module made where there is none)."""
    compiler = StandInCompiler()
    module = sys.modules.get("comfy.model_prefetch")
    if module is None:
        import comfy

        module = types.ModuleType("comfy.model_prefetch")
        monkeypatch.setitem(sys.modules, "comfy.model_prefetch", module)
        monkeypatch.setattr(comfy, "model_prefetch", module, raising=False)
    for name in ("MALLOC_GRAPHS", "malloc_graph_begin", "malloc_graph_end", "cleanup_malloc_graph",
                 "prefetch_queue_pop", "pause_malloc_graph"):
        monkeypatch.setattr(module, name, getattr(compiler, name), raising=False)
    return compiler

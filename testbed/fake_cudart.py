"""A stand-in for the CUDA runtime's host-memory registration, so that ComfyUI's real ``pin_memory``
and ``unpin_memory`` run on a machine without a GPU.

:func:`install` puts a :class:`FakeCudart` where ``torch.cuda.cudart()`` returns the runtime and sets
ComfyUI's pinned-memory limit as ComfyUI sets it on a GPU machine (it leaves it at -1 under
``--cpu``, where nothing is pinned). Nothing else changes: each ComfyUI version's own checks (type
names, contiguity, its limit, its bookkeeping in ``PINNED_MEMORY`` / ``TOTAL_PINNED_MEMORY``) run as
they are, and the stand-in answers like the driver: ``cudaSuccess``, or an error code for memory
that is already (or not) registered, or past a registration limit of the "driver".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713


@dataclass
class FakeCudart:
    """Records ``cudaHostRegister`` / ``cudaHostUnregister`` calls and what is registered now."""

    driver_limit: int | None = None  # registrations past this many bytes fail, as a locked-memory limit makes them
    registered: dict[int, int] = field(default_factory=dict)  # address -> size
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # ("register" | "unregister", address, size)
    register_flags: set[int] = field(default_factory=set)  # every flags argument cudaHostRegister was given

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (the runtime's name)
        self.register_flags.add(flags)
        if any(ptr < start + length and start < ptr + size for start, length in self.registered.items()):
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        if self.driver_limit is not None and self.registered_bytes + size > self.driver_limit:
            return CUDA_ERROR_MEMORY_ALLOCATION
        self.registered[ptr] = size
        self.calls.append(("register", ptr, size))
        return CUDA_SUCCESS

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        size = self.registered.pop(ptr, None)
        if size is None:
            return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        self.calls.append(("unregister", ptr, size))
        return CUDA_SUCCESS

    @property
    def registered_bytes(self) -> int:
        return sum(self.registered.values())

    def sizes(self, kind: str) -> list[int]:
        """The sizes of every ``"register"`` or ``"unregister"`` call so far, in order."""
        return [size for call, _, size in self.calls if call == kind]


def install(set_attr: Callable[[Any, str, Any], None] = setattr, comfy_pin_limit: int | None = None,
            driver_limit: int | None = None) -> FakeCudart:
    """Make ComfyUI (already imported) pin through a :class:`FakeCudart`.

    ``set_attr`` is ``monkeypatch.setattr`` in a test (undone when it ends), plain ``setattr`` in a
    server started for tests. ``comfy_pin_limit`` is ComfyUI's ``MAX_PINNED_MEMORY`` (default: 90 %
    of RAM, between the two versions' Linux figures); its pinned-memory bookkeeping starts empty.
    """
    import comfy.model_management as mm

    fake = FakeCudart(driver_limit=driver_limit)
    set_attr(torch.cuda, "cudart", lambda: fake)
    limit = comfy_pin_limit if comfy_pin_limit is not None else mm.get_total_memory(torch.device("cpu")) * 0.9
    set_attr(mm, "MAX_PINNED_MEMORY", limit)
    set_attr(mm, "PINNED_MEMORY", {})
    set_attr(mm, "TOTAL_PINNED_MEMORY", 0)
    return fake


def give_device_memory(set_attr: Callable[[Any, str, Any], None], free: int, total: int = 24 * 2**30,
                       device_type: str = "meta") -> None:
    """Make ComfyUI's ``get_free_memory`` / ``get_total_memory`` answer for ``device_type`` (the meta
    device standing in for a GPU) as the CUDA runtime would answer for a card with these figures."""
    import comfy.model_management as mm

    real_free, real_total = mm.get_free_memory, mm.get_total_memory

    def get_free_memory(dev=None, torch_free_too=False):
        if dev is None or dev.type != device_type:
            return real_free(dev, torch_free_too)
        return (free, free) if torch_free_too else free

    def get_total_memory(dev=None, torch_total_too=False):
        if dev is None or dev.type != device_type:
            return real_total(dev, torch_total_too)
        return (total, total) if torch_total_too else total

    set_attr(mm, "get_free_memory", get_free_memory)
    set_attr(mm, "get_total_memory", get_total_memory)

"""Running a model call again, with less of the model on the device, when it runs out of device memory.

The whole call runs again: a group's forward cannot be resumed part-way through a model, and running
the same computation again gives the same output, bit for bit. The failed call's activations go with
its exception, before the call runs again.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

from .engine import GroupOffloadHandle
from .residency import Residency

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutOfMemoryAfterBackOff(torch.OutOfMemoryError):
    """The call ran out of device memory under every plan ``call_backing_off`` fell back to.

    ``tried`` lists those plans in order, the first one the plan the call started with.
    """

    def __init__(self, tried: list[Residency], advice: str = "") -> None:
        self.tried = tried
        plans = " -> ".join(str(residency) for residency in tried)
        super().__init__(f"Group Offload: out of device memory under every plan it could fall back to: {plans}. "
                         f"{advice}".rstrip())


def is_torch_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError)


def call_backing_off(handle: GroupOffloadHandle, call: Callable[[], T],
                     advice: Callable[[], str] | None = None, *,
                     out_of_memory: Callable[[BaseException], bool] = is_torch_out_of_memory,
                     before_retry: Callable[[], None] | None = None) -> T:
    """``call()``; each time it raises an error ``out_of_memory`` recognises (``torch.OutOfMemoryError``
    unless told), ``handle.back_off()`` and call it again, after ``before_retry()`` (what the failed call
    left half-done around the model and must not run into again, such as a memory compiler's scope).

    When no plan holds less, raises ``OutOfMemoryAfterBackOff`` (from the last error), its message
    ending in ``advice()`` (what would fit, in the caller's terms).
    """
    tried = [handle.residency()]
    while True:
        try:
            return call()
        except Exception as error:
            if not out_of_memory(error):
                raise
            if not handle.back_off():
                raise OutOfMemoryAfterBackOff(tried, advice() if advice is not None else "") from error
            log.debug("out of device memory (%s); falling back to %s", error, handle.residency())
        # Out of the except block, the error and the failed call's frames are gone.
        if before_retry is not None:
            before_retry()
        handle.empty_device_cache()
        tried.append(handle.residency())

"""The check that a model uses its offloaded blocks only through the handle's entries.

A block's tensors used outside every entry (the model reads a weight of a block straight, never calling
the block or a module in it) would compute from the host mirror: silently on the CPU, a device mismatch
on a GPU. ``OutsideUseWatch`` is a ``TorchFunctionMode`` the caller holds around the model calls that
learn the entries; it raises ``OutsideUseError`` at the first torch function given such a tensor, before
that function runs. Outside those calls it costs nothing.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .group import ModuleGroup


class OutsideUseError(RuntimeError):
    """A tensor of an offloaded block was used where no entry of its group runs."""

    def __init__(self, qualname: str, message: str) -> None:
        super().__init__(message)
        self.qualname = qualname


class OpenGroups(Protocol):
    """What the watch asks of a handle (or of its ``GroupHooks``)."""

    groups: list[ModuleGroup]

    @property
    def busy(self) -> bool: ...

    def is_open(self, group: ModuleGroup) -> bool: ...


class OutsideUseWatch(TorchFunctionMode):
    """Raises ``OutsideUseError`` at a torch function given a tensor of a group of ``hooks`` that is not open;
    ``message(qualname)`` words it."""

    def __init__(self, hooks: OpenGroups, message: Callable[[str], str]) -> None:
        super().__init__()
        self._hooks = hooks
        self._message = message
        self._owners: dict[int, tuple[ModuleGroup, str]] = {}
        for group in hooks.groups:
            for binding in group.bindings:
                self._owners[id(binding.current())] = group, binding.qualname

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._hooks.busy and not torch.compiler.is_compiling():
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    owner = self._owners.get(id(tensor))
                    if owner is not None and not self._hooks.is_open(owner[0]):
                        raise OutsideUseError(owner[1], self._message(owner[1]))
        return func(*args, **kwargs)

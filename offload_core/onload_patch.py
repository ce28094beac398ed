"""The onload patch: a computation applied on the device to named weights after every onload (a LoRA),
so that the host mirrors stay pristine.

Where it runs is the transfers' business (``transfers.py``): queued after the copy that brought the
group, on the stream that copy ran on, before the group's ``ready`` event.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .group import ModuleGroup

#: Computes a patched weight on the device from the freshly copied one (e.g. LoRA): (name, weight) -> weight.
PatchFn = Callable[[str, torch.Tensor], torch.Tensor]

#: A device tensor the patch rewrites, with the name the patch knows it by.
PatchTarget = tuple[str, torch.Tensor]


class OnloadPatch:
    """The patch in effect for one handle's groups, the bindings it applies to, and the device memory it holds."""

    def __init__(self) -> None:
        self.device_bytes = 0  # what the patch holds or needs on the device besides the groups
        self._fn: PatchFn | None = None
        self._bindings: dict[int, list[int]] = {}  # group index -> binding indices the patch applies to

    def set(self, fn: PatchFn | None, names: Iterable[str], device_bytes: int, groups: list[ModuleGroup]) -> None:
        """Apply ``fn`` to the tensors named ``names`` from the next onload on (none named: no patch)."""
        wanted = set(names)
        self._fn = fn if wanted else None
        self.device_bytes = device_bytes if wanted else 0
        self._bindings = {g.index: [i for i, n in enumerate(g.qualnames()) if n in wanted] for g in groups}

    def targets(self, group: ModuleGroup) -> list[PatchTarget]:
        """The device tensors of ``group`` the patch rewrites (the group shows its slab), by name."""
        if self._fn is None:
            return []
        return [(group.bindings[i].qualname, group.device_tensor(i)) for i in self._bindings[group.index]]

    def apply(self, targets: list[PatchTarget]) -> None:
        """Rewrite each target in place with the patch's result (queued on the current stream)."""
        for qualname, tensor in targets:
            tensor.copy_(self._fn(qualname, tensor))

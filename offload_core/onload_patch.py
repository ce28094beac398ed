"""The onload patch: a computation applied on the device to named weights after every onload (a LoRA),
so that the host mirrors stay pristine.

Where it runs is the transfers' business (``transfers.py``): on the compute stream, by the host thread,
once the compute has waited for the copy that brought the group (its ``ready`` event), once per onload.
Never on the copy stream: its temporaries would come from that stream's pool, which couples the streams
under cudaMallocAsync.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .group import ModuleGroup

#: Computes a patched weight on the device from the freshly copied one (e.g. LoRA): (name, weight) -> weight.
PatchFn = Callable[[str, torch.Tensor], torch.Tensor]


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

    def apply(self, group: ModuleGroup) -> None:
        """Rewrite the tensors of ``group`` the patch names (the group shows its slab) in place with its result
        (queued on the current stream)."""
        if self._fn is None:
            return
        for i in self._bindings[group.index]:
            tensor = group.device_tensor(i)
            tensor.copy_(self._fn(group.bindings[i].qualname, tensor))

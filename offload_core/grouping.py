"""How a handle's blocks become groups: what it is built for (``OffloadConfig``), the chunks of blocks, and
which chunks get a packed host mirror within the host budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .group import FillFn, ModuleGroup, check_unshared, split_into_groups
from .hostmem import FileMappings, SourceFiles
from .mirror import pack_layout
from .residency import plan_packing, plan_residency
from .subclass import flatten


@dataclass(frozen=True)
class OffloadConfig:
    """What the handle is built for; which groups stay resident is not in it (``set_resident_bytes`` re-plans)."""

    onload_device: torch.device
    offload_device: torch.device
    blocks_per_group: int = 1
    prefetch: int = 1
    pin_memory: bool = True
    entry_methods: tuple[str, ...] = ("forward",)

    def validate(self) -> None:
        if not isinstance(self.blocks_per_group, int) or self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be an integer >= 1, got {self.blocks_per_group!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (0 = synchronous onload), got {self.prefetch!r}")
        names = self.entry_methods
        if not names or not all(isinstance(name, str) for name in names) or len(set(names)) < len(names):
            raise ValueError(f"entry_methods must name one or more distinct block methods, got {names!r}")
        if self.offload_device.type != "cpu":
            raise ValueError(f"offload_device must be the CPU (host mirrors live in host memory), got {self.offload_device}")


def check_resident_bytes(resident_bytes: int) -> None:
    if resident_bytes < 0:
        raise ValueError(f"resident_bytes must be >= 0 (0 = stream every group), got {resident_bytes!r}")


def check_host_budget(host_budget: int | None, fill: FillFn | None) -> None:
    if host_budget is not None and (not isinstance(host_budget, int) or host_budget < 0):
        raise ValueError(f"host_budget must be None (pack every group) or an integer >= 0, got {host_budget!r}")
    if host_budget is not None and fill is not None:
        raise ValueError("fill writes every tensor into a packed host mirror: it cannot go with a host_budget, "
                         "beyond which the tensors stay where they are (make them views of the file instead)")


def build_groups(model: nn.Module, blocks: list[nn.Module], blocks_per_group: int, resident_bytes: int,
                 host_budget: int | None, fill: FillFn | None, progress: Callable[[int, int], None] | None,
                 returnable: bool = False) -> tuple[list[ModuleGroup], SourceFiles, SourceFiles]:
    """``blocks`` in groups of ``blocks_per_group``, each with its host copy (``apply_group_offload`` says
    which); the mapped files that the groups kept in place read from; and (``returnable``) those the packed
    groups can be given back to (``ModuleGroup.returnable_bytes``: sealed, without a lease, since nothing reads them)."""
    qualnames = {id(m): (name + "." if name else "") for name, m in model.named_modules(remove_duplicate=False)}
    chunks = split_into_groups(blocks, blocks_per_group)
    check_unshared(model, chunks, qualnames)
    groups: list[ModuleGroup] = []
    sources, returnable_files = SourceFiles(), SourceFiles()
    packed_chunks = _packed_chunks(chunks, resident_bytes, host_budget)
    files = (FileMappings(), sources) if returnable or not all(packed_chunks) else None  # (/proc/self/maps read once)
    for chunk, packed in zip(chunks, packed_chunks):
        groups.append(ModuleGroup(len(groups), chunk, qualnames, fill, files, packed, returnable_files if returnable
                                  else None))
        if progress is not None:
            progress(len(groups), len(chunks))
    sources.seal()
    returnable_files.seal(lease=False)
    return groups, sources, returnable_files


def _packed_chunks(chunks: list[list[nn.Module]], resident_bytes: int, host_budget: int | None) -> list[bool]:
    """Which chunks of blocks get a packed host mirror within ``host_budget`` (``plan_packing``, on the
    residency planned for ``resident_bytes``); a chunk with a tensor off the host is packed regardless."""
    if host_budget is None:
        return [True] * len(chunks)
    tensors = [_chunk_tensors(chunk) for chunk in chunks]
    sizes = [pack_layout([inner for t in chunk for inner in flatten(t)[1]])[1] for chunk in tensors]  # as packed
    packed = plan_packing(sizes, plan_residency(sizes, resident_bytes), host_budget)
    return [p or not all(_on_the_host(t) for t in chunk) for p, chunk in zip(packed, tensors)]


def _chunk_tensors(chunk: list[nn.Module]) -> list[torch.Tensor]:
    unique = {id(t): t for block in chunk for t in (*block.parameters(), *block.buffers())}
    return list(unique.values())


def _on_the_host(tensor: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in flatten(tensor)[1])

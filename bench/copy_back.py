"""The copy-back baseline, for the benchmarks only: diffusers' group offloading with ``use_stream=False``.

diffusers (``hooks/group_offloading.py``, before PR #12910) onloads a group by copying each tensor
from pageable host memory (``param.data = param.data.to(device)``) and offloads it with
``module.to("cpu")``: a device-to-host copy of every weight into freshly allocated pageable host
memory, after every group, every pass.  That is the seed's 54 s/step baseline.

:class:`CopyBackOffload` does the same with forward hooks (one block per group, per-tensor copies,
``copy=True`` so that the copies also happen when the "device" is the CPU) and counts what it moves
in the engine's own :class:`~offload_core.ledger.TransferLedger`, so both read the same way.  The
product never copies back; this exists to be compared against.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from offload_core.ledger import TransferLedger


def _tensors(block: nn.Module) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """Every parameter and buffer slot of ``block``: (owning table, name, tensor)."""
    for module in block.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    yield table, name, tensor


def _move(block: nn.Module, device: torch.device) -> tuple[int, int]:
    """Copy every tensor of ``block`` to ``device`` (fresh memory, one copy each); returns (bytes, copies)."""
    nbytes = copies = 0
    for table, name, tensor in _tensors(block):
        moved = tensor.data.to(device, copy=True)
        if isinstance(tensor, nn.Parameter):
            tensor.data = moved
        else:
            table[name] = moved
        nbytes += moved.numel() * moved.element_size()
        copies += 1
    return nbytes, copies


class CopyBackOffload:
    """Per block: copy in before it runs, copy back into new host memory after it ran."""

    def __init__(self, blocks: Sequence[nn.Module], onload_device: torch.device | str) -> None:
        self.onload_device = torch.device(onload_device)
        self.ledger = TransferLedger()
        self._hooks = []
        for block in blocks:
            self._hooks.append(block.register_forward_pre_hook(lambda module, args: self._onload(module)))
            self._hooks.append(block.register_forward_hook(lambda module, args, output: self._offload(module)))

    def _onload(self, block: nn.Module) -> None:
        started = time.perf_counter()
        nbytes, copies = _move(block, self.onload_device)
        self.ledger.bytes_h2d += nbytes
        self.ledger.copies_h2d += copies
        self.ledger.onloads += 1
        self.ledger.sync_onloads += 1
        self.ledger.record_hook(time.perf_counter() - started, entered=True)

    def _offload(self, block: nn.Module) -> None:
        started = time.perf_counter()
        nbytes, copies = _move(block, torch.device("cpu"))
        self.ledger.bytes_d2h += nbytes
        self.ledger.copies_d2h += copies
        self.ledger.record_hook(time.perf_counter() - started, entered=False)

    def stats(self) -> dict[str, float | int]:
        return self.ledger.as_dict()

    def reset_stats(self) -> None:
        self.ledger = TransferLedger()

    def remove(self) -> None:
        """Unhook; the weights stay where the last offload put them (host memory)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

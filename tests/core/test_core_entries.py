"""offload_core's learnt entries (``learn_entries``) and the outside-use check on plain torch modules: a
model that calls the parts of its blocks one by one streams bit-identically, the entries settle after a
call that ran blocks, and a weight read past every entry raises before it is used."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_core import OutsideUseError, OutsideUseWatch, apply_group_offload

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Pair(nn.Module):
    """No ``forward``: the model calls its two Linears itself."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)


class PartsNet(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16, straight: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Pair(width) for _ in range(depth))
        self.straight = straight  # read the first Linear's weight from here instead of calling it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for pair in self.blocks:
            h = F.linear(x, pair.first.weight) if self.straight else pair.first(x)
            x = x + pair.second(torch.tanh(h))
        return x


def offloaded_call(handle, model: nn.Module, x: torch.Tensor, watch: bool = False) -> torch.Tensor:
    """One model call as the node makes it: under the check while learning, the runs closed at its end."""
    try:
        if watch:
            with OutsideUseWatch(handle, lambda name: f"{name} used outside"):
                return model(x)
        return model(x)
    finally:
        handle.close_open_groups()


@pytest.mark.parametrize("device", DEVICES)
def test_parts_called_one_by_one_stream_bit_identically(device):
    torch.manual_seed(0)
    model = PartsNet()
    reference = copy.deepcopy(model).to(device)
    x = torch.randn(2, 16)
    handle = apply_group_offload(model, list(model.blocks), device, prefetch=1, learn_entries=True)
    blocks_bytes = sum(g.nbytes for g in handle.groups)
    for call in range(3):
        sent = handle.stats()["bytes_h2d"]
        out = offloaded_call(handle, model, x.to(device), watch=call == 0)
        assert torch.equal(out, reference(x.to(device)))
        assert handle.stats()["bytes_h2d"] - sent >= blocks_bytes
        if call == 0:
            assert handle.settle_entries() == ["Linear.forward"]
    assert handle.stats()["bytes_d2h"] == 0
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_parts_called_one_by_one_are_stream_ordered(checker, prefetch):
    """The runs the parts open and the end of the call closes, under the stream checker standing in for a CUDA
    device: every copy into a slab ordered before the compute that reads it and after the last one that read
    what it overwrites, half the groups resident."""
    torch.manual_seed(0)
    model = PartsNet(depth=6)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16)
    half = sum(p.nbytes for p in model.blocks.parameters()) // 2
    handle = apply_group_offload(model, list(model.blocks), "cpu", prefetch=prefetch, runtime=checker,
                                 resident_bytes=half, learn_entries=True)
    with torch.inference_mode():
        for call in range(3):
            assert torch.equal(offloaded_call(handle, model, x, watch=call == 0), reference(x))
            if call == 0:
                handle.settle_entries()
    stats = handle.stats()
    assert 0 < stats["resident_groups"] < stats["groups"] and stats["copies_h2d"] > 0 and stats["bytes_d2h"] == 0
    handle.remove()


def test_a_forward_block_keeps_no_inner_entry_once_settled():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(3))
    model = nn.Sequential(*blocks)
    handle = apply_group_offload(model, list(blocks), "cpu", learn_entries=True)
    offloaded_call(handle, model, torch.randn(2, 8), watch=True)
    assert handle.settle_entries() == []
    assert not any("forward" in vars(m) for block in blocks for m in block.modules() if m is not block)


def test_a_weight_read_past_every_entry_raises_before_it_is_used():
    model = PartsNet(straight=True)
    handle = apply_group_offload(model, list(model.blocks), "cpu", learn_entries=True)
    with pytest.raises(OutsideUseError, match=r"^blocks\.0\.first\.weight used outside$"):
        offloaded_call(handle, model, torch.randn(2, 16), watch=True)

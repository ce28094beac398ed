"""The core's public face: what the handle tells ``nodes/`` (the groups' snapshot, the blocks' tensors, the
ledger's figures), and that ``nodes/`` reads the core through it alone."""
from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from torch import nn

from testbed.comfy_boot import REPO_ROOT
from offload_core import apply_group_offload

# Attributes of the core's inner objects (the handle's groups, their mirrors and bindings, its ledger).
CORE_INTERNALS = {"groups", "mirror", "bindings", "ledger"}


class RefusesFirstPin:
    """A Pinner that refuses its first call and pins (records) the others."""

    def __init__(self) -> None:
        self.calls = 0

    def pin(self, buffer: torch.Tensor) -> bool:
        self.calls += 1
        return self.calls > 1

    def unpin(self, buffer: torch.Tensor) -> None:
        pass


class TiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.down = nn.Linear(16, 16)
        self.down.weight = self.up.weight
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x)) * self.scale


def test_the_snapshot_shows_each_groups_residency_and_host_copy():
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
    probe = apply_group_offload(blocks, list(blocks), "cpu")
    group = probe.snapshot()[0].nbytes  # a group's packed size, alignment included
    probe.remove()
    handle = apply_group_offload(blocks, list(blocks), "cpu", pinner=RefusesFirstPin(),
                                 resident_bytes=group, host_budget=3 * group)
    snapshot = handle.snapshot()
    stats = handle.stats()

    assert [g.index for g in snapshot] == [0, 1, 2, 3] and {g.nbytes for g in snapshot} == {group}
    assert sum(g.resident for g in snapshot) == stats["resident_groups"] == 1
    assert sum(g.nbytes for g in snapshot if g.packed) == stats["packed_bytes"] == 3 * group
    assert sum(g.nbytes for g in snapshot if g.pinned) == stats["pinned_bytes"]
    assert not any(g.pinned for g in snapshot if g.resident or not g.packed), "only streamed packed groups pin"
    assert [g.index for g in snapshot if not g.resident and g.packed and not g.pinned] == [0], "its pin was refused"

    handle.set_resident_bytes(0)
    assert not any(g.resident for g in handle.snapshot())
    assert sum(g.resident for g in snapshot) == 1, "a snapshot is the moment it was taken"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot[0].resident = False
    handle.remove()


def test_the_blocks_tensors_and_the_ledgers_figures():
    blocks = nn.ModuleList(TiedBlock() for _ in range(3))
    handle = apply_group_offload(blocks, list(blocks), "cpu", prefetch=1)
    tensors = handle.block_tensors()
    expected = [t for block in blocks for t in (block.up.weight, block.up.bias, block.down.bias, block.scale)]
    assert sorted(map(id, tensors)) == sorted(map(id, expected)), "each tensor once, the tied weight too"

    assert handle.ledger_figures()["bytes_h2d"] == 0
    x = torch.randn(2, 16)
    for block in blocks:
        x = block(x)
    figures = handle.ledger_figures()
    group = handle.snapshot()[0].nbytes
    assert figures["hook_calls"] == 3 and figures["bytes_h2d"] == figures["copies_h2d"] * group > 0
    assert figures["bytes_d2h"] == 0
    stats = handle.stats()
    assert figures == {name: stats[name] for name in figures}
    handle.remove()


def _attributes_read(source: str) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}


def test_nodes_read_the_core_through_its_face_alone():
    reached = {path.name: sorted(_attributes_read(path.read_text()) & CORE_INTERNALS)
               for path in sorted((REPO_ROOT / "nodes").glob("*.py"))}
    assert {name: found for name, found in reached.items() if found} == {}, (
        "nodes/ reaches into the core's inner objects: read the handle's snapshot(), block_tensors() or "
        "ledger_figures() instead")

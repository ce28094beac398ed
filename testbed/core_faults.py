"""Faults, patches and probes put into the core's models: out-of-memory inside a block, refused pins, failing and
low-rank onload patches, and the residency planner's searches counted."""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import pytest
import torch
from torch import nn

from offload_core import apply_group_offload, residency
from testbed.core_models import host_bytes, make_pair, mapped_pair
from testbed.stream_checker import StreamChecker


@contextmanager
def out_of_memory_inside(block: nn.Module, failures: int) -> Iterator[list[int]]:
    """The block's first ``failures`` runs raise ``torch.OutOfMemoryError`` part-way through (as an
    activation that does not fit would), after its group has been entered; yields the runs' count."""
    runs = [0]

    def fail(module, args):
        runs[0] += 1
        if runs[0] <= failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    hook = block.mlp.register_forward_pre_hook(fail)
    try:
        yield runs
    finally:
        hook.remove()


def check_doubling_patch(handle, reference: nn.Module, offloaded: nn.Module, x: torch.Tensor) -> None:
    """An onload patch that doubles two tensors of ``offloaded`` computes as ``reference`` with them doubled."""
    handle.set_onload_patch(lambda name, w: w * 2, ["blocks.2.attn.weight", "blocks.5.mlp.0.bias"])
    reference.blocks[2].attn.weight.data.mul_(2)
    reference.blocks[5].mlp[0].bias.data.mul_(2)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))


def limit_pins_to_three_groups(checker: StreamChecker) -> int:
    """Make the driver refuse registrations past three (and a half) of ``make_pair``'s six groups; their size."""
    model = make_pair("cpu")[1]
    probe = apply_group_offload(model, model.blocks, "cpu", runtime=checker)
    group = probe.groups[0].nbytes
    probe.remove()
    checker.cudart.driver_limit = 3 * group + group // 2
    return group


def fails_then_recovers(handle, reference, offloaded, x, error: type[BaseException], match: str) -> None:
    """The first call fails with ``error`` while group 2 is onloaded, which leaves it dropped from the device; the
    next calls compute ``reference``'s output again. Removes the handle."""
    with torch.inference_mode():
        expected = reference(x)
        with pytest.raises(error, match=match):
            offloaded(x)
        assert not handle.groups[2].onloaded, "dropped from the device"
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
    handle.remove()


PATCHED = ["blocks.2.attn.weight", "blocks.2.mlp.0.weight", "blocks.5.mlp.0.bias"]


class LowRankPatch:
    """A LoRA's shape of patch (``w + up @ down``, temporaries and all), counting its calls by name;
    its call number ``failing`` runs out of device memory instead (after the earlier ones wrote their weights)."""

    def __init__(self, failing: int | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self._failing = failing

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if sum(self.calls.values()) == self._failing:
            self._failing = None
            raise torch.OutOfMemoryError("out of device memory in the patch (test)")
        self.calls[name] += 1
        return weight + _delta(name, weight)


def _delta(name: str, weight: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(len(name))
    rows = weight.reshape(weight.shape[0], -1)
    up = torch.randn(rows.shape[0], 2, generator=generator, dtype=weight.dtype)
    down = torch.randn(2, rows.shape[1], generator=generator, dtype=weight.dtype)
    return (up @ down).reshape(weight.shape)


def patched(reference) -> None:
    for name, weight in reference.named_parameters():
        if name in PATCHED:
            weight.data.add_(_delta(name, weight.data))


def offloaded_on_a_route(tmp_path, checker, route: str, resident: bool):
    """``direct``: pinned packed mirrors, copied on the copy stream by the host thread; ``staged``: groups
    kept in place, gathered and copied by the gather worker. ``resident``: half the groups stay on the device."""
    reference, offloaded, x = make_pair("cpu") if route == "direct" else mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1,
                                 resident_bytes=host_bytes(offloaded) // 2 if resident else 0,
                                 host_budget=None if route == "direct" else 0)
    assert handle._transfers.staged(handle.groups[2]) == (route == "staged")
    return reference, offloaded, x, handle


def plannings(call: Callable[[], object], search=residency._plans_by_resident_bytes) -> list[tuple[list[int], int]]:
    """The residency plans ``call`` makes, as (group bytes, budget): each time ``search``, the planner's search
    over the plans, runs (the pack's own module where ComfyUI loaded it, for a node's build)."""
    runs = []
    code = search.__code__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            runs.append((list(frame.f_locals["group_bytes"]), frame.f_locals["budget"]))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return runs

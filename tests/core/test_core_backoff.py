"""Backing off after an out-of-memory: the fallback plans, and the engine running a call again with less
of the model on the device, under the stream-order checker (testbed/stream_checker.py).

The checker stands in for the CUDA runtime: it refuses chosen allocations as a full device does, and
when the cache is emptied it checks that no copy may still write memory that was freed.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from offload_core import OutOfMemoryAfterBackOff, apply_group_offload, call_backing_off
from offload_core.residency import backed_off_plan, device_footprint
from testbed.stream_checker import RaceError, StreamChecker
from testbed.core_models import make_pair
from testbed.core_faults import out_of_memory_inside


# --- the fallback plans ------------------------------------------------------------------------

def fallbacks(group_bytes: list[int], resident: list[bool], prefetch: int) -> list[tuple[list[bool], int]]:
    """Every plan ``backed_off_plan`` falls back to from (resident, prefetch), in order."""
    plans = []
    while (fallback := backed_off_plan(group_bytes, resident, prefetch)) is not None:
        resident, prefetch = fallback
        plans.append(fallback)
    return plans


@pytest.mark.parametrize("groups, prefetch", [(4, 1), (6, 2), (60, 1), (60, 3), (17, 0)])
def test_each_fallback_holds_at_most_half_until_every_group_streams_with_prefetch_1(groups, prefetch):
    group_bytes = [1000] * groups
    held = device_footprint(group_bytes, [True] * groups, prefetch)
    plans = fallbacks(group_bytes, [True] * groups, prefetch)
    for resident, depth in plans:
        footprint = device_footprint(group_bytes, resident, depth)
        every_group_streamed = device_footprint(group_bytes, [False] * groups, depth)
        assert footprint <= max(held // 2, every_group_streamed) and footprint < held
        held = footprint
    assert plans[-1] == ([False] * groups, min(prefetch, 1))
    assert len(plans) <= 8, "halving: a few tries, not one per group"


def test_sixty_equal_groups_fall_back_by_halves():
    group_bytes = [1000] * 60
    plans = fallbacks(group_bytes, [True] * 60, 2)
    assert [(resident.count(True), depth) for resident, depth in plans] == [
        (27, 2), (12, 2), (4, 2), (0, 2), (0, 1)]  # footprints 30, 15, 7, 3, 2 groups' worth


def test_the_groups_that_stay_resident_are_spread_out():
    resident, _ = backed_off_plan([1000] * 12, [True] * 12, 1)
    streamed = [i for i, stays in enumerate(resident) if not stays]
    assert resident.count(True) == 4 and max(b - a for a, b in zip(streamed, streamed[1:])) <= 2


def test_no_fallback_that_would_hold_more():
    # One big resident group and a small streamed one hold 11; streaming both would need two buffers of 10.
    assert backed_off_plan([10, 1], [True, False], 1) is None
    assert backed_off_plan([1000], [True], 1) is None, "streaming a lone group takes its size too"
    assert backed_off_plan([1000] * 2, [True] * 2, 1) is None, "as do two buffers for two groups"
    assert backed_off_plan([1000] * 4, [False] * 4, 1) is None
    assert backed_off_plan([1000] * 4, [False] * 4, 0) is None


# --- the engine under the checker --------------------------------------------------------------

def offload(model: nn.Module, checker: StreamChecker, resident_share: float = 1.0, **kwargs):
    handle = apply_group_offload(model, model.blocks, "cpu", runtime=checker, **kwargs)
    handle.set_resident_bytes(int(resident_share * sum(g.nbytes for g in handle.groups)))
    return handle


@pytest.mark.parametrize("block", [0, 3, 5])
def test_an_allocation_refused_in_the_first_forward_backs_off_once(checker, caplog, block):
    """Every group resident, each one allocated at its first use: the block's allocation fails."""
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=1)
    checker.out_of_memory_at = {block}
    caplog.set_level(logging.WARNING, logger="offload_core")
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(call_backing_off(handle, lambda: offloaded(x)), expected)
        stats = handle.stats()
        assert (stats["back_offs"], stats["resident_groups"]) == (1, 1), "6 groups' worth, then 3: one and two buffers"
        handle.reset_stats()
        for _ in range(2):
            assert torch.equal(call_backing_off(handle, lambda: offloaded(x)), expected)
    stats = handle.stats()
    assert stats["back_offs"] == 0 and stats["sync_onloads"] == 0, "the retried forward learnt the whole order"
    assert stats["copies_h2d"] == 2 * (len(handle.groups) - 1), "each streamed group once a forward"
    assert "did not run in the first forward" not in caplog.text


@pytest.mark.parametrize("prefetch", [1, 2])
def test_running_out_inside_a_block_with_copies_in_flight_drains_them_first(checker, prefetch):
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, resident_share=0.5, prefetch=prefetch)
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)  # the order is learnt: the next forward prefetches
        before = handle.residency()
        with out_of_memory_inside(offloaded.blocks[2], failures=1) as runs:
            assert torch.equal(call_backing_off(handle, lambda: offloaded(x)), expected)
        assert runs == [2]
        assert handle.residency().resident_groups < before.resident_groups
        assert torch.equal(offloaded(x), expected)
    assert checker.released > 0, "the freed buffers went back to the driver, checked"


def test_the_checker_catches_buffers_freed_while_a_copy_still_writes_them(checker):
    """The negative control: a back-off that frees the streaming buffers without draining the copies."""
    _, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, resident_share=0.0, prefetch=2)
    handle._finish_copies = lambda: None  # (not through monkeypatch: it would keep the handle past the checker)
    with torch.inference_mode():
        offloaded(x)
        with out_of_memory_inside(offloaded.blocks[2], failures=1), pytest.raises(RaceError, match="once freed"):
            call_backing_off(handle, lambda: offloaded(x))
    checker.races.clear()


def test_groups_that_stay_resident_keep_their_device_copy(checker):
    reference, offloaded, x = make_pair("cpu", depth=12)
    handle = offload(offloaded, checker, prefetch=1)
    with torch.inference_mode():
        expected = reference(x)
        offloaded(x)
        slabs = {g.index: g.slab.data_ptr() for g in handle.groups}
        handle.reset_stats()
        with out_of_memory_inside(offloaded.blocks[11], failures=1):
            assert torch.equal(call_backing_off(handle, lambda: offloaded(x)), expected)
    stays = [g for g in handle.groups if g.resident]
    assert len(stays) == 4 and all(g.slab.data_ptr() == slabs[g.index] for g in stays)
    # The eight groups that now stream, and the next forward's first one, prefetched: no resident one again.
    assert handle.stats()["copies_h2d"] == 8 + 1


def test_out_of_memory_under_every_plan_names_them_and_leaves_the_handle_working(checker):
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=2)
    with torch.inference_mode():
        expected = reference(x)
        with out_of_memory_inside(offloaded.blocks[4], failures=100) as runs:
            with pytest.raises(OutOfMemoryAfterBackOff) as raised:
                call_backing_off(handle, lambda: offloaded(x), advice=lambda: "Try a smaller input.")
        error = raised.value
        assert isinstance(error, torch.OutOfMemoryError) and isinstance(error.__cause__, torch.OutOfMemoryError)
        assert [(r.resident_groups, r.prefetch) for r in error.tried] == [(6, 2), (0, 2), (0, 1)]
        assert runs == [3] and handle.stats()["back_offs"] == 2
        message = str(error)
        assert message.startswith("Group Offload: out of device memory under every plan it could fall back to: "
                                  "6 of 6 groups resident, prefetch 2")
        assert "-> 0 of 6 groups resident, prefetch 1 (" in message and message.endswith(". Try a smaller input.")
        assert torch.equal(offloaded(x), expected), "the handle runs on under the last plan"
        handle.set_resident_bytes(sum(g.nbytes for g in handle.groups))
        assert (handle.residency().resident_groups, handle.prefetch, handle.backed_off) == (6, 2, False)
        assert torch.equal(offloaded(x), expected)
    assert checker.races == []


def test_other_errors_are_not_retried(checker):
    _, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker)

    def fail():
        raise RuntimeError("not a memory problem")

    with pytest.raises(RuntimeError, match="not a memory problem"):
        call_backing_off(handle, fail)
    assert handle.stats()["back_offs"] == 0 and handle.residency().resident_groups == len(handle.groups)

"""Where the onload patch (a LoRA) runs (issue 32 item 3): on the compute stream, once it has waited for
its group's copy, once per onload, for the direct copy from a pinned mirror and for the gather worker's
staged copy alike. Nothing allocates on the copy stream: under cudaMallocAsync a block freed there and
handed to the compute stream would order the compute after the next group's copy, unseen.

Under the stream checker (testbed/stream_checker.py), which counts the allocations made on each stream.
"""
from __future__ import annotations


import pytest
import torch

from offload_core import apply_group_offload
from testbed.stream_checker import COMPUTE
from testbed.core_models import make_pair
from testbed.core_models import host_bytes, mapped_pair
from testbed.core_faults import fails_then_recovers
from testbed.core_faults import LowRankPatch, PATCHED, offloaded_on_a_route, patched

STEPS = 3


ROUTES = pytest.mark.parametrize("route,resident", [("direct", False), ("direct", True), ("staged", False),
                                                    ("staged", True)])


@ROUTES
def test_the_patch_runs_on_the_compute_stream_once_per_onload(tmp_path, checker, route, resident):
    reference, offloaded, x, handle = offloaded_on_a_route(tmp_path, checker, route, resident)
    patch = LowRankPatch()
    handle.set_onload_patch(patch, PATCHED)
    patched(reference)
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(STEPS):
            assert torch.equal(offloaded(x), expected)
    copy_stream = handle._transfers.copy_stream.name
    assert checker.allocations_on[copy_stream] == 0, "nothing allocated while the copy stream was current"
    assert checker.allocations_on[COMPUTE] > 0
    group_of = {name: handle.groups[int(name.split(".")[1])] for name in PATCHED}
    assert any(g.resident for g in group_of.values()) == resident
    assert patch.calls == {name: 1 if group.resident else STEPS for name, group in group_of.items()}, \
        "a resident group patched at its onload, a streamed one at each"
    handle.set_onload_patch(None)
    assert torch.equal(offloaded(x), make_pair("cpu")[0](x)), "the host mirrors stayed pristine"
    handle.remove()


@ROUTES
def test_a_patch_failing_on_the_compute_stream_drops_its_group(tmp_path, checker, route, resident):
    """Its second weight runs out of memory after the first one was written: the group computes from its
    mirror again, its buffer reused only after the patch's kernels; the next call copies and patches it anew."""
    reference, offloaded, x, handle = offloaded_on_a_route(tmp_path, checker, route, resident)
    handle.set_onload_patch(LowRankPatch(failing=1), PATCHED)
    patched(reference)
    fails_then_recovers(handle, reference, offloaded, x, torch.OutOfMemoryError, "in the patch")


def test_resident_packed_groups_load_through_the_staging_ring(tmp_path, checker):
    """Where there is a staging ring (groups kept in place by the host budget), the resident groups with a
    packed, never pinned, mirror load through it too (issue 32 item 5): at the pinned rate, the host thread
    not held by a copy from pageable memory; ordered and bit-identical, patch and all."""
    reference, offloaded, x = mapped_pair(tmp_path)
    total = host_bytes(offloaded)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1,
                                 host_budget=total * 5 // 6, resident_bytes=total // 2)
    resident_packed = [g for g in handle.groups if g.resident and g.mirror.packed]
    assert resident_packed and any(not g.mirror.packed for g in handle.groups), "a ring, and a group for it"
    transfers = handle._transfers
    assert all(transfers.staged(g) and not transfers.blocks_the_host(g) for g in resident_packed)
    handle.set_onload_patch(LowRankPatch(), PATCHED)
    patched(reference)
    with torch.inference_mode():
        expected = reference(x)
        jobs = checker.jobs
        handle.onload_resident()
        assert checker.jobs - jobs == sum(g.resident for g in handle.groups), "every resident group by the worker"
        for _ in range(STEPS):
            assert torch.equal(offloaded(x), expected)
    assert checker.allocations_on[transfers.copy_stream.name] == 0
    handle.remove()
    assert checker.cudart.registered == {}

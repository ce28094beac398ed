"""The resident groups' load through a pinned staging ring for an all-packed model whose pins were granted (issue 40
item 4, the open part of issue 32 item 5): where no group is kept in place and no pin was refused there is no ring
for the streamed groups, and the resident ones loaded from pageable memory, a copy that holds the host thread at a
tenth of the pinned rate. The plan makes a ring for their load (``HostPins.pin_streamed``) where they hold more
bytes than it and it fits; the next ``pin_streamed`` that finds them on the device (the nodes' run start) gives its
pins back; a ring the pinner refuses, or no room for it, leaves them to the pageable copy.

Under the stream checker (testbed/stream_checker.py): the gather worker's jobs and the ledger's staged copies
say which route a copy took; the checker fails the test on a copy unordered against the compute or the ring.
"""
from __future__ import annotations

import torch

from offload_core import apply_group_offload
from offload_core import hostlimits, pinning
from testbed.core_faults import LowRankPatch, PATCHED, patched
from testbed.core_models import make_pair

DEPTH = 12
STEPS = 3


def offloaded_half_resident(checker, **kwargs):
    """Every group packed and pinned, half of them resident."""
    reference, offloaded, x = make_pair("cpu", depth=DEPTH)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1, **kwargs)
    handle.set_resident_bytes(sum(g.nbytes for g in handle.groups) // 2)
    return reference, offloaded, x, handle


def ring_bytes(handle) -> int:
    return 2 * max(g.nbytes for g in handle.groups)


def streamed_pinned(handle, checker) -> None:
    """Exactly the streamed groups are pinned, and the ring's buffers where there is one; nothing else."""
    streamed = [g for g in handle.groups if not g.resident]
    assert all(g.mirror.packed and g.mirror.pinned for g in streamed)
    assert not any(g.mirror.pinned for g in handle.groups if g.resident)
    stats = handle.stats()
    assert sum(checker.cudart.registered.values()) == stats["pinned_bytes"] == \
        sum(g.nbytes for g in streamed) + stats["staging_bytes"]


def test_resident_groups_load_through_a_ring_then_give_its_pins_back(checker):
    """As the nodes load and then start a run: the plan makes the ring, the resident groups go through it by the
    gather worker (one staged copy each, patch and all), the run's start waits for those copies and unpins the
    ring; every call is bit-identical to the model without offloading."""
    reference, offloaded, x, handle = offloaded_half_resident(checker)
    residents = [g for g in handle.groups if g.resident]
    assert len(residents) * min(g.nbytes for g in residents) > ring_bytes(handle), "more to load than the ring holds"
    assert handle.stats()["staging_bytes"] == ring_bytes(handle), "a pinned ring for the load"
    streamed_pinned(handle, checker)
    transfers = handle._transfers
    assert all(transfers.staged(g) and not transfers.blocks_the_host(g) for g in residents)
    handle.set_onload_patch(LowRankPatch(), PATCHED)
    patched(reference)
    with torch.inference_mode():
        expected = reference(x)
        jobs, staged = checker.jobs, handle.ledger.staged_copies
        handle.onload_resident()  # the nodes' load
        assert checker.jobs - jobs == handle.ledger.staged_copies - staged == len(residents), \
            "every resident group by the worker, through the ring"
        unregistered = len(checker.cudart.unregistered)
        handle.pin_streamed()  # the run's start: the load's copies are queued, the ring goes
        assert len(checker.cudart.unregistered) - unregistered == 2, "the ring's two buffers given back"
        assert handle.stats()["staging_bytes"] == 0
        streamed_pinned(handle, checker)
        registered = len(checker.cudart.sizes("register"))
        for _ in range(STEPS):  # the run, and those after it
            handle.pin_streamed()
            assert torch.equal(offloaded(x), expected)
        assert len(checker.cudart.sizes("register")) == registered, "no pin per run"
    assert handle.ledger.staged_copies - staged == len(residents), "the streamed groups copied from their pins"
    handle.remove()
    assert checker.cudart.registered == {}


def test_resident_groups_loaded_at_their_first_use_go_through_the_ring(checker):
    """Without ``onload_resident`` (the core on its own): the forward loads them, through the ring."""
    reference, offloaded, x, handle = offloaded_half_resident(checker)
    residents = sum(g.resident for g in handle.groups)
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
        assert handle.ledger.staged_copies == residents
        handle.pin_streamed()
        assert torch.equal(offloaded(x), expected)
    assert handle.stats()["staging_bytes"] == 0
    streamed_pinned(handle, checker)
    handle.remove()
    assert checker.cudart.registered == {}


def test_a_refused_ring_leaves_the_resident_groups_to_the_pageable_copy(checker):
    """The driver pins the streamed groups but not the ring (a pinned-memory limit): no ring, the resident groups
    copied from pageable memory as before, bit-identical; the refusal's error discarded once."""
    reference, offloaded, x = make_pair("cpu", depth=DEPTH)
    probe = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker)
    group, streamed = probe.groups[0].nbytes, (DEPTH - DEPTH // 2) * probe.groups[0].nbytes
    probe.remove()
    checker.cudart.driver_limit = streamed + group  # room for the streamed groups and one buffer of the ring
    discards = checker.discards
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1,
                                 resident_bytes=DEPTH // 2 * group)
    assert checker.discards - discards == 1
    assert handle.stats()["staging_bytes"] == 0
    streamed_pinned(handle, checker)
    with torch.inference_mode():
        expected = reference(x)
        handle.onload_resident()
        assert checker.jobs == handle.ledger.staged_copies == 0, "from pageable memory, on the host thread"
        for _ in range(STEPS):
            handle.pin_streamed()
            assert torch.equal(offloaded(x), expected)
    handle.remove()
    assert checker.cudart.registered == {}


def test_no_ring_is_tried_where_the_streamed_groups_were_refused(checker):
    """A driver that pins nothing: the ring is not tried after the groups' refusals (each one a device sync)."""
    reference, offloaded, x = make_pair("cpu", depth=DEPTH)
    checker.cudart.driver_limit = 0
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1)
    discards = checker.discards
    handle.set_resident_bytes(sum(g.nbytes for g in handle.groups) // 2)
    assert checker.discards - discards == 1 and handle.stats()["staging_bytes"] == 0
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    handle.remove()


def test_another_model_taking_pins_takes_the_load_ring_first(checker):
    """Between the load and the run, another model's pins (``unpin(at_least)``, the nodes' ``_make_pin_room``)
    take the ring before any streamed group's pin: the ring only spared the load a pageable copy."""
    reference, offloaded, x, handle = offloaded_half_resident(checker)
    ring = handle.stats()["staging_bytes"]
    with torch.inference_mode():
        expected = reference(x)
        handle.onload_resident()
        assert handle.unpin(at_least=1) == ring
        assert handle.stats()["staging_bytes"] == 0
        streamed_pinned(handle, checker)
        assert torch.equal(offloaded(x), expected)
    handle.remove()
    assert checker.cudart.registered == {}


def test_no_ring_without_room_for_it(checker, monkeypatch):
    """A machine (or a container) with less than twice the ring's bytes of host memory left: none is made,
    nothing is pinned for it, and the resident groups load from pageable memory, bit-identical."""
    reference, offloaded, x = make_pair("cpu", depth=DEPTH)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1)
    monkeypatch.setattr(pinning, "host_room", lambda: 2 * ring_bytes(handle) - 1)
    registered = len(checker.cudart.sizes("register"))
    handle.set_resident_bytes(sum(g.nbytes for g in handle.groups) // 2)
    assert len(checker.cudart.sizes("register")) == registered and handle.stats()["staging_bytes"] == 0
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
    assert handle.ledger.staged_copies == 0
    handle.remove()


def test_a_load_no_larger_than_the_ring_makes_none(checker):
    """Two resident groups hold no more than the ring: registering it would cost what the copy it spares costs."""
    reference, offloaded, x = make_pair("cpu", depth=DEPTH)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1)
    handle.set_resident_bytes(2 * max(g.nbytes for g in handle.groups))
    assert sum(g.resident for g in handle.groups) == 2 and handle.stats()["staging_bytes"] == 0
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    assert handle.ledger.staged_copies == 0
    handle.remove()


def test_host_room_is_the_least_of_the_ram_available_and_the_cgroups_rooms(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemAvailable:    1048576 kB\n")
    cgroups = [limit.room for limit in hostlimits.cgroup_limits()]
    assert hostlimits.host_room(meminfo) == min([2**30, *cgroups])
    assert hostlimits.host_room(tmp_path / "none") == min(cgroups, default=None)

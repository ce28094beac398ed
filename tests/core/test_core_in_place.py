"""Groups beyond the host budget: kept in place (views of a mapped file), gathered at each onload.

On the host as the device, and under the stream checker standing in for CUDA (the staging ring and
its gather worker), with the engine's own code and torch's kernels running for real.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_core import SourceChangedError, apply_group_offload, hostmem
from offload_core.hostmem import uncached_bytes
from offload_core.residency import plan_packing
from offload_core.subclass import first_inner
from testbed.stream_checker import RaceError
from testbed.core_models import make_pair
from testbed.core_faults import check_doubling_patch
from testbed.core_models import ScaledInt8, host_bytes, map_blocks, mapped_pair, quantized_pair


def test_packing_plan_spreads_the_budget_over_the_streamed_groups_first():
    sizes, resident = [10] * 8, [False] * 6 + [True] * 2
    assert plan_packing(sizes, resident, None) == [True] * 8
    assert plan_packing(sizes, resident, 0) == [False] * 8
    assert plan_packing(sizes, resident, 30) == [True, False, True, False, True, False, False, False]
    assert plan_packing(sizes, resident, 70) == [True] * 6 + [True, False], "then the resident ones"
    assert plan_packing(sizes, resident, 9) == [False] * 8, "a group is packed whole or not at all"


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_groups_beyond_the_budget_are_gathered_from_the_mapped_file(tmp_path, share, prefetch):
    reference, offloaded, x = mapped_pair(tmp_path)
    total = host_bytes(offloaded)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=prefetch, host_budget=int(share * total))
    stats = handle.stats()
    in_place = [g for g in handle.groups if not g.mirror.packed]
    assert stats["packed_bytes"] <= share * total and stats["packed_bytes"] + stats["in_place_bytes"] == stats["host_bytes"]
    assert stats["file_backed_bytes"] == stats["in_place_bytes"] == sum(g.nbytes for g in in_place)
    assert (len(in_place) == len(handle.groups)) == (share == 0.0) and (not in_place) == (share == 1.0)
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
        handle.reset_stats()  # a pass in the steady state: its last group prefetches the next pass's first
        assert torch.equal(offloaded(x), expected)
    stats = handle.stats()
    assert stats["gathers"] == len(in_place) and stats["gathered_bytes"] == stats["in_place_bytes"]
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), expected), "removed: the blocks compute from the mapped file"


def test_tensors_kept_in_place_are_the_files_own_pages(tmp_path):
    _, offloaded, _ = mapped_pair(tmp_path)
    mapped = {t.data_ptr() for t in offloaded.blocks.state_dict().values()}
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    assert {t.data_ptr() for t in offloaded.blocks.state_dict().values()} == mapped, "nothing copied on the host"
    handle.remove()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("resident_share", [0.0, 0.5])
def test_the_staging_ring_and_its_worker_are_ordered(tmp_path, checker, prefetch, resident_share):
    """On a CUDA device the groups kept in place are gathered into the pinned staging ring by the worker
    thread, then copied to the device on the copy stream: every access ordered, the ring pinned, the
    mapped file never."""
    reference, offloaded, x = mapped_pair(tmp_path)
    total = host_bytes(offloaded)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=prefetch, runtime=checker,
                                 host_budget=total // 3, resident_bytes=int(resident_share * total))
    stats = handle.stats()
    largest = max(g.nbytes for g in handle.groups)
    assert stats["staging_bytes"] == 2 * largest and stats["in_place_bytes"] > 0
    assert not any(g.mirror.pinned for g in handle.groups if not g.mirror.packed)
    with torch.inference_mode():
        expected = reference(x)
        handle.reset_stats()
        for _ in range(3):
            assert torch.equal(offloaded(x), expected)
    stats = handle.stats()
    streamed_in_place = [g for g in handle.groups if not g.mirror.packed and not g.resident]
    assert checker.jobs >= 3 * len(streamed_in_place) and stats["gathers"] >= 3 * len(streamed_in_place)
    handle.remove()
    assert checker.cudart.registered == {}, "the ring goes with the handle"


def test_without_the_wait_for_the_sent_copy_the_worker_races_the_copy_stream(tmp_path, stream_checker, monkeypatch):
    from offload_core.staging import StagingRing

    _, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=stream_checker, host_budget=0)
    sent = StagingRing.sent
    monkeypatch.setattr(StagingRing, "sent", lambda self, index, stream: None)  # no event: no wait
    with torch.inference_mode(), pytest.raises(RaceError, match="host buffer.*on stream worker"):
        offloaded(x)
    monkeypatch.setattr(StagingRing, "sent", sent)
    handle.remove()


def test_the_host_waits_for_the_worker_before_the_compute_reads_its_copy(tmp_path, stream_checker):
    """The compute stream may run a group only after the worker queued its copy and the copy ran: dropping
    the wait for the worker's result leaves the compute reading a slab nobody ordered it after."""
    _, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=stream_checker, host_budget=0)
    def without_waiting(group, raising=True):  # the event the worker may not have recorded yet: waiting on it is a no-op
        group.pending, group.ready = None, stream_checker.new_event()

    handle._transfers.take_ready = without_waiting
    with torch.inference_mode(), pytest.raises(RaceError, match="on stream compute"):
        offloaded(x)
    del handle._transfers.take_ready
    handle.remove()


def test_a_file_that_shrinks_or_changes_is_refused_for_good_and_a_new_mapping_reads_it(tmp_path):
    """Whatever the file becomes after a write (even its old bytes again), the handle refuses it: only its size and
    times are asked, never its bytes. Mapping it again (loading the model again) reads it as it is."""
    reference, offloaded, x = mapped_pair(tmp_path)
    path = tmp_path / "blocks.bin"
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    original = path.read_bytes()
    handle.check_sources()
    os.truncate(path, len(original) // 2)
    with pytest.raises(SourceChangedError, match=r"blocks\.bin is now \d+ bytes on disk.*Free model and node cache"):
        handle.check_sources()
    path.write_bytes(original)  # restored: same bytes, new times
    with pytest.raises(SourceChangedError, match=r"blocks\.bin was written to since .*load the model again"):
        handle.check_sources()
    handle.remove()
    reference, offloaded, x = mapped_pair(tmp_path)  # the file mapped again
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    handle.check_sources()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    handle.remove()


def test_a_rewrite_that_puts_the_old_times_back_is_refused(tmp_path):
    """Another model's bytes, same size, the old modification time put back: the change time tells."""
    _, offloaded, _ = mapped_pair(tmp_path)
    path = tmp_path / "blocks.bin"
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    stat = path.stat()
    with path.open("r+b") as file:
        file.write(bytes(stat.st_size))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(SourceChangedError, match="was written to"):
        handle.check_sources()
    handle.remove()


def test_a_packed_handle_has_no_sources_to_check(tmp_path):
    _, offloaded, _ = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu")
    os.truncate(tmp_path / "blocks.bin", 0)
    handle.check_sources()  # every group packed: nothing reads the file any more
    assert handle.stats()["in_place_bytes"] == 0
    handle.remove()


def test_gathers_count_what_came_from_the_disk(tmp_path):
    _, offloaded, x = make_pair("cpu")
    mapping = map_blocks(offloaded, tmp_path / "blocks.bin")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    with open(tmp_path / "blocks.bin", "rb") as file:  # (the handle read a sample of its pages)
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if not uncached_bytes(mapping):
        pytest.skip("the kernel kept the file's pages cached (fadvise DONTNEED dropped nothing)")
    with torch.inference_mode():
        offloaded(x)
        first = handle.stats()["gathered_from_disk_bytes"]
        handle.reset_stats()
        offloaded(x)
    assert first > 0 and handle.stats()["gathered_from_disk_bytes"] == 0, "the second pass reads the page cache"
    handle.remove()


def test_bad_host_budgets_are_refused(tmp_path):
    _, offloaded, _ = make_pair("cpu")
    with pytest.raises(ValueError, match="host_budget must be"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=-1)
    with pytest.raises(ValueError, match="fill writes every tensor"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0, fill=lambda name, view: None)


def test_reading_ahead_brings_a_groups_pages_into_the_page_cache(tmp_path):
    """What the engine asks for the groups after the one being gathered: the kernel reads them in the
    background (polled, since the read is asynchronous)."""
    import time

    _, offloaded, _ = make_pair("cpu")
    mapping = map_blocks(offloaded, tmp_path / "blocks.bin")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    with open(tmp_path / "blocks.bin", "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mirror = handle.groups[0].mirror
    if not all(uncached_bytes(view) for view in mirror.views):
        pytest.skip("the kernel kept the file's pages cached (fadvise DONTNEED dropped nothing)")
    mirror.read_ahead()
    deadline = time.monotonic() + 10
    while any(uncached_bytes(view) for view in mirror.views) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(uncached_bytes(view) for view in mirror.views)
    assert uncached_bytes(handle.groups[-1].mirror.views[2]), "the other groups' pages were left alone"
    handle.remove()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_onload_patches_of_groups_kept_in_place_are_ordered_and_leave_the_file_pristine(tmp_path, checker, prefetch):
    """A LoRA on a group kept in place is computed on the device by the worker's job, after the copy out of
    the staging buffer; the mapped file is never written."""
    reference, offloaded, x = mapped_pair(tmp_path)
    original = (tmp_path / "blocks.bin").read_bytes()
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=2, prefetch=prefetch,
                                 runtime=checker, host_budget=0)
    check_doubling_patch(handle, reference, offloaded, x)
    handle.remove()
    assert (tmp_path / "blocks.bin").read_bytes() == original


def test_groups_kept_in_place_still_stream_once_the_rings_pins_are_given_up(tmp_path, checker):
    """Another model taking the pins (``unpin``) leaves the ring in pageable memory, not the groups without one."""
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, host_budget=0)
    staging = handle.stats()["staging_bytes"]
    assert handle.unpin() == staging > 0
    assert handle.stats()["pinned_bytes"] == 0 and checker.cudart.registered == {}
    with torch.inference_mode():
        handle.reset_stats()
        assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["staged_copies"] >= len(handle.groups) and handle.stats()["pinned_bytes"] == 0
    handle.remove()


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_handle_nobody_reaches_goes_with_its_pins_without_remove(tmp_path, checker, share):
    """The pinned mirrors' and the ring's finalizers wait for the copies through the handle without holding
    it: dropping the model lets the handle, its pins and its ring go."""
    import gc
    import weakref

    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker,
                                 host_budget=int(share * host_bytes(offloaded)))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    assert checker.cudart.registered
    gone = weakref.ref(handle)
    del handle, offloaded
    gc.collect()
    assert gone() is None and checker.cudart.registered == {}


def read_bytes() -> int:
    """What this process has had read from storage so far, the kernel's read-ahead included (/proc/self/io)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])


class Chain(nn.Module):
    """Blocks of a few MiB each: a group's pages are its own, but for the page at each end."""

    def __init__(self, depth: int = 6, width: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("around", [True, False], ids=["read around the cache", "read through the cache"])
@pytest.mark.parametrize("route", ["host", "worker"])
def test_past_the_page_cache_room_the_first_bytes_stay_cached_and_the_others_are_released(tmp_path, request, route,
                                                                                          around, monkeypatch):
    """With room for the first three and a half groups (beside those in flight, where pages pass through the
    cache), they stay in the page cache (the fourth group's leading half) and the others never enter it (read
    around it, where the file system reads so) or leave it after each gather (by the host thread on the CPU, by
    the gather worker through the staging ring): the next step reads only those from the disk. Bit-identical."""
    if not around:
        monkeypatch.setattr(hostmem, "open_direct", lambda descriptor: None)
    torch.manual_seed(0)
    reference = Chain()
    offloaded = Chain()
    offloaded.load_state_dict(reference.state_dict())
    map_blocks(offloaded, tmp_path / "blocks.bin")
    with open(tmp_path / "blocks.bin", "rb") as file:  # read from the disk, as a model file is: its pages were
        os.fsync(file.fileno())  # written in folios that straddle the groups, which the kernel drops only whole
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    runtime = request.getfixturevalue("checker") if route == "worker" else None
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1, host_budget=0, runtime=runtime)
    if around and not handle.groups[0].mirror.reads_around_cache:
        pytest.skip(f"the file system of {tmp_path} has no direct reads (O_DIRECT)")
    size = handle.groups[0].nbytes
    assert handle.keep_cached(None) == handle.stats()["kept_cached_bytes"] == 6 * size, "no room given: all kept"
    assert handle.keep_cached(6 * size) == 6 * size, "they all fit: nothing released"
    # through the cache: room for the group gathered, and the one the worker reads ahead
    in_flight = 0 if around else 2 if route == "worker" else 1
    assert handle.keep_cached(int((3.5 + in_flight) * size)) == handle.stats()["kept_cached_bytes"] == int(3.5 * size)
    x = torch.randn(4, 1024)
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
        read_before = read_bytes()
        assert torch.equal(offloaded(x), expected)
        read = read_bytes() - read_before
    page = os.sysconf("SC_PAGE_SIZE")
    uncached = [sum(uncached_bytes(view) for view in g.mirror.views) for g in handle.groups]
    assert all(missing <= 2 * page for missing in uncached[:3]), f"the kept groups stay cached: {uncached}"
    weight = handle.groups[3].mirror.views[0]  # (the group's weight, then its bias)
    half = size // 2
    assert uncached_bytes(weight[: half // weight[0].nbytes]) <= 2 * page, f"its leading half stays cached: {uncached}"
    # (gathering a group through the cache, the kernel reads around the pages it faults: a part of the group
    # before it comes back)
    # (folios the kernel reads around a fault of the kept part may straddle the first released pages)
    released = 5 * size // 2 - size // 16 if around else 5 * size // 4
    assert sum(uncached[3:]) >= released, f"the others' pages are released: {uncached}"
    assert 0.9 * 2.5 * size <= read <= 1.1 * 2.5 * size, f"a step reads the released pages again, and only those: {read}"
    handle.remove()


def _mapped_quantized_pair(tmp_path: Path):
    reference, offloaded, x = quantized_pair(ScaledInt8.quantize)
    map_blocks(offloaded, tmp_path / "blocks.bin")
    return reference, offloaded, x


@pytest.mark.parametrize("make", [mapped_pair, _mapped_quantized_pair], ids=["plain", "quantized"])
@pytest.mark.parametrize("resident_share", [0.0, 0.5])
def test_packed_groups_give_their_host_memory_back_to_the_file(tmp_path, checker, make, resident_share):
    """A handle packed from a mapped file gives packed groups up on request: their tensors are the file's views
    again, gathered at each onload through the staging ring, and the model computes as before."""
    reference, offloaded, x = make(tmp_path)
    mapped = {first_inner(t).data_ptr() for t in offloaded.blocks.state_dict().values()}
    total = host_bytes(offloaded)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, returnable=True,
                                 resident_bytes=int(resident_share * total))
    assert handle.returnable_bytes() == handle.stats()["packed_bytes"] == total
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
        freed = handle.give_up_packing(total // 2)
        stats = handle.stats()
        assert total // 2 <= freed < total and stats["packed_bytes"] == total - freed == handle.returnable_bytes()
        assert stats["in_place_bytes"] == stats["file_backed_bytes"] == freed and stats["staging_bytes"] > 0
        given_up = [g for g in handle.groups if not g.mirror.packed]
        assert not any(g.mirror.pinned for g in given_up)
        if resident_share:
            assert any(g.resident for g in given_up), "the resident groups' host copies go first"
        in_the_file = {first_inner(b.current()).data_ptr() for g in given_up for b in g.bindings}
        assert in_the_file <= mapped, "the given-up groups' tensors are the file's own pages"
        handle.reset_stats()
        assert torch.equal(offloaded(x), expected)
        assert torch.equal(offloaded(x), expected)
    assert handle.stats()["gathered_bytes"] >= sum(g.nbytes for g in given_up if not g.resident)
    assert handle.give_up_packing(total) == total - freed and handle.returnable_bytes() == 0
    with torch.inference_mode():
        assert torch.equal(offloaded(x), expected)
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), expected), "removed: the blocks compute from the mapped file"


def test_packing_is_kept_where_there_is_no_file_or_the_file_changed(tmp_path):
    reference, offloaded, x = make_pair("cpu")  # the tensors in memory of their own: nothing to give back to
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", returnable=True)
    assert handle.returnable_bytes() == 0 and handle.give_up_packing(1) == 0
    handle.remove()
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", returnable=True)
    handle.check_sources()  # packed: the file is not read, and is not leased
    path = tmp_path / "blocks.bin"
    path.write_bytes(bytes(path.stat().st_size))  # another model's bytes under the views
    assert handle.returnable_bytes() == 0 and handle.give_up_packing(1) == 0
    assert handle.stats()["in_place_bytes"] == 0
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x)), "the packed copies still hold the weights loaded"
    handle.remove()


def test_a_handle_not_built_returnable_lets_the_file_go_once_packed(tmp_path):
    _, offloaded, _ = mapped_pair(tmp_path)
    path = str(tmp_path / "blocks.bin")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu")
    gc.collect()
    assert handle.returnable_bytes() == 0 and handle.give_up_packing(1) == 0
    assert path not in hostmem.PROC_MAPS.read_text(), "no alias keeps the mapping"
    handle.remove()

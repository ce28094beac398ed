"""The stream checker catches racy schedules built on purpose, and passes their ordered twins."""
from __future__ import annotations

import pytest
import torch

from testbed.stream_checker import RaceError, StaleCudaError, StreamChecker


@pytest.fixture
def checker():
    with StreamChecker() as active:
        yield active


def filled(checker: StreamChecker, nbytes: int = 64) -> torch.Tensor:
    buffer = checker.empty(nbytes)
    buffer.fill_(1)
    return buffer


@pytest.mark.parametrize("ordered", [False, True])
def test_filling_reused_memory_from_the_side_stream(checker, ordered):
    side = checker.new_stream()
    buffer = filled(checker)
    buffer.sum()  # a kernel on the compute stream reads it last
    address = buffer.data_ptr()
    del buffer
    fresh = checker.empty(64)
    assert fresh.data_ptr() == address, "the compute stream's pool hands the same memory back"
    if ordered:
        side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        if ordered:
            fresh.copy_(torch.ones(64, dtype=torch.uint8))
        else:
            with pytest.raises(RaceError, match=r"copy_.*writes device block.* on stream side1, not ordered after aten\.fill_.* on stream compute"):
                fresh.copy_(torch.ones(64, dtype=torch.uint8))


@pytest.mark.parametrize("ordered", [False, True])
def test_reading_what_the_side_stream_wrote(checker, ordered):
    side = checker.new_stream()
    buffer = filled(checker)
    side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        buffer.copy_(torch.full((64,), 3, dtype=torch.uint8))
        ready = checker.new_event()
        ready.record(side)
    if ordered:
        checker.current_stream().wait_event(ready)
        assert buffer.sum().item() == 3 * 64
    else:
        with pytest.raises(RaceError, match=r"sum.*reads.*not ordered after aten\.copy_"):
            buffer.sum()


@pytest.mark.parametrize("ordered", [False, True])
def test_overwriting_a_slab_the_compute_stream_reads(checker, ordered):
    side = checker.new_stream()
    slab = filled(checker)
    side.wait_stream(checker.current_stream())
    slab.float().mean()  # the group that used the slab runs
    released = checker.new_event()
    released.record()
    if ordered:
        side.wait_event(released)
    with checker.use_stream(side):
        if ordered:
            slab.zero_()
        else:
            with pytest.raises(RaceError, match=r"zero_.*not ordered after aten\._to_copy"):
                slab.zero_()


def test_an_event_recorded_too_early_orders_nothing(checker):
    side = checker.new_stream()
    buffer = filled(checker)
    side.wait_stream(checker.current_stream())
    early = checker.new_event()
    early.record(side)
    with checker.use_stream(side):
        buffer.add_(1)
    checker.current_stream().wait_event(early)
    with pytest.raises(RaceError):
        buffer.sum()


def test_ordering_is_transitive_through_a_third_stream(checker):
    first, second = checker.new_stream(), checker.new_stream()
    buffer = filled(checker)
    first.wait_stream(checker.current_stream())
    with checker.use_stream(first):
        buffer.add_(1)
    second.wait_stream(first)
    done = checker.new_event()
    done.record(second)
    checker.current_stream().wait_event(done)
    assert buffer.sum().item() == 2 * 64


def test_a_write_races_with_an_unordered_read_on_another_stream(checker):
    side = checker.new_stream()
    buffer = filled(checker)
    side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        buffer.sum()  # the side stream reads it
    with pytest.raises(RaceError, match=r"fill_.*not ordered after aten\.sum"):
        buffer.fill_(0)  # the compute stream overwrites it without waiting


def test_memory_returns_to_the_pool_of_the_stream_that_allocated_it(checker):
    side = checker.new_stream()
    buffer = checker.empty(64)
    address = buffer.data_ptr()
    del buffer
    with checker.use_stream(side):
        other = checker.empty(64)
    assert other.data_ptr() != address
    assert checker.empty(32).data_ptr() == address, "a smaller request reuses the freed block"
    assert checker.reuses == 1


def test_views_keep_memory_allocated(checker):
    buffer = checker.empty(64)
    address, view = buffer.data_ptr(), buffer[8:16]
    del buffer
    assert checker.empty(64).data_ptr() != address
    del view
    assert checker.empty(64).data_ptr() == address


@pytest.mark.parametrize("drained", [False, True])
def test_unregistering_host_memory_a_copy_may_still_read(checker, drained):
    side = checker.new_stream()
    host = torch.ones(64, dtype=torch.uint8)
    assert checker.cudart.cudaHostRegister(host.data_ptr(), 64, 0) == 0
    slab = checker.empty(64)
    side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        slab.copy_(host, non_blocking=True)
    if drained:
        side.synchronize()
        checker.cudart.cudaHostUnregister(host.data_ptr())
        assert checker.cudart.unregistered == [host.data_ptr()]
    else:
        with pytest.raises(RaceError, match=r"cudaHostUnregister writes host buffer.*after aten\.copy_"):
            checker.cudart.cudaHostUnregister(host.data_ptr())


def test_a_refused_registration_surfaces_at_the_next_kernel_unless_discarded(checker):
    host = torch.ones(64, dtype=torch.uint8)
    checker.cudart.refuse = True
    assert checker.cudart.cudaHostRegister(host.data_ptr(), 64, 0) != 0
    with pytest.raises(StaleCudaError, match="cudaErrorHostMemoryAlreadyRegistered"):
        host.sum()
    assert checker.cudart.cudaHostRegister(host.data_ptr(), 64, 0) != 0
    checker.discard_last_error()
    assert host.sum().item() == 64


def test_untracked_memory_is_not_checked(checker):
    side = checker.new_stream()
    activation = torch.ones(64)
    with checker.use_stream(side):
        activation.add_(1)
    assert activation.sum().item() == 128  # host tensors the checker does not track
    assert checker.races == []


@pytest.mark.parametrize("drained", [False, True])
def test_emptying_the_cache_while_a_copy_may_still_write_freed_memory(checker, drained):
    side = checker.new_stream()
    buffer = checker.empty(64)
    side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        buffer.copy_(torch.ones(64, dtype=torch.uint8), non_blocking=True)
    if drained:
        checker.current_stream().wait_stream(side)
    del buffer
    if drained:
        checker.empty_cache()
        assert checker.released == 1
    else:
        with pytest.raises(RaceError, match=r"a kernel handed device block 0 once freed writes .* on stream compute, "
                                            r"not ordered after aten\.copy_"):
            checker.empty_cache()


def test_chosen_allocations_run_out_of_memory(checker):
    checker.out_of_memory_at = {1}
    checker.empty(8)
    with pytest.raises(torch.OutOfMemoryError, match="allocation attempt 1"):
        checker.empty(8)
    checker.empty(8)
    assert (checker.allocations, checker.allocation_attempts) == (2, 3)

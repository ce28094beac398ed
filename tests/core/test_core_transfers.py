"""The transfers' failure paths and figures (issue 32): a failed gather job, a finalizer on the gather worker,
what the ledger counts, and what a run pins.

Under the stream checker (testbed/stream_checker.py), and, where only a real second thread shows the fault,
under a plain threaded runtime (``ThreadedRuntime``) whose streams and events do nothing.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext

import pytest
import torch

from offload_core import apply_group_offload, call_backing_off, handle_of
from testbed import stream_checker
from testbed.core_faults import out_of_memory_inside
from testbed.core_models import make_pair
from testbed.core_models import host_bytes, mapped_pair
from testbed.core_faults import limit_pins_to_three_groups
from testbed.core_faults import fails_then_recovers

PATCHED = "blocks.2.attn.weight"


def doubled(reference) -> None:
    reference.blocks[2].attn.weight.data.mul_(2)


def on_each_gather(group, action) -> None:
    """Run ``action`` at each gather of ``group`` (on the gather worker), before its bytes are read."""
    gather_into = group.gather_into

    def gather_after_action(*args, **kwargs):
        action()
        return gather_into(*args, **kwargs)

    group.gather_into = gather_after_action


class FailingOnce:
    """A gather's read error, the first time only."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("read error in the gather (test)")


# --- a failed gather job -----------------------------------------------------------------------

@pytest.mark.parametrize("resident", [True, False])
def test_a_failed_gather_job_drops_its_group_from_the_device(tmp_path, checker, resident):
    """Groups kept in place reach the device through the gather worker. When its job fails (here its
    gather), the group is dropped: the next call copies and patches it again, ordered."""
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, host_budget=0,
                                 resident_bytes=host_bytes(offloaded) if resident else 0)
    handle.set_onload_patch(lambda name, weight: weight * 2, [PATCHED])
    on_each_gather(handle.groups[2], FailingOnce())
    doubled(reference)
    fails_then_recovers(handle, reference, offloaded, x, OSError, "in the gather")


# --- what the ledger counts ---------------------------------------------------------------------

def test_a_staged_copy_counts_once_queued_not_when_submitted(tmp_path, checker):
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, host_budget=0, prefetch=0)

    def unreadable(target, copy):
        raise OSError("the file could not be read (test)")

    handle.groups[2].mirror.gather_into = unreadable
    with torch.inference_mode(), pytest.raises(OSError, match="could not be read"):
        offloaded(x)  # groups 0 and 1 copied; group 2's job failed before its copy
    stats = handle.stats()
    assert (stats["copies_h2d"], stats["staged_copies"]) == (2, 2)
    assert stats["bytes_h2d"] == handle.groups[0].nbytes + handle.groups[1].nbytes
    handle.remove()


def test_the_gather_time_leaves_out_the_wait_for_a_free_ring_buffer(tmp_path, checker, monkeypatch):
    """``gather_seconds`` is the time the gathers took: a wait for the copy out of a ring buffer (here made
    to last 1000 s on the clock) is no part of it."""
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, host_budget=0)
    clock, waits = time.perf_counter, []
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 1000.0 * len(waits))
    synchronize = stream_checker.Event.synchronize
    monkeypatch.setattr(stream_checker.Event, "synchronize", lambda event: (waits.append(event), synchronize(event)))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    stats = handle.stats()
    assert waits and stats["gathers"] >= len(handle.groups)
    assert stats["gather_seconds"] < 1000.0
    handle.remove()


# --- what a run pins ----------------------------------------------------------------------------

def registrations(checker) -> int:
    return len(checker.cudart.sizes("register")) + len(checker.cudart.sizes("unregister"))


@pytest.mark.parametrize("setting", ["kept in place", "past a pinned-memory limit"])
def test_the_staging_ring_stays_from_one_run_to_the_next(tmp_path, checker, setting):
    """Each sampling run pins what its model streams again (``pin_streamed``, from the nodes' ``pre_run``):
    pins another model took come back. The ring, and the groups pinned for it, are not pinned afresh."""
    if setting == "kept in place":
        reference, offloaded, x = mapped_pair(tmp_path)
        handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, host_budget=0)
    else:
        reference, offloaded, x = make_pair("cpu")
        limit_pins_to_three_groups(checker)
        handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker)
    ring = handle.stats()["staging_bytes"]
    assert ring > 0
    with torch.inference_mode():
        for _ in range(3):  # three runs
            before = registrations(checker)
            handle.pin_streamed()
            assert torch.equal(offloaded(x), reference(x))
            assert registrations(checker) == before and handle.stats()["staging_bytes"] == ring
    handle.unpin()  # another model takes the pins: the next run takes them back
    handle.pin_streamed()
    assert handle.stats()["staging_bytes"] == ring
    handle.remove()
    assert checker.cudart.registered == {}


def test_a_back_off_pins_no_group_that_was_resident(checker):
    """Resident groups stay in pageable memory (they are read again only once dropped); a back-off that
    streams some of them does not pin them in the middle of the recovery: they go through the ring, the one the
    resident groups loaded through (made by the plan), which the back-off keeps."""
    reference, offloaded, x = make_pair("cpu", depth=12)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1)
    handle.set_resident_bytes(sum(g.nbytes for g in handle.groups))
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
        registered = len(checker.cudart.sizes("register"))
        with out_of_memory_inside(offloaded.blocks[11], failures=1):
            assert torch.equal(call_backing_off(handle, lambda: offloaded(x)), expected)
        assert torch.equal(offloaded(x), expected)
    ring = handle.stats()["staging_bytes"]
    assert handle.backed_off and ring == 2 * max(g.nbytes for g in handle.groups)
    assert len(checker.cudart.sizes("register")) - registered == 0, "no group, nor a ring: the load's serves"
    assert not any(g.mirror.pinned for g in handle.groups)
    assert handle.stats()["staged_copies"] > 0
    handle.set_resident_bytes(0)  # the next run's plan: every group streams, pinned; no ring
    assert handle.stats()["pinned_bytes"] == handle.stats()["host_bytes"] and handle.stats()["staging_bytes"] == 0
    handle.remove()


# --- a finalizer on the gather worker ----------------------------------------------------------

class _Nothing:
    """A stream or event of a runtime that orders nothing (its copies run at once on the host)."""

    def __init__(self, *_, **__) -> None: ...

    def __getattr__(self, _name: str):
        return lambda *args, **kwargs: 0.0


class _Owner:
    """Stands for the nodes' patcher, whose finalizer removes the handle."""


class ThreadedRuntime:
    """A runtime whose gather worker is a real thread (as ``CudaRuntime``'s) and whose streams and events
    do nothing. Its jobs start once the host first waits for one, so that the host has stored each
    future before its job runs. A wait by the worker for a job it has not finished would hang forever on
    CUDA: it is recorded in ``self_waits`` and raised here instead."""

    def __init__(self) -> None:
        self.self_waits = 0
        self.futures: list[Future] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-gather")
        self._worker_thread: int | None = None
        self._started = threading.Event()

    new_stream = current_stream = new_event = _Nothing

    def use_stream(self, stream):
        return nullcontext()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def capturing(self) -> bool:
        return False

    def submit(self, job) -> Future:
        def run():
            self._started.wait()
            self._worker_thread = threading.get_ident()
            return job()

        self.futures.append(self._worker.submit(run))
        return self.futures[-1]

    def wait(self, future: Future):
        if threading.get_ident() == self._worker_thread and not future.done():
            self.self_waits += 1
            raise RuntimeError("the gather worker waits for a job of its own: on CUDA it would wait forever")
        self._started.set()
        return future.result()

    def settle(self) -> None:
        """Until every job, and every job those submitted, has run."""
        self._started.set()
        while not all(f.done() for f in self.futures):
            wait(list(self.futures))

    def empty_cache(self) -> None: ...

    def discard_last_error(self) -> None: ...


def test_a_handle_removed_by_a_finalizer_on_the_gather_worker_does_not_wait_for_itself(tmp_path):
    """The nodes remove a handle from a finalizer (its last patcher collected); a collection can run it on
    the gather worker, inside a job, while the handle's own jobs are queued. Waiting for those there would
    wait for itself: the removal is done once they have run."""
    reference, offloaded, x = mapped_pair(tmp_path)
    runtime = ThreadedRuntime()
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=runtime, host_budget=0, prefetch=1,
                                 pin_memory=False)
    owner = [_Owner()]
    weakref.finalize(owner[0], handle.remove)  # as the nodes' finalizer of the last patcher
    forward_done, onloads = threading.Event(), []

    def collect_on_the_worker():
        onloads.append(threading.current_thread())
        if len(onloads) == 3:  # the copy queued at the end of the second pass, for the next one
            forward_done.wait(timeout=60)
            owner.clear()  # the owner goes: its finalizer runs here, on the worker, inside this job

    on_each_gather(handle.groups[0], collect_on_the_worker)
    with torch.inference_mode():
        for _ in range(2):  # the second pass ends by prefetching the first group: a job queued for the next
            assert torch.equal(offloaded(x), reference(x))
    forward_done.set()
    runtime.settle()
    assert not owner and onloads[-1] is not threading.main_thread(), "the finalizer ran (on the worker)"
    assert runtime.self_waits == 0
    assert handle_of(offloaded.blocks[0]) is None and "forward" not in offloaded.blocks[0].__dict__, "removed"
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))

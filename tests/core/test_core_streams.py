"""The engine's stream path under the happens-before checker (testbed/stream_checker.py).

The checker stands in for the CUDA runtime only: the engine's code, torch's kernels and the
default ``CudaHostRegister`` pinner run for real on the CPU, and every cross-stream access to a
slab, a resident buffer or a pinned mirror must be ordered by the engine's waits and events.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from offload_core import CaptureError, CudaHostRegister, apply_group_offload
from offload_core.mirror import HOST_REGISTER_PORTABLE
from offload_core.runtime import CudaRuntime
from testbed.stream_checker import COMPUTE, HOST, WORKER, Event, StreamChecker
from testbed.core_models import make_pair
from testbed.core_faults import check_doubling_patch, limit_pins_to_three_groups


def offload(model: nn.Module, checker: StreamChecker, **kwargs):
    return apply_group_offload(model, model.blocks, "cpu", runtime=checker, **kwargs)


@pytest.mark.parametrize("blocks_per_group", [1, 2, 4])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("resident_share", [0.0, 0.5, 1.0])
def test_every_setting_is_ordered(checker, blocks_per_group, prefetch, resident_share):
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, blocks_per_group=blocks_per_group, prefetch=prefetch)
    handle.set_resident_bytes(int(resident_share * sum(g.nbytes for g in handle.groups)))
    stats = handle.stats()
    assert stats["pinned_bytes"] - stats["staging_bytes"] == stats["streamed_bytes_per_pass"], \
        "every streamed group pinned, no resident one (they load through the ring, where they hold more than it)"
    with torch.inference_mode():
        expected = reference(x)
        handle.onload_resident()
        for _ in range(3):
            assert torch.equal(offloaded(x), expected)
        handle.release_device_memory()  # mid-run, prefetched copies in flight: the next pass reuses the memory
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
    assert checker.reuses > 0, "freed device memory was handed out again"
    assert checker.cudart.register_flags == {HOST_REGISTER_PORTABLE}, "pinned for every context, as torch and ComfyUI pin"
    handle.remove()
    assert checker.cudart.registered == {}, "every mirror unpinned"


def test_out_of_order_execution_is_ordered(checker):
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=2)
    with torch.no_grad():
        for order in (None, None, [5, 4, 3, 2, 1, 0], [0, 2, 4], [1, 1, 3], None):
            reference.order = offloaded.order = order
            assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["sync_onloads"] > 0


def test_remove_mid_run_unpins_after_the_copies(checker):
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=2)
    with torch.inference_mode():
        offloaded(x), offloaded(x)  # leaves prefetched copies from the mirrors in flight
        assert any(g.onloaded for g in handle.groups)
        handle.remove()
        assert checker.cudart.registered == {} and len(checker.cudart.unregistered) == len(handle.groups)
        assert torch.equal(offloaded(x), reference(x))


def test_onload_patches_are_ordered(checker):
    reference, offloaded, x = make_pair("cpu")
    check_doubling_patch(offload(offloaded, checker, blocks_per_group=2, prefetch=1), reference, offloaded, x)


def test_grad_modes_on_the_stream_path(checker):
    reference, offloaded, x = make_pair("cpu")
    with torch.inference_mode():
        handle = offload(offloaded, checker, prefetch=1)
        assert torch.equal(offloaded(x), reference(x))
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    handle.remove()
    offloaded(x).square().sum().backward()
    reference(x).square().sum().backward()
    for mine, theirs in zip(offloaded.blocks.parameters(), reference.blocks.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_refused_pin_leaves_no_cuda_error_behind(checker, caplog):
    reference, offloaded, x = make_pair("cpu")
    checker.cudart.refuse = True
    caplog.set_level(logging.INFO, logger="offload_core")
    handle = offload(offloaded, checker)
    assert handle.stats()["pinned_bytes"] == 0
    assert "pinning was refused" in caplog.text
    assert checker.discards == 1, "one device sync for the whole pass, not one per refused group"
    assert handle.stats()["pin_seconds"] > 0
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x)), "no stale error surfaced at a kernel launch"


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pageable_group_is_copied_behind_the_launch_of_the_running_one(checker, pinned):
    """A copy from pageable memory blocks the host until it is done: issued at a group's enter, before its
    kernels, it would leave the GPU idle through the copy. So it is issued at the leave, after them."""
    reference, offloaded, x = make_pair("cpu")
    checker.cudart.refuse = not pinned
    handle = offload(offloaded, checker, prefetch=1)  # two slabs, taken in turn
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(2):  # the second pass runs on the learnt order: every copy is a prefetch
            checker.launches.clear()
            assert torch.equal(offloaded(x), expected)
    assert handle.stats()["pinned_bytes"] == (handle.stats()["streamed_bytes_per_pass"] if pinned else 0)
    copies = [i for i, (stream, _, written) in enumerate(checker.launches) if stream != COMPUTE and written]
    # Behind the launch, the kernel before a copy reads the running group's slab; ahead of it, it is the
    # last kernel of the group before, which read the slab the copy now refills.
    behind = {checker.launches[i - 1][0] == COMPUTE and not checker.launches[i - 1][1] & checker.launches[i][2]
              for i in copies if i > 0}
    assert len(copies) == len(handle.groups) and behind == {not pinned}


def test_wait_timers_stay_bounded_when_nobody_reads_stats(checker, monkeypatch):
    from offload_core.ledger import FOLD_WAITS_AT

    monkeypatch.setattr(Event, "query", lambda event: True)  # the GPU has passed every event (nothing ordered)
    _, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=1)
    with torch.no_grad():
        for _ in range(15):  # 90 waits, past FOLD_WAITS_AT
            offloaded(x)
    assert handle.ledger.hook_calls == 15 * len(handle.groups)
    assert len(handle.ledger._waits._pending) <= FOLD_WAITS_AT
    assert handle.stats()["compute_wait_ms"] == 0.0


@pytest.mark.cuda
def test_a_refused_registration_leaves_no_error_on_a_real_gpu():
    buffer = torch.ones(1 << 20, dtype=torch.uint8)
    pinner = CudaHostRegister()
    assert pinner.pin(buffer)
    try:
        assert not pinner.pin(buffer), "registering twice is refused"
        CudaRuntime(torch.device("cuda")).discard_last_error()
        assert torch.ones(4, device="cuda").add_(1).sum().item() == 8, "no stale error at this launch"
    finally:
        pinner.unpin(buffer)


class TwoPhaseNet(nn.Module):
    """Runs its blocks as Wan Animate 2 does, never through their forward: per block a side phase
    (``side``, or ``side_cached`` from a cache), then ``main``; optionally every block's side phase
    first, in a pass of its own."""

    def __init__(self, depth: int = 6, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TwoPhaseBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        side = x.flip(1)
        if mode == "side_pass_first":
            for block in self.blocks:
                side = block.side(side)
            side = x.flip(1)
        for block in self.blocks:
            if mode == "cached":
                side = block.side_cached(side)
            elif mode != "main_only":
                side = block.side(side)
            x = block.main(x, side)
        return x


class TwoPhaseBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.side_proj = nn.Linear(width, width)
        self.main_proj = nn.Linear(width, width)

    def side(self, side: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.side_proj(side))

    def side_cached(self, side: torch.Tensor) -> torch.Tensor:
        return self.side_proj(side) * 0.5

    def main(self, x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.main_proj(x) + side)


@pytest.mark.parametrize("mode", ["side_then_main", "cached", "main_only", "side_pass_first"])
@pytest.mark.parametrize("blocks_per_group,prefetch", [(1, 0), (1, 1), (2, 2), (3, 1)])
def test_blocks_run_through_other_methods_stream_once_per_visit(checker, mode, blocks_per_group, prefetch):
    """Opened by either side method, closed after ``main`` of the group's last block: each group is
    copied once per loop over the blocks, ordered, whichever phases a pass runs."""
    torch.manual_seed(0)
    reference = TwoPhaseNet()
    offloaded = TwoPhaseNet()
    offloaded.load_state_dict(reference.state_dict())
    handle = offload(offloaded, checker, blocks_per_group=blocks_per_group, prefetch=prefetch,
                     entry_methods=("side", "side_cached", "main"))
    x = torch.randn(2, 4, 16)
    with torch.inference_mode():
        expected = reference(x, mode)
        assert torch.equal(offloaded(x, mode), expected)
        handle.reset_stats()
        for _ in range(2):
            assert torch.equal(offloaded(x, mode), expected)
    stats = handle.stats()
    loops = 2 if mode == "side_pass_first" else 1
    assert stats["bytes_h2d"] == 2 * loops * stats["streamed_bytes_per_pass"], "one copy per group and loop"
    assert stats["sync_onloads"] == (2 * loops * len(handle.groups) if prefetch == 0 else 0)
    assert stats["hook_calls"] == 2 * loops * len(handle.groups), "one group run per loop, not one per method"
    handle.remove()
    assert not any(name in vars(block) for block in offloaded.blocks for name in ("side", "side_cached", "main"))
    with torch.inference_mode():
        assert torch.equal(offloaded(x, mode), expected)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_groups_pinning_refused_stream_through_the_pinned_staging_ring(checker, prefetch):
    """Past a pinned-memory limit, the groups left in pageable memory are copied into a ring of pinned
    buffers by the host and from there to the device on the copy stream, in the room of two pinned groups."""
    reference, offloaded, x = make_pair("cpu")
    group = limit_pins_to_three_groups(checker)
    handle = offload(offloaded, checker, prefetch=prefetch)
    stats = handle.stats()
    pinned_groups = [g.mirror.pinned for g in handle.groups]
    assert stats["staging_bytes"] == 2 * group and pinned_groups == [True, False, False, False, False, False]
    assert checker.cudart.registered_bytes == stats["pinned_bytes"] <= checker.cudart.driver_limit, "the ring counts as pinned"
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(offloaded(x), expected)
    stats = handle.stats()
    copies = [{n for n in touched if n.startswith("host buffer")} for stream, touched, written in checker.launches
              if stream not in (COMPUTE, HOST, WORKER) and written]
    pinned_mirror = {f"host buffer {handle.groups[0].mirror.buffer.data_ptr():#x}"}
    assert all(len(read) == 1 for read in copies), "each copy to the device reads one pinned buffer"
    assert len(set().union(*copies)) == 3, "the pinned group's mirror and the two staging buffers"
    assert stats["staged_copies"] == sum(read != pinned_mirror for read in copies) >= 3 * pinned_groups.count(False)
    assert stats["copies_h2d"] == len(copies)
    handle.remove()
    assert checker.cudart.registered == {}, "the ring goes with the handle"


def test_a_staging_buffer_is_refilled_only_after_the_copy_out_of_it_ran(stream_checker, monkeypatch):
    """Without the host's wait for a staging buffer's last copy, the host overwrites it while the copy
    stream may still read it: the checker must see that race."""
    from offload_core.staging import StagingRing
    from testbed.stream_checker import RaceError

    reference, offloaded, x = make_pair("cpu")
    group = limit_pins_to_three_groups(stream_checker)
    handle = offload(offloaded, stream_checker, prefetch=1)
    sent = StagingRing.sent
    monkeypatch.setattr(StagingRing, "sent", lambda self, index, stream: None)  # no event: no wait
    with torch.inference_mode(), pytest.raises(RaceError, match="host buffer"):
        offloaded(x)
    monkeypatch.setattr(StagingRing, "sent", sent)
    handle.remove()  # (its unpinning waits for the copies, as it should)


def test_unpinning_gives_back_the_staging_ring_last(checker):
    _, offloaded, _ = make_pair("cpu")
    group = limit_pins_to_three_groups(checker)
    handle = offload(offloaded, checker)
    assert handle.unpin(at_least=1) == group and handle.stats()["staging_bytes"] == 2 * group
    assert handle.unpin() == 2 * group and checker.cudart.registered == {}


@pytest.mark.parametrize("resident_share", [0.0, 0.5, 1.0])
def test_a_call_inside_a_cuda_graph_capture_is_refused_before_the_offloading_queues_anything(checker, resident_share):
    """The hooks copy on a stream outside the capture, order with events and wait on the host, choosing at every
    call: inside a capture they refuse at the first group, before any copy, wait or state change; the model's own
    ops before it (its embedding) are the capture's. Outside the capture the model runs as before, ordered."""
    reference, offloaded, x = make_pair("cpu")
    handle = offload(offloaded, checker, prefetch=1)
    handle.set_resident_bytes(int(resident_share * sum(g.nbytes for g in handle.groups)))
    with torch.inference_mode():
        expected = reference(x)
        handle.onload_resident()
        assert torch.equal(offloaded(x), expected)
        counts = lambda: {k: v for k, v in handle.stats().items() if not k.startswith("hook_")}  # noqa: E731
        launches, stats = len(checker.launches), counts()
        with pytest.raises(CaptureError, match=r"cannot run inside a CUDA graph capture: .* Run the model without "
                                               r"CUDA graphs .*, or capture it without group offloading"):
            with checker.capture():
                offloaded(x)
        assert checker.captured_ops and len(checker.launches) == launches, "nothing of the offloading queued"
        assert counts() == stats and not any(g.running for g in handle.groups)
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
    assert not checker.races


@pytest.mark.cuda
def test_a_capture_on_the_gpu_is_refused_and_leaves_the_model_as_it_was():
    """The twin of the stand-in test on a GPU, with torch's own capture: the refusal, not a CUDA error, and the
    capture ends cleanly (only the model's own ops before its blocks in it); the model then runs as before."""
    reference, offloaded, x = make_pair("cuda")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cuda", prefetch=1)
    handle.set_resident_bytes(sum(g.nbytes for g in handle.groups) // 2)
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)  # (also warms cuBLAS up, as a capture needs)
        torch.cuda.synchronize()
        with pytest.raises(CaptureError, match="cannot run inside a CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                offloaded(x)
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
    assert handle.stats()["bytes_d2h"] == 0

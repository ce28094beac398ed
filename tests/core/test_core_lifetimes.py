"""offload_core lifetimes: grad modes, mirrors collected without remove(), skipped blocks, extra slabs."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from offload_core import CudaHostRegister, apply_group_offload
from offload_core.mirror import HostMirror, pack_layout
from testbed.stream_checker import RaceError
from testbed.core_models import make_pair


@pytest.fixture
def checker(stream_checker):
    return stream_checker


@pytest.mark.parametrize("blocks_per_group", [1, 3])
def test_inference_then_no_grad_then_inference_then_backward(blocks_per_group):
    reference, offloaded, x = make_pair("cpu")
    with torch.inference_mode():  # ComfyUI builds and runs models under inference mode
        handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=blocks_per_group)
        handle.set_resident_bytes(handle.groups[0].nbytes)
        assert torch.equal(offloaded(x), reference(x))
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    buffers = [g.mirror.buffer for g in handle.groups] + [g.slab for g in handle.groups if g.onloaded]
    assert not any(b.is_inference() for b in buffers)
    handle.remove()
    offloaded(x).square().sum().backward()
    reference(x).square().sum().backward()
    for mine, theirs in zip(offloaded.blocks.parameters(), reference.blocks.parameters()):
        assert not mine.is_inference() and torch.equal(mine.grad, theirs.grad)


def test_parameters_made_under_inference_mode_run_in_every_mode(checker):
    """ComfyUI builds its models under inference mode: the engine's buffers are then inference tensors
    too (a Parameter of that kind takes no other as its ``.data``), written under inference mode."""
    with torch.inference_mode():
        reference, offloaded, x = make_pair("cpu")
        expected = reference(x)
        handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker, prefetch=1)
        handle.set_resident_bytes(handle.groups[0].nbytes)
        assert torch.equal(offloaded(x), expected)
    with torch.no_grad():
        assert torch.equal(offloaded(x), expected)
    buffers = [g.mirror.buffer for g in handle.groups] + [g.slab for g in handle.groups if g.onloaded]
    assert all(b.is_inference() for b in buffers)
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), expected), "after remove() the model computes as before"


def _pinned_mirror(drain=None) -> HostMirror:
    source = torch.arange(64, dtype=torch.float32)
    segments, nbytes = pack_layout([source])
    mirror = HostMirror(segments, nbytes)
    mirror.views[0].copy_(source)
    assert mirror.pin(CudaHostRegister(), drain)
    return mirror


def test_a_collected_mirror_is_unpinned_without_a_cycle(checker):
    mirror = _pinned_mirror()
    pointer, collected = mirror.buffer.data_ptr(), weakref.ref(mirror)
    gc.disable()  # reference counting alone must free it: nothing in the finalizer points back at it
    try:
        del mirror
        assert collected() is None
    finally:
        gc.enable()
    assert checker.cudart.unregistered == [pointer] and checker.cudart.registered == {}


@pytest.mark.parametrize("drained", [False, True])
def test_unpinning_waits_for_the_copies_from_the_mirror(checker, drained):
    side = checker.new_stream()
    mirror = _pinned_mirror(side.synchronize if drained else None)
    slab = checker.empty(mirror.nbytes)
    side.wait_stream(checker.current_stream())
    with checker.use_stream(side):
        slab.copy_(mirror.buffer, non_blocking=True)
    if drained:
        mirror.unpin()
        assert not mirror.pinned and checker.races == []
    else:
        with pytest.raises(RaceError, match="cudaHostUnregister"):
            mirror.unpin()


class Nesting(nn.Module):
    """Block 0 calls block 2 from inside its forward: two groups run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.blocks[0].forward = self._outer

    def _outer(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[2](nn.Linear.forward(self.blocks[0], x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        return x


@pytest.mark.parametrize("on_streams", [False, True])
def test_slabs_beyond_the_plan_count_in_device_bytes_needed(request, on_streams):
    runtime = request.getfixturevalue("checker") if on_streams else None
    torch.manual_seed(0)
    model = Nesting()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
        handle = apply_group_offload(model, model.blocks, "cpu", prefetch=0, runtime=runtime)
        planned = handle.device_bytes_needed()
        for _ in range(3):
            assert torch.equal(model(x), expected)
    slab = max(g.nbytes for g in handle.groups)
    assert planned == slab, "prefetch 0 plans one slab"
    assert handle.device_bytes_needed() == 2 * slab, "the nested group needed a second one"
    assert handle.stats()["slab_bytes"] == 2 * slab


@pytest.mark.parametrize("on_streams", [False, True])
@pytest.mark.parametrize("skipped", [3, 5])  # the last block of the middle group; of the last group
def test_a_group_whose_last_block_is_skipped_gives_its_slab_back(request, on_streams, skipped):
    runtime = request.getfixturevalue("checker") if on_streams else None
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=2, prefetch=1, runtime=runtime)
    planned = handle.device_bytes_needed()
    skipping = [i for i in range(6) if i != skipped]
    orders = (None, skipping, skipping, None, skipping, None)
    with torch.no_grad():
        for order in orders:
            reference.order = offloaded.order = order
            assert torch.equal(offloaded(x), reference(x))
            held = [g.index for g in handle.groups if g.onloaded]
            assert len(held) <= 2 and handle.device_bytes_needed() == planned
            if order is skipping and skipped == 3:
                assert 1 not in held, "closed when the next group entered"
    # One copy per group per pass (and the next pass's first group, prefetched): no group kept its slab.
    assert handle.stats()["copies_h2d"] == len(orders) * len(handle.groups) + 1

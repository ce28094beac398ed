"""offload_core on plain torch modules: exact outputs, the ledger, residency, removal, bad input."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload_core import apply_group_offload, handle_of
from testbed.core_models import Net, make_pair

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def group_bytes(handle) -> list[int]:
    return [g.nbytes for g in handle.groups]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks_per_group", [1, 2, 4])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("resident_share", [0.0, 0.5, 1.0])
def test_bit_identical_and_ledger(device, blocks_per_group, prefetch, resident_share):
    reference, offloaded, x = make_pair(device)
    handle = apply_group_offload(offloaded, offloaded.blocks, device, blocks_per_group=blocks_per_group, prefetch=prefetch)
    handle.set_resident_bytes(int(resident_share * sum(group_bytes(handle))))
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(2):  # first forward learns the order, second reaches the steady state
            assert torch.equal(offloaded(x), expected)
        handle.reset_stats()
        forwards = 3
        for _ in range(forwards):
            assert torch.equal(offloaded(x), expected)
    stats = handle.stats()
    streamed = [g for g in handle.groups if not g.resident]
    assert stats["bytes_d2h"] == 0 and stats["copies_d2h"] == 0
    assert stats["bytes_h2d"] == forwards * sum(g.nbytes for g in streamed)
    assert stats["copies_h2d"] == forwards * len(streamed)  # one packed copy per group, whatever its dtypes
    assert stats["resident_groups"] == len(handle.groups) - len(streamed)
    if prefetch and len(streamed) > 1:
        assert stats["sync_onloads"] == 0, "every streamed group should have been prefetched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(device, dtype):
    reference, offloaded, x = make_pair(device, dtype)
    apply_group_offload(offloaded, offloaded.blocks, device, prefetch=1)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))


class Fp8Block(nn.Module):
    """Weights stored in fp8 and cast for compute, like ComfyUI's manual-cast ops."""

    def __init__(self, width: int, fmt: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", (torch.randn(width, width) * 0.1).to(fmt))
        self.bias = nn.Parameter(torch.randn(width, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_mirrors_keep_fp8(fmt):
    torch.manual_seed(0)
    reference = nn.Sequential(*(Fp8Block(16, fmt) for _ in range(3)))
    offloaded = copy.deepcopy(reference)
    handle = apply_group_offload(offloaded, list(offloaded), "cpu")
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))
    assert offloaded[0].weight.dtype == fmt
    assert handle.groups[0].nbytes < 16 * 16 * 2 + 16 * 2 + 2 * 256, "fp8 weights must not be widened in the mirror"


def test_tied_parameters_stay_tied():
    torch.manual_seed(0)
    reference = Net(depth=4)
    for block in reference.blocks:
        block.ctx_proj.weight = block.attn.weight  # tied inside a block
    offloaded = copy.deepcopy(reference)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=2)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))
            assert offloaded.blocks[1].ctx_proj.weight is offloaded.blocks[1].attn.weight
    unique = {id(p) for b in reference.blocks[:2] for p in b.parameters()}
    assert len(handle.groups[0].bindings) == len(unique) + 2  # + the two gate buffers


def test_parameters_live_in_the_mirror_and_mirrors_are_not_written():
    _, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    snapshot = [g.mirror.buffer.clone() for g in handle.groups]
    with torch.no_grad():
        for _ in range(3):
            offloaded(x)
    # Only the group prefetched for the next forward sits on the device between forwards.
    assert [g.onloaded for g in handle.groups] == [True] + [False] * 5
    for group, before in zip(handle.groups[1:], snapshot[1:]):
        start, size = group.mirror.buffer.data_ptr(), group.nbytes
        for p in (p for b in group.blocks for p in b.parameters()):
            assert start <= p.data_ptr() < start + size, "offloaded parameters point at the host mirror"
    assert all(torch.equal(g.mirror.buffer, before) for g, before in zip(handle.groups, snapshot))


def test_out_of_order_execution_falls_back_and_stays_correct():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=2)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(offloaded(x), reference(x))
        handle.reset_stats()
        for order in ([5, 4, 3, 2, 1, 0], [0, 2, 4], None):
            reference.order = offloaded.order = order
            assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["sync_onloads"] > 0


def test_remove_restores_plain_module():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu")
    with torch.no_grad():
        offloaded(x)
    handle.remove()
    assert handle_of(offloaded.blocks[0]) is None
    assert all("forward" not in b.__dict__ for b in offloaded.blocks), "the class's forward again"
    assert not any(g.mirror.pinned or g.onloaded for g in handle.groups)
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    again = apply_group_offload(offloaded, offloaded.blocks, "cpu")  # may be applied afresh
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    again.remove()


def test_applied_inside_inference_mode():
    reference, offloaded, x = make_pair("cpu")
    with torch.inference_mode():
        apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))


def test_fill_writes_the_mirrors():
    reference, offloaded, x = make_pair("cpu")
    source = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for p in offloaded.blocks.parameters():
        p.data.zero_()
    names = []

    def fill(name, view):
        names.append(name)
        view.copy_(source[name])

    apply_group_offload(offloaded, offloaded.blocks, "cpu", fill=fill)
    assert "blocks.0.mlp.0.weight" in names and "blocks.5.gate" in names
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))


def test_onload_patch_applies_on_device_and_leaves_mirrors_pristine():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    target = "blocks.2.attn.weight"
    handle.set_onload_patch(lambda name, w: w * 2, [target])
    reference.blocks[2].attn.weight.data.mul_(2)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded(x), reference(x))
        assert torch.equal(offloaded.blocks[2].attn.weight * 2, reference.blocks[2].attn.weight)
        handle.set_onload_patch(None)
        reference.blocks[2].attn.weight.data.div_(2)
        assert torch.equal(offloaded(x), reference(x))


def test_progress_is_reported_per_group():
    _, offloaded, _ = make_pair("cpu")
    seen = []
    apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=4, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 2), (2, 2)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"blocks_per_group": 0}, "blocks_per_group"),
        ({"prefetch": -1}, "prefetch"),
        ({"resident_bytes": -5}, "resident_bytes"),
        ({"offload_device": "meta"}, "offload_device"),
        ({"entry_methods": ()}, "entry_methods must name one or more distinct block methods"),
        ({"entry_methods": ("forward", "forward")}, "entry_methods must name one or more distinct block methods"),
        ({"entry_methods": ("forward", "missing")}, "blocks\\[0\\] \\(Block\\) has no method 'missing'"),
    ],
)
def test_bad_arguments(kwargs, message):
    _, offloaded, _ = make_pair("cpu")
    with pytest.raises(ValueError, match=message):
        apply_group_offload(offloaded, offloaded.blocks, "cpu", **kwargs)


def test_bad_blocks():
    _, offloaded, _ = make_pair("cpu")
    with pytest.raises(ValueError, match="not a submodule"):
        apply_group_offload(offloaded, [nn.Linear(2, 2)], "cpu")
    with pytest.raises(ValueError, match="empty"):
        apply_group_offload(offloaded, [], "cpu")
    with pytest.raises(ValueError, match="more than once"):
        apply_group_offload(offloaded, [offloaded.blocks[0], offloaded.blocks[0]], "cpu")
    apply_group_offload(offloaded, offloaded.blocks[:3], "cpu")
    with pytest.raises(ValueError, match="already group-offloaded"):
        apply_group_offload(offloaded, offloaded.blocks[2:], "cpu")


def test_a_tensor_shared_across_groups_is_refused_by_name():
    _, offloaded, _ = make_pair("cpu")
    offloaded.blocks[3].attn.weight = offloaded.blocks[1].attn.weight  # tied across two blocks
    with pytest.raises(ValueError, match=r"blocks\.3\.attn\.weight is the same tensor as blocks\.1\.attn\.weight"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu")
    apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=4)  # one group holds both: fine


def test_a_block_tensor_the_rest_of_the_model_holds_is_refused_by_name():
    _, offloaded, _ = make_pair("cpu")
    offloaded.shared_scale = offloaded.blocks[0].attn.weight
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.weight is also held outside the offloaded blocks, as shared_scale"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu")


def test_reapplying_adopts_the_packed_mirrors_without_copying():
    reference, offloaded, x = make_pair("cpu")
    first = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=2)
    buffers = [g.mirror.buffer.data_ptr() for g in first.groups]
    first.remove()
    second = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=2)
    assert [g.mirror.buffer.data_ptr() for g in second.groups] == buffers
    second.remove()
    third = apply_group_offload(  # another grouping cannot adopt: it packs afresh
        offloaded, offloaded.blocks, "cpu", blocks_per_group=3)
    assert not set(g.mirror.buffer.data_ptr() for g in third.groups) & set(buffers)
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))


def test_park_shows_pristine_host_weights_and_resumes_without_copies():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    handle.set_resident_bytes(handle.groups[0].nbytes)
    with torch.no_grad():
        offloaded(x), offloaded(x)
        handle.park()
        for group in handle.groups:
            start = group.mirror.buffer.data_ptr()
            assert all(start <= p.data_ptr() < start + group.nbytes for b in group.blocks for p in b.parameters())
        copies = handle.stats()["copies_h2d"]
        assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["copies_h2d"] - copies == len(handle.groups) - 1  # the resident group: no copy


class WrappedTensor(torch.Tensor):
    """A tensor subclass standing in for a quantized weight that carries more than its bytes."""


def test_tensor_subclasses_are_refused_by_name():
    _, offloaded, _ = make_pair("cpu")
    weight = offloaded.blocks[1].attn.weight
    offloaded.blocks[1].attn.weight = nn.Parameter(weight.detach().as_subclass(WrappedTensor), requires_grad=False)
    offloaded.blocks[1].attn.weight.scale = torch.ones(1)  # (what its bytes do not carry)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.weight is a WrappedTensor"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu")
    assert handle_of(offloaded.blocks[0]) is None, "nothing half-applied"
    assert all("forward" not in b.__dict__ for b in offloaded.blocks)


def test_a_failing_forward_leaves_the_group_offloaded():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    with torch.no_grad():
        offloaded(x), offloaded(x)
        with pytest.raises(RuntimeError):
            offloaded.blocks[2](torch.randn(2, 5, 3), ctx=torch.zeros(2, 1, 32))  # wrong width
        assert not handle.groups[2].onloaded
        assert torch.equal(offloaded(x), reference(x))


@pytest.mark.parametrize("failing", [0, 3], ids=["own_onload", "prefetch"])
def test_a_failing_onload_patch_leaves_the_group_offloaded(failing):
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)

    def out_of_memory(name, weight):
        raise RuntimeError("out of memory")

    with torch.no_grad():
        offloaded(x)  # learns the order: group 3 is prefetched while group 2 runs
        handle.set_onload_patch(out_of_memory, [f"blocks.{failing}.attn.weight"])
        with pytest.raises(RuntimeError, match="out of memory"):
            offloaded(x)
        assert not any(g.onloaded for g in handle.groups)
        assert handle.stats()["slab_bytes"] <= (handle.config.prefetch + 1) * max(group_bytes(handle))
        handle.set_onload_patch(None)
        assert torch.equal(offloaded(x), reference(x))


def test_the_patch_device_bytes_are_counted_while_a_patch_is_set():
    _, offloaded, _ = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    groups_only = handle.device_bytes_needed()
    handle.set_onload_patch(lambda name, w: w, ["blocks.0.attn.weight"], device_bytes=1000)
    assert handle.device_bytes_needed() == groups_only + 1000
    handle.set_onload_patch(None, device_bytes=1000)
    assert handle.device_bytes_needed() == groups_only


def test_removal_under_a_later_wrapper_keeps_it_working():
    reference, offloaded, x = make_pair("cpu")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu")
    ours = offloaded.blocks[0].forward
    offloaded.blocks[0].forward = lambda *a, **k: ours(*a, **k)  # another pack wraps after us
    handle.remove()
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["hook_calls"] == 0

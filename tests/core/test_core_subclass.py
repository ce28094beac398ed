"""Tensor subclasses in the engine: wrapper subclasses (quantized weights) packed as their inner tensors,
plain subclasses (as ComfyUI-GGUF's) as their bytes with their attributes; the Parameter objects kept,
nothing dequantized or cloned, outputs bit-identical, streams ordered; any other subclass refused."""
from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload_core import UnpackableTensorError, apply_group_offload, packed_nbytes
from testbed.core_models import make_pair
from testbed.core_models import QUANTIZERS, ScaledInt8, quantized_pair


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.blocks.named_parameters() if name.endswith("weight") and p.ndim == 2}


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names]


def inner_spans(tensor: torch.Tensor) -> list[int]:
    return [t.data_ptr() for t in inner_tensors(tensor)]


@pytest.fixture(params=QUANTIZERS, ids=str)
def quantize(request):
    return QUANTIZERS[request.param]


@pytest.mark.parametrize("blocks_per_group,prefetch,resident_share",
                         [(1, 0, 0.0), (1, 1, 0.0), (2, 2, 0.0), (1, 1, 0.5), (3, 1, 1.0)])
def test_bit_identical_streamed_at_the_quantized_size(quantize, checker, blocks_per_group, prefetch, resident_share):
    reference, offloaded, x = quantized_pair(quantize)
    before = weights(offloaded)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=blocks_per_group,
                                 prefetch=prefetch, runtime=checker)
    handle.set_resident_bytes(int(resident_share * sum(g.nbytes for g in handle.groups)))
    packed = sum(packed_nbytes(t) for b in offloaded.blocks for t in (*b.parameters(), *b.buffers()))
    assert packed < sum(t.numel() * t.element_size() for b in reference.blocks for t in (*b.parameters(), *b.buffers()))
    assert packed <= handle.stats()["host_bytes"] < packed + 256 * 6 * 9, "data and scales, at their own size"
    with torch.inference_mode():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(offloaded(x), expected)
        handle.reset_stats()
        assert torch.equal(offloaded(x), expected)
    stats = handle.stats()
    assert stats["bytes_h2d"] == stats["streamed_bytes_per_pass"]
    after = weights(offloaded)
    assert all(after[name] is before[name] for name in before), "the Parameter objects are the module's still"
    assert all(isinstance(p, nn.Parameter) and type(p) is type(reference.blocks[0].attn.weight) for p in after.values())
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), expected), "after remove(), from the host mirrors"


def test_device_copies_are_views_of_the_slab_not_clones(quantize, checker):
    _, offloaded, x = quantized_pair(quantize)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=0, runtime=checker)
    seen = []

    def record(module, args):
        slab = handle.groups[1].slab
        start = slab.data_ptr()
        seen.append(all(start <= ptr < start + slab.numel() for ptr in inner_spans(module.weight)))

    offloaded.blocks[1].attn.register_forward_pre_hook(record)
    with torch.inference_mode():
        offloaded(x)
    assert seen == [True], "the data and every scale lie in the group's slab"
    mirror = handle.groups[1].mirror.buffer
    start = mirror.data_ptr()
    assert all(start <= ptr < start + mirror.numel() for ptr in inner_spans(offloaded.blocks[1].attn.weight))


def test_an_onload_patch_writes_the_quantized_device_copy(checker):
    reference, offloaded, x = quantized_pair(ScaledInt8.quantize)
    target = "blocks.2.attn.weight"
    with torch.inference_mode():
        doubled = ScaledInt8.quantize(reference.blocks[2].attn.weight.dequantize() * 2)
        reference.blocks[2].attn.weight = nn.Parameter(doubled, requires_grad=False)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker)
    handle.set_onload_patch(lambda name, weight: doubled, [target])
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(offloaded(x), reference(x))
    handle.remove()  # (unpinned first: the checker takes a host read of pinned memory for a kernel)
    assert torch.equal(offloaded.blocks[2].attn.weight.scale * 2, doubled.scale), "the mirror stays pristine"


def test_weights_made_outside_inference_mode(quantize, checker):
    reference, offloaded, x = quantized_pair(quantize, inference=False)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker)
    with torch.no_grad():
        assert torch.equal(offloaded(x), reference(x))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    handle.remove()
    assert not offloaded.blocks[0].attn.weight.is_inference()


def test_a_new_handle_adopts_the_packed_buffers(quantize):
    reference, offloaded, x = quantized_pair(quantize)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu")
    mirrors = [g.mirror.buffer.data_ptr() for g in handle.groups]
    handle.remove()
    again = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=1)
    assert [g.mirror.buffer.data_ptr() for g in again.groups] == mirrors, "no second host copy"
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))


def test_quantized_buffers_are_rebuilt_too(checker):
    reference, offloaded, x = make_pair("cpu")
    for model in (reference, offloaded):
        with torch.inference_mode():
            model.blocks[1].gate = ScaledInt8.quantize(model.blocks[1].gate.reshape(-1, 1)).reshape(-1)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", runtime=checker)
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["host_bytes"] > 0


class EncodedWeight(torch.Tensor):
    """As ComfyUI-GGUF's GGMLTensor: raw ``uint8`` bytes in its own storage; what they mean (the shape they
    encode, the patches to add once decoded) lives in its attributes; ``.shape`` is the encoded one."""

    @property
    def shape(self) -> torch.Size:
        return self.tensor_shape


class DecodingLinear(nn.Linear):
    """A layer that decodes its weight at each forward, and adds the patches hung on it (as GGMLLayer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        decoded = w.as_subclass(torch.Tensor).view(torch.float32).view(w.tensor_shape).to(x.device)
        return nn.functional.linear(x, decoded + sum(p.to(x.device) for p in w.patches), self.bias)


def encode(linear: nn.Linear) -> DecodingLinear:
    layer = DecodingLinear(linear.in_features, linear.out_features)
    layer.load_state_dict(linear.state_dict())
    with torch.inference_mode():
        weight = nn.Parameter(linear.weight.detach().view(torch.uint8).as_subclass(EncodedWeight), requires_grad=False)
    weight.tensor_shape, weight.patches = linear.weight.shape, []
    layer.weight = weight
    return layer


def encoded_pair():
    reference, offloaded, x = make_pair("cpu")
    for model in (reference, offloaded):
        for block in model.blocks:
            block.attn = encode(block.attn)
    return reference, offloaded, x


@pytest.mark.parametrize("blocks_per_group,prefetch", [(1, 0), (1, 1), (2, 2)])
def test_plain_subclass_weights_stream_as_their_bytes_and_keep_their_attributes(checker, blocks_per_group, prefetch):
    reference, offloaded, x = encoded_pair()
    weights = [block.attn.weight for block in offloaded.blocks]
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", blocks_per_group=blocks_per_group,
                                 prefetch=prefetch, runtime=checker)
    assert handle.stats()["host_bytes"] == sum(g.nbytes for g in handle.groups)
    assert packed_nbytes(weights[0]) == 32 * 32 * 4, "its raw bytes, not its encoded shape"
    seen = []

    def record(module, args):
        slab = handle.groups[1 // blocks_per_group].slab
        seen.append((module.weight is weights[1], slab.data_ptr() <= module.weight.data_ptr() < slab.data_ptr()
                     + slab.numel(), module.weight.shape, len(module.weight.patches)))

    hook = offloaded.blocks[1].attn.register_forward_pre_hook(record)
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
        patch = torch.full((32, 32), 0.01)
        for model in (reference, offloaded):
            model.blocks[1].attn.weight.patches = [patch]  # as ComfyUI-GGUF's patcher hangs a LoRA, after packing
        assert torch.equal(offloaded(x), reference(x)), "the patches set later travel with the weight"
    assert seen == [(True, True, torch.Size([32, 32]), 0), (True, True, torch.Size([32, 32]), 1)]
    assert all(block.attn.weight is w and type(w) is EncodedWeight for block, w in zip(offloaded.blocks, weights))
    hook.remove()
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x)), "after remove(), from the host mirrors"


class Tagged(torch.Tensor):
    """A plain subclass whose values are its bytes, with an attribute."""


def test_plain_subclass_buffers_are_rebuilt_sharing_their_attributes(checker):
    reference, offloaded, x = make_pair("cpu")
    gate = offloaded.blocks[2].gate.as_subclass(Tagged)
    gate.unit = "ratio"
    offloaded.blocks[2].gate = gate
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=0, runtime=checker)
    seen = []
    block = offloaded.blocks[2]
    block.norm.register_forward_pre_hook(  # (inside the block's forward, where the group is on the device)
        lambda module, args: seen.append((type(block.gate), block.gate.__dict__ is gate.__dict__,
                                          block.gate.untyped_storage().data_ptr() == handle.groups[2].slab.data_ptr())))
    with torch.inference_mode():
        assert torch.equal(offloaded(x), reference(x))
    assert seen == [(Tagged, True, True)], "a view of the slab, of its class, with the same attributes"
    assert type(offloaded.blocks[2].gate) is Tagged and offloaded.blocks[2].gate.unit == "ratio"


class ScaledBytes(torch.Tensor):
    """A plain subclass with a tensor among its attributes: its bytes alone do not say what it is."""


class Slotted(torch.Tensor):
    __slots__ = ("kind",)


class Dispatching(torch.Tensor):
    """A wrapper without the wrapper protocol: another tensor's bytes, its own dispatch."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        tensor = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        tensor.elem = elem
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, Dispatching) else t, (args, kwargs or {}))
        return func(*unwrapped[0], **unwrapped[1])


@pytest.mark.parametrize("cls,reason", [
    (ScaledBytes, r"its attribute scale is a tensor"),
    (Slotted, r"it keeps state in __slots__ \(kind\)"),
], ids=["tensor_attribute", "slots"])
def test_subclasses_not_rebuildable_from_bytes_and_attributes_are_refused_by_name(cls, reason):
    _, offloaded, _ = make_pair("cpu")
    weight = nn.Parameter(offloaded.blocks[1].attn.weight.detach().as_subclass(cls), requires_grad=False)
    if cls is ScaledBytes:
        weight.scale = torch.ones(1)
    offloaded.blocks[1].attn.weight = weight
    with pytest.raises(UnpackableTensorError, match=rf"blocks\.1\.attn\.weight is a {cls.__name__}, .*: {reason}") as refused:
        apply_group_offload(offloaded, offloaded.blocks, "cpu")
    assert refused.value.tensor_type is cls


def test_a_subclass_with_its_own_dispatch_is_refused_by_name():
    _, offloaded, _ = make_pair("cpu")
    offloaded.blocks[1].gate = Dispatching(offloaded.blocks[1].gate)
    with pytest.raises(UnpackableTensorError, match=r"blocks\.1\.gate is a Dispatching, .*: it runs its own __torch_dispatch__"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu")


def test_wrappers_of_subclassed_inner_tensors_are_refused_by_name():
    _, offloaded, _ = make_pair("cpu")
    weight = ScaledInt8.quantize(offloaded.blocks[0].attn.weight.detach())
    weight.scale = weight.scale.as_subclass(Tagged)
    offloaded.blocks[0].attn.weight = nn.Parameter(weight, requires_grad=False)
    with pytest.raises(UnpackableTensorError, match=r"blocks\.0\.attn\.weight \(its inner tensor scale\) is a Tagged"):
        apply_group_offload(offloaded, offloaded.blocks, "cpu")


def test_the_parameter_moves_to_the_device_with_its_inner_tensors(quantize):
    """The meta device stands in for a GPU (a plain Parameter cannot take a meta tensor as ``.data``,
    so every tensor is quantized here): the outer tensor's device must follow its data and scales."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32, bias=False)) for _ in range(3)))
    with torch.inference_mode():
        for block in model:
            block[0].weight = nn.Parameter(quantize(block[0].weight.detach()), requires_grad=False)
    apply_group_offload(model, list(model), "meta", prefetch=0, pin_memory=False)
    seen = []

    def record(module, args):
        seen.append((module.weight.device.type, {t.device.type for t in inner_tensors(module.weight)}))

    model[1][0].register_forward_pre_hook(record)  # (inside the block's forward, where the group is on the device)
    with torch.inference_mode():
        model(torch.zeros(2, 32, device="meta"))
    assert seen == [("meta", {"meta"})]
    weight = model[1][0].weight
    assert (weight.device.type, {t.device.type for t in inner_tensors(weight)}) == ("cpu", {"cpu"}), "back on the mirror"


def test_compiled_blocks_with_quantized_weights_compile_once():
    """torch.compile per block (as KJNodes does): the exchanged Parameters keep their identity, so the
    compiled blocks compute as without offloading and nothing compiles again once warm."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    reference, offloaded, x = quantized_pair(ScaledInt8.quantize)
    apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    for model in (reference, offloaded):
        for block in model.blocks:
            block.compile(backend="aot_eager")
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(offloaded(x), expected)
        before = counters["frames"]["total"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(2):
                assert torch.equal(offloaded(x), expected)
    assert counters["frames"]["total"] == before, "torch.compile compiled a new frame once warm"

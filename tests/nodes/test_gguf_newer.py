"""Newer ComfyUI-GGUF (nodes.py at 8e0d9cad) through the node, its changed methods written here as stand-ins.

Its newest files are public source to read, not a package the tests can install (795e451, unpacked by ``dev.py
setup``, is what they run), and their code stays out of this repository: the methods that changed what the node
meets are written again here, each following nodes.py at 8e0d9cad03675aa6358bafb670a1d78def8746a4, over 795e451:

- ``GGUFModelPatcher.partially_load`` / ``partially_unload`` force ``force_patch_weights=True``;
- ``GGUFModelPatcherDynamic.clone(disable_dynamic=True)`` (the patcher of *Unet Loader (GGUF, Dynamic VRAM)*, a
  ComfyUI ``ModelPatcherDynamic``: those tests need a ComfyUI that has one)
  loads the file again through the loader's ``cached_patcher_init`` and clones that as a ``GGUFModelPatcher``.

Its Q8_CR layers are ``GGUFQ8Ops.Linear`` (ops.py at 8e0d9cad03675aa6358bafb670a1d78def8746a4): ComfyUI's own
mixed-precision Linear, loaded from the INT8 tensorwise state dict its loader makes of a Q8_CR tensor (loader.py at
the same commit: ``int8`` weight, ``float32`` scale, ``comfy_quant`` JSON); its patcher's ``patch_weight_to_device``
leaves such a weight (not a GGML one) to its plain branch, as 795e451's does. A Q8_CR layer needs a ComfyUI with
INT8 tensorwise layers (0.33.0; not 0.3.75).
"""
from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from testbed.gguf_runs import DEVICE_APART, expected, load_gguf, offload, offload_handle, sample, with_lora

ALL_RESIDENT = {"residency": "budget", "resident_gb": 1.0}


def gguf_patcher_class() -> type:
    return type(load_gguf("qwen_image"))


@pytest.fixture
def forced_repatch(gguf_models, monkeypatch) -> None:
    """ComfyUI-GGUF's patcher re-patching at every load and unload, as ``GGUFModelPatcher.partially_load`` /
    ``partially_unload`` do in nodes.py at 8e0d9cad."""
    patcher = gguf_patcher_class()
    base = patcher.__mro__[1]
    monkeypatch.setattr(patcher, "partially_load", lambda self, *args, force_patch_weights=False, **kwargs:
                        base.partially_load(self, *args, force_patch_weights=True, **kwargs), raising=False)
    monkeypatch.setattr(patcher, "partially_unload", lambda self, *args, force_patch_weights=False, **kwargs:
                        base.partially_unload(self, *args, force_patch_weights=True, **kwargs), raising=False)


def test_resident_groups_stay_on_the_device_across_a_forced_repatch(forced_repatch):
    kind = "qwen_image"
    plain = load_gguf(kind)
    plain.load_device = DEVICE_APART  # a device the groups' copies can be told apart on
    model = offload(plain, **ALL_RESIDENT)
    assert torch.equal(sample(model, kind), expected(kind))
    handle = offload_handle(model)
    slabs = [group.slab for group in handle.groups]
    assert all(slab is not None for slab in slabs), "every group resident"
    assert torch.equal(sample(model, kind), expected(kind))
    assert all(group.slab is slab for group, slab in zip(handle.groups, slabs)), \
        "the resident groups kept their device copies: nothing uploaded again"
    assert torch.equal(sample(with_lora(model), kind), expected(kind, 0.8)), "new patches still apply"
    assert torch.equal(sample(model, kind), expected(kind)), "and go again"


@pytest.fixture
def dynamic_loader(gguf_models) -> tuple[Callable, list[bool]]:
    """*Unet Loader (GGUF, Dynamic VRAM)*'s load (``_load_dynamic_gguf_unet`` in nodes.py at 8e0d9cad) as a function
    of the model's kind, and the ``disable_dynamic`` of each file load it made. Its dynamic model is Unet Loader
    (GGUF)'s as a ``GGUFModelPatcherDynamic`` (comfy-aimdo's lazy load needs a GPU); without Dynamic VRAM it is
    Unet Loader (GGUF)'s, as there."""
    import comfy.model_patcher

    dynamic_patcher = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if dynamic_patcher is None:
        pytest.skip("this ComfyUI has no Dynamic VRAM")
    gguf_patcher, loads = gguf_patcher_class(), []

    class GGUFModelPatcherDynamic(dynamic_patcher):
        def clone(self, disable_dynamic=False, model_override=None):
            """Without Dynamic VRAM: the file loaded again through ``cached_patcher_init``, as a GGUFModelPatcher."""
            if not disable_dynamic:
                return super().clone(disable_dynamic=disable_dynamic, model_override=model_override)
            if model_override is None:
                loader, arguments = self.cached_patcher_init
                model_override = loader(*arguments, disable_dynamic=True).get_clone_model_override()
            return gguf_patcher.clone(self, model_override=model_override)

    def load(kind: str, disable_dynamic: bool = False):
        loads.append(disable_dynamic)
        model = load_gguf(kind)
        if not disable_dynamic:
            model.__class__ = GGUFModelPatcherDynamic
        model.cached_patcher_init = (load, (kind,))
        return model

    return load, loads


def test_the_dynamic_vram_loaders_model_streams_as_its_plain_twin_loaded_once(dynamic_loader):
    load, loads = dynamic_loader
    kind = "qwen_image"
    dynamic = load(kind)
    assert dynamic.is_dynamic()
    offloaded = offload(dynamic)
    assert not offloaded.is_dynamic() and isinstance(offloaded, gguf_patcher_class())
    assert torch.equal(sample(offloaded, kind), expected(kind))
    assert torch.equal(sample(with_lora(offload(dynamic)), kind), expected(kind, 0.8)), "a LoRA after the node"
    assert offload(dynamic).model is offloaded.model, "one plain model, however often the node runs"
    assert loads == [False, True], "the file loaded once more, without Dynamic VRAM"


def test_a_deep_copy_of_the_dynamic_vram_loaders_model_loads_the_file_again(dynamic_loader):
    load, loads = dynamic_loader
    kind = "qwen_image"
    offloaded = offload(load(kind))
    deep = offloaded.clone(force_deepcopy=True)
    assert type(deep) is type(offloaded) and deep.model is not offloaded.model
    assert loads == [False, True, True]
    assert torch.equal(sample(deep, kind), expected(kind))


def test_a_layer_that_keeps_copies_of_its_weights_is_refused_naming_it(gguf_models):
    """ComfyUI-GGUF's Q4_CR layers (``GGUFQ4W4A4Ops.Linear``, ops.py at 8e0d9cad) keep a device copy of their packed
    weight from call to call, and declare it with ``evict_quantized_caches``: one block layer made such a layer."""
    model = load_gguf("qwen_image")
    layer = model.model.diffusion_model.transformer_blocks[1].attn.to_q

    class CachingLinear(type(layer)):
        def evict_quantized_caches(self) -> None:
            self._quantized_weight = None

    layer.__class__ = CachingLinear
    with pytest.raises(ValueError, match=r"cannot stream transformer_blocks\.1\.attn\.to_q \(CachingLinear\): that "
                                         r"layer keeps copies of its weights .* Q4_CR"):
        offload(model)
    with pytest.raises(ValueError, match=r"cannot stream transformer_blocks\.1\.attn\.to_q .* Run this model without "
                                         r"Group Offload, or use a GGUF file of another type"):
        offload(with_lora(model))  # (a LoRA before the node: the same refusal, the same fix)
    layer.__class__ = CachingLinear.__mro__[1]
    assert torch.equal(sample(offload(model), "qwen_image"), expected("qwen_image")), "the model as it was"


def as_q8_cr_layer(model, path: str = "transformer_blocks.1.attn.to_q"):
    """``model`` (a ComfyUI-GGUF model) with the block layer at ``path`` made a Q8_CR layer holding seeded INT8
    weights, as ComfyUI-GGUF's loader and ``GGUFQ8Ops`` make one (ops.py / loader.py at 8e0d9cad)."""
    import comfy.ops

    if not hasattr(comfy.ops, "_load_quantized_module") or "int8_tensorwise" not in comfy.ops.QUANT_ALGOS:
        pytest.skip("this ComfyUI has no INT8 tensorwise layers, which ComfyUI-GGUF's Q8_CR files need")
    owner_path, _, name = path.rpartition(".")
    owner = model.model.diffusion_model.get_submodule(owner_path)
    plain = getattr(owner, name)
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(plain.out_features, plain.in_features, generator=generator) * 0.05
    scale = values.abs().max() / 127
    with torch.inference_mode():  # (as a loader node runs)
        layer = comfy.ops.mixed_precision_ops(quant_config={}, compute_dtype=torch.bfloat16).Linear(
            plain.in_features, plain.out_features, bias=False)
        layer.load_state_dict({"weight": torch.round(values / scale).clamp(-127, 127).to(torch.int8),
                               "weight_scale": scale.float(),
                               "comfy_quant": torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()),
                                                           dtype=torch.uint8)}, strict=False)
    setattr(owner, name, layer)
    return model


def q8_cr_model(kind: str = "qwen_image"):
    return as_q8_cr_layer(load_gguf(kind))


def test_a_q8_cr_layer_streams_as_its_int8_bytes_bit_identically(gguf_models):
    kind = "qwen_image"
    model = offload(q8_cr_model(kind))
    assert torch.equal(sample(model, kind), sample(q8_cr_model(kind), kind))
    streamed = {b.qualname: b.current() for g in offload_handle(model).groups for b in g.bindings}
    weight = streamed["diffusion_model.transformer_blocks.1.attn.to_q.weight"]
    assert type(weight).__name__ == "QuantizedTensor" and weight._layout_cls == "TensorWiseINT8Layout"
    assert weight._qdata.dtype == torch.int8, "streamed as the layer's INT8 bytes"


Q8_CR_KEY = "diffusion_model.transformer_blocks.1.attn.to_q.weight"


def test_a_lora_on_a_q8_cr_layer_applies_as_comfyuis_own_load_applies_it(gguf_models):
    """ComfyUI-GGUF alone drops a LoRA on a Q8_CR layer: its patcher adds the patch to the ``QuantizedTensor``
    itself (no ``convert_weight`` first), which leaves its INT8 values and scale as they were. Through the node the
    LoRA applies as ComfyUI's own load applies it to an INT8 layer: dequantized, patched, quantized again by the
    layer (``ModelPatcher.patch_weight_to_device``), computed into each streamed copy. The reference: the model
    without the node, its Q8_CR layer holding the weight ComfyUI's load patches, the other layers patched by
    ComfyUI-GGUF."""
    import comfy.model_patcher

    kind = "qwen_image"
    alone = with_lora(q8_cr_model(kind))
    layer = alone.model.diffusion_model.transformer_blocks[1].attn.to_q
    before = layer.weight.dequantize()
    with torch.inference_mode():
        alone.patch_weight_to_device(Q8_CR_KEY, device_to=torch.device("cpu"))
        assert torch.equal(layer.weight.dequantize(), before), "ComfyUI-GGUF alone: the LoRA left out of the layer"
        reference = with_lora(q8_cr_model(kind))
        owner = reference.model.diffusion_model.transformer_blocks[1].attn
        owner.to_q.weight = torch.nn.Parameter(comfy.model_patcher.ModelPatcher.patch_weight_to_device(
            reference, Q8_CR_KEY, device_to=torch.device("cpu"), return_weight=True), requires_grad=False)
    assert not torch.equal(owner.to_q.weight.dequantize(), before), "(ComfyUI's load changes that weight)"
    expected_latent = sample(reference, kind)
    assert torch.equal(sample(offload(with_lora(q8_cr_model(kind))), kind), expected_latent), "a LoRA before the node"
    model = offload(q8_cr_model(kind))
    assert torch.equal(sample(with_lora(model), kind), expected_latent), "a LoRA after the node"
    assert torch.equal(sample(model, kind), sample(q8_cr_model(kind), kind)), "and it goes again"

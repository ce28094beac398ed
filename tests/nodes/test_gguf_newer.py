"""Newer ComfyUI-GGUF (nodes.py at 8e0d9cad) through the node, its changed methods written here as stand-ins.

Its newest files are public source to read, not a package the tests can install (795e451, unpacked by ``dev.py
setup``, is what they run), and their code stays out of this repository: the methods that changed what the node
meets are written again here, each following nodes.py at 8e0d9cad03675aa6358bafb670a1d78def8746a4, over 795e451:

- ``GGUFModelPatcher.partially_load`` / ``partially_unload`` force ``force_patch_weights=True``;
- ``GGUFModelPatcherDynamic.clone(disable_dynamic=True)`` (the patcher of *Unet Loader (GGUF, Dynamic VRAM)*, a
  ComfyUI ``ModelPatcherDynamic``: those tests need a ComfyUI that has one)
  loads the file again through the loader's ``cached_patcher_init`` and clones that as a ``GGUFModelPatcher``.
"""
from __future__ import annotations

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
    layer.__class__ = CachingLinear.__mro__[1]
    assert torch.equal(sample(offload(model), "qwen_image"), expected("qwen_image")), "the model as it was"

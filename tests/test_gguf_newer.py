"""Newer ComfyUI-GGUF (nodes.py at 8e0d9cad) through the node, its changed methods written here as stand-ins.

Its newest files import modules ComfyUI 0.33.0 does not have (comfy-kitchen's int8 kernels for Q8_CR / Q4_CR)
and cannot be brought into the tests: the methods that changed what the node meets are written again here, each
following nodes.py at 8e0d9cad03675aa6358bafb670a1d78def8746a4, over ComfyUI-GGUF 795e451 (the one the tests run):

- ``GGUFModelPatcher.partially_load`` / ``partially_unload`` force ``force_patch_weights=True``;
- ``GGUFModelPatcherDynamic.clone(disable_dynamic=True)`` (the patcher of *Unet Loader (GGUF, Dynamic VRAM)*)
  loads the file again through the loader's ``cached_patcher_init`` and clones that as a ``GGUFModelPatcher``.
"""
from __future__ import annotations

import pytest
import torch

from test_gguf_streaming import gguf_models  # noqa: F401  (a fixture)
from test_gguf_streaming import DEVICE_APART, expected, load_gguf, offload, offload_handle, sample, with_lora

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

"""LoRA on an offloaded model across the clones ComfyUI makes of it: shift and strength changes."""
from __future__ import annotations

import gc

import torch

from testbed.run_nodes import run_node, run_txt2img
from testbed.node_runs import offload_handle, load_plain, offload, with_lora


def with_shift(model, shift: float):
    return run_node("ModelSamplingAuraFlow", model=model, shift=shift).outputs[0]


def test_a_shift_change_keeps_the_lora(models):
    """ModelSamplingAuraFlow clones the offloaded model with the same weights, so the new clone
    runs without ComfyUI calling its ``load()``; the clone that did load is gone by then."""
    offloaded = offload(with_lora(load_plain(), 0.8))
    first = with_shift(offloaded, 3.0)
    run_txt2img(first, seed=11)
    del first
    gc.collect()
    expected = run_txt2img(with_shift(with_lora(load_plain(), 0.8), 2.0), seed=11).latent
    assert torch.equal(run_txt2img(with_shift(offloaded, 2.0), seed=11).latent, expected)


def test_strength_changes_on_shifted_clones(models):
    offloaded = with_shift(offload(load_plain()), 2.5)
    for strength in (0.8, 0.3, 0.8):
        expected = run_txt2img(with_lora(with_shift(load_plain(), 2.5), strength), seed=12).latent
        clone = with_lora(offloaded, strength)
        assert torch.equal(run_txt2img(clone, seed=12).latent, expected)
        del clone
        gc.collect()


def block_lora_tensors(model) -> dict[str, list[torch.Tensor]]:
    """The LoRA tensors ComfyUI holds for each patched block weight."""
    patches = {k: v for k, v in model.patches.items() if k.startswith("diffusion_model.transformer_blocks.")}
    return {k: [t for patch in v for t in patch[1].weights if isinstance(t, torch.Tensor)] for k, v in patches.items()}


def test_lora_tensors_and_their_workspace_count_in_the_device_footprint(models):
    import comfy.utils

    plain_offloaded = offload(load_plain())
    run_txt2img(plain_offloaded, seed=13)
    groups_only = offload_handle(plain_offloaded).device_bytes_needed()
    lora = with_lora(plain_offloaded, 0.8)
    run_txt2img(lora, seed=13)
    tensors = block_lora_tensors(lora)
    largest = max(comfy.utils.get_attr(lora.model, key).numel() for key in tensors)
    expected = sum(t.nbytes for ts in tensors.values() for t in ts) + 3 * largest * 4  # fp32 temporaries
    assert offload_handle(lora).device_bytes_needed() == groups_only + expected
    other = lora.model_size() - groups_only - expected
    assert lora.loaded_size() == other + offload_handle(lora).device_bytes_needed()


def test_block_patches_move_the_lora_tensors_to_the_device_once(models):
    from testbed.pack_modules import pack_module

    lora_module = pack_module("nodes.lora")
    lora = with_lora(offload(load_plain()), 0.8)
    originals = block_lora_tensors(lora)
    patches = lora_module.BlockPatches(lora.model, lora._block_patches(), torch.device("meta"), torch.float32)
    assert sorted(patches.keys()) == sorted(originals)
    for key, moved in patches._patches.items():
        adapter = moved[0][1]
        assert type(adapter) is type(lora.patches[key][0][1])
        tensors = [t for t in adapter.weights if isinstance(t, torch.Tensor)]
        assert [t.shape for t in tensors] == [t.shape for t in originals[key]]
        assert all(t.device.type == "meta" for t in tensors)
    assert all(t.device.type == "cpu" for ts in block_lora_tensors(lora).values() for t in ts), "the patcher's stay"

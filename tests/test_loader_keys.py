"""The loader reads only the diffusion model's own block lists from the file, under ComfyUI's key names."""
from __future__ import annotations

import pytest
import torch

from comfy_env import run_node
from other_models import CHROMA_SEED, HUNYUAN_VIDEO_SEED, comfy_model_shapes, make_tiny_hunyuan_video
from pack_modules import pack_module

HUNYUAN = "tiny_hunyuan_video.safetensors"
HUNYUAN_ORIGINAL = "tiny_hunyuan_video_original_format.safetensors"
HUNYUAN_PREFIXED = "tiny_hunyuan_video_prefixed.safetensors"
OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


@pytest.fixture(scope="module")
def hunyuan_files(comfy_models):
    folder = comfy_models.models_dir / "diffusion_models"
    make_tiny_hunyuan_video(folder / HUNYUAN)
    make_tiny_hunyuan_video(folder / HUNYUAN_ORIGINAL, original_format=True)
    make_tiny_hunyuan_video(folder / HUNYUAN_PREFIXED, prefix="model.diffusion_model.")
    return comfy_models


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_chroma_guidance_layers_are_not_blocks(comfy, prefix):
    keys = [prefix + key for key in comfy_model_shapes(CHROMA_SEED)]
    found_prefix, blocks = pack_module("nodes.loader").block_keys(keys)
    assert found_prefix == prefix
    assert any(".layers.0." in key for key in keys), "the fixture must have the guidance layers"
    assert blocks == {k for k in keys if k.startswith((prefix + "double_blocks.", prefix + "single_blocks."))}


def test_hunyuan_video_token_refiner_blocks_are_not_blocks(comfy):
    keys = list(comfy_model_shapes(HUNYUAN_VIDEO_SEED))
    _, blocks = pack_module("nodes.loader").block_keys(keys)
    assert any(".individual_token_refiner.blocks.0." in key for key in keys)
    assert blocks == {k for k in keys if k.startswith(("double_blocks.", "single_blocks."))}


@pytest.mark.parametrize("name", [HUNYUAN, HUNYUAN_PREFIXED])
def test_hunyuan_video_loads_exactly_as_load_diffusion_model(hunyuan_files, name):
    expected = run_node("UNETLoader", unet_name=name, weight_dtype="default").outputs[0]
    offloaded = run_node("GroupOffloadLoader", unet_name=name, weight_dtype="default", **OFFLOAD).outputs[0]
    handle = pack_module("offload_core").handle_of(offloaded.model.diffusion_model.double_blocks[0])
    assert len(handle.groups) == 2  # one double block, one single block
    ours, theirs = offloaded.model.diffusion_model.state_dict(), expected.model.diffusion_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_a_file_comfyui_renames_gets_a_clear_message(hunyuan_files):
    run_node("UNETLoader", unet_name=HUNYUAN_ORIGINAL, weight_dtype="default")  # ComfyUI itself loads it
    with pytest.raises(ValueError, match=r"ComfyUI renames the keys of .*original_format.* Load Diffusion Model"):
        run_node("GroupOffloadLoader", unet_name=HUNYUAN_ORIGINAL, weight_dtype="default", **OFFLOAD)

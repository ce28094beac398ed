"""The loader reads only the diffusion model's own block lists from the file, under ComfyUI's key names:
those the block finder finds on the model ComfyUI detects from the file, built on the meta device."""
from __future__ import annotations

import pytest
import torch

from testbed.fixture_models import tiny_qwen_image_file
from testbed.run_nodes import run_node
from testbed.other_models import CHROMA_SEED, HUNYUAN_VIDEO_SEED, comfy_model_shapes, make_tiny_hunyuan_video
from testbed.pack_modules import pack_module
from testbed.quantized_files import cpu_skip_reason, quantized_qwen_file

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


def loader_block_keys(shapes: dict[str, torch.Size], prefix: str = "") -> set[str]:
    """The file keys the loader takes for block keys in a file of these keys and shapes (none read)."""
    loader = pack_module("nodes.loader")
    state_dict = {prefix + key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    blocks, file_keys = loader.block_keys(loader.as_comfyui_loads(state_dict, None, {}), "a file")
    return {file_keys[key] for key in blocks}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_chroma_guidance_layers_are_not_blocks(comfy, prefix):
    shapes = comfy_model_shapes(CHROMA_SEED)
    assert any(".layers.0." in key for key in shapes), "the fixture must have the guidance layers"
    blocks = {prefix + key for key in shapes if key.startswith(("double_blocks.", "single_blocks."))}
    assert loader_block_keys(shapes, prefix) == blocks


def test_hunyuan_video_token_refiner_blocks_are_not_blocks(comfy):
    shapes = comfy_model_shapes(HUNYUAN_VIDEO_SEED)
    assert any(".individual_token_refiner.blocks.0." in key for key in shapes)
    assert loader_block_keys(shapes) == {k for k in shapes if k.startswith(("double_blocks.", "single_blocks."))}


def test_a_file_comfyui_detects_no_model_in_gets_a_clear_message(comfy):
    with pytest.raises(ValueError, match=r"^a file: .*detects no diffusion model.*; use Load Diffusion Model followed"):
        loader_block_keys({"encoder.conv_in.weight": torch.Size([8, 3, 3, 3])})


@pytest.mark.parametrize("dynamic_vram", [False, True], ids=["classic", "dynamic_vram"])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"], ids=["bf16", "float8_e4m3fn"])
def test_the_meta_model_the_blocks_are_found_on_has_every_weight(comfy, monkeypatch, fmt, dynamic_vram):
    """Quantized layers, and every Linear under Dynamic VRAM, get their weights only when ComfyUI loads
    them: the meta model is loaded too, or the block finder would weigh the blocks without them."""
    import comfy.sd
    from safetensors import safe_open
    from safetensors.torch import load_file

    if fmt is not None and cpu_skip_reason(fmt):
        pytest.skip(cpu_skip_reason(fmt))
    path = tiny_qwen_image_file() if fmt is None else quantized_qwen_file(fmt)
    with torch.inference_mode():
        expected = comfy.sd.load_diffusion_model(str(path)).model.diffusion_model.state_dict()
    if dynamic_vram:
        memory_management = pytest.importorskip("comfy.memory_management", reason="this ComfyUI has no Dynamic VRAM")
        monkeypatch.setattr(memory_management, "aimdo_enabled", True)  # as main.py sets it when comfy-aimdo starts
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    loader = pack_module("nodes.loader")
    meta, _ = loader._built_on_meta(loader.as_comfyui_loads(load_file(str(path)), metadata, {}), path.name)
    assert {k: t.shape for k, t in meta.state_dict().items()} == {k: t.shape for k, t in expected.items()}


@pytest.mark.parametrize("name", [HUNYUAN, HUNYUAN_PREFIXED, HUNYUAN_ORIGINAL])
def test_hunyuan_video_loads_exactly_as_load_diffusion_model(hunyuan_files, name):
    expected = run_node("UNETLoader", unet_name=name, weight_dtype="default").outputs[0]
    offloaded = run_node("GroupOffloadLoader", unet_name=name, weight_dtype="default", **OFFLOAD).outputs[0]
    handle = pack_module("offload_core").handle_of(offloaded.model.diffusion_model.double_blocks[0])
    assert len(handle.groups) == 2  # one double block, one single block
    ours, theirs = offloaded.model.diffusion_model.state_dict(), expected.model.diffusion_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_comfyui_detects_the_model_from_the_files_values_of_small_tensors(comfy_models, monkeypatch):
    """ComfyUI reads some values while it detects a model (Z-Image: a block norm's spread decides
    whether fp16 is allowed): the loader hands it the file's vectors, only the matrices wait."""
    import comfy.model_detection
    from safetensors.torch import load_file

    path = tiny_qwen_image_file(num_layers=4)
    norm = "transformer_blocks.1.attn.norm_q.weight"
    seen = []
    detect = comfy.model_detection.model_config_from_unet

    def recording(state_dict, prefix, *args, **kwargs):
        seen.append(state_dict[prefix + norm].to("cpu", copy=True))
        return detect(state_dict, prefix, *args, **kwargs)

    monkeypatch.setattr(comfy.model_detection, "model_config_from_unet", recording)
    link = comfy_models.models_dir / "diffusion_models" / "tiny_qwen_for_detection.safetensors"
    if not link.exists():
        link.symlink_to(path)
    run_node("GroupOffloadLoader", unet_name=link.name, weight_dtype="default", **OFFLOAD)
    assert len(seen) == 2, "once to find the blocks, once as ComfyUI loads"
    assert all(torch.equal(values, load_file(str(path))[norm]) for values in seen)

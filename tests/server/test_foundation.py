"""The test bed itself, on real ComfyUI: in-process sampling, the HTTP API and the full-width model."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from testbed.fixture_models import qwen_rope_axes
from testbed.live_server import PromptFailed, PromptRejected, txt2img_workflow
from testbed.run_nodes import make_test_conditioning, run_node, run_txt2img


def _load(unet_name: str, vae_name: str | None = None):
    (model,) = run_node("UNETLoader", unet_name=unet_name, weight_dtype="default").outputs
    vae = run_node("VAELoader", vae_name=vae_name).outputs[0] if vae_name else None
    return model, vae


def test_rope_axes_keep_the_real_proportions():
    assert qwen_rope_axes(128) == (16, 56, 56)
    assert qwen_rope_axes(32) == (4, 14, 14)
    with pytest.raises(ValueError, match="multiple of 32"):
        qwen_rope_axes(48)


def test_test_conditioning_is_seeded_and_qwen_shaped(comfy):
    (conditioning,) = run_node("GroupOffloadTestConditioning", seed=5, tokens=7, joint_dim=64).outputs
    [[cond, extra]] = conditioning
    assert cond.shape == (1, 7, 64)
    assert extra == {"pooled_output": None}
    assert torch.equal(cond, make_test_conditioning(5, 7, 64)[0][0])


def test_tiny_qwen_image_samples_in_process_deterministically(comfy, comfy_models):
    model, vae = _load(comfy_models.unet_name, comfy_models.vae_name)
    diffusion_model = model.model.diffusion_model
    # The widened detection built the narrow model the file holds.
    assert diffusion_model.inner_dim == 64
    assert len(diffusion_model.transformer_blocks) == 2
    assert diffusion_model.txt_in.in_features == 64

    first = run_txt2img(model, vae, seed=7, steps=2, cfg=4.0)
    second = run_txt2img(model, vae, seed=7, steps=2, cfg=4.0)
    other_seed = run_txt2img(model, vae, seed=8, steps=2, cfg=4.0)

    assert first.image.shape == (1, 64, 64, 3)
    assert first.latent.shape[1] == 16 and first.latent.shape[-2:] == (8, 8)
    assert torch.isfinite(first.image).all() and torch.isfinite(first.latent).all()
    assert first.image.std() > 0
    assert torch.equal(first.latent, second.latent)
    assert torch.equal(first.image, second.image)
    assert not torch.equal(first.latent, other_seed.latent)


def test_http_prompt_saves_an_image(comfy_server):
    entry = comfy_server.run(txt2img_workflow(comfy_server.models.unet_name, filename_prefix="foundation_http"))

    [image_path] = comfy_server.output_images(entry)
    assert image_path.parent == comfy_server.output_dir
    assert image_path.name.startswith("foundation_http")
    with Image.open(image_path) as image:
        assert image.format == "PNG" and image.size == (64, 64)


def test_invalid_prompt_gets_comfyui_error_and_server_keeps_working(comfy_server):
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(txt2img_workflow("missing.safetensors"))

    body = rejected.value.body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    [error] = body["node_errors"]["1"]["errors"]
    assert error["type"] == "value_not_in_list"
    assert "missing.safetensors" in error["details"]

    entry = comfy_server.run(txt2img_workflow(comfy_server.models.unet_name, seed=1, filename_prefix="after_bad"))
    assert comfy_server.output_images(entry)


def test_failing_prompt_is_reported_and_server_keeps_working(comfy_server):
    # Valid graph, but text 32 wide for a model that takes 64: fails while sampling.
    with pytest.raises(PromptFailed) as failed:
        comfy_server.run(txt2img_workflow(comfy_server.models.unet_name, joint_dim=32, filename_prefix="never"))

    [[kind, details]] = [m for m in failed.value.entry["status"]["messages"] if m[0] == "execution_error"]
    assert details["node_type"] == "KSampler"

    entry = comfy_server.run(txt2img_workflow(comfy_server.models.unet_name, seed=2, filename_prefix="after_fail"))
    assert comfy_server.output_images(entry)


@pytest.mark.slow
def test_full_width_single_block_loads_unpatched_and_samples(comfy, full_width_qwen_path, full_width_qwen_name):
    import comfy.model_detection as model_detection
    import comfy.utils as comfy_utils

    state_dict = comfy_utils.load_torch_file(str(full_width_qwen_path))
    detect = model_detection.detect_unet_config
    assert detect(state_dict, "") == detect.group_offload_original(state_dict, "")  # the widening stays out
    del state_dict

    model, _ = _load(full_width_qwen_name)
    diffusion_model = model.model.diffusion_model
    assert diffusion_model.inner_dim == 3072
    assert diffusion_model.txt_in.in_features == 3584
    assert len(diffusion_model.transformer_blocks) == 1

    result = run_txt2img(model, None, seed=0, steps=1, width=64, height=64)
    assert torch.isfinite(result.latent).all()
    assert result.latent.std() > 0

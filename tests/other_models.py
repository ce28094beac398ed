"""Diffusion models other than Qwen-Image, as ComfyUI builds them: their key names, and tiny files.

ComfyUI's own detection picks the model class and config from a few seed tensors (only their
shapes are read); the model is then built on the meta device, so every key and shape is ComfyUI's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from comfy_env import _fill, _save, prepare_comfy_import

META = torch.device("meta")


def _seed(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {key: torch.empty(shape, device=META) for key, shape in shapes.items()}


# What detection reads for a HunyuanVideo of width 128 (one head of 128: RoPE axes 16+56+56), one block of each kind.
HUNYUAN_VIDEO_SEED = {
    "img_in.proj.weight": (128, 16, 1, 2, 2),
    "final_layer.linear.weight": (16 * 4, 128),
    "txt_in.input_embedder.weight": (128, 32),
    "txt_in.individual_token_refiner.blocks.0.norm1.weight": (128,),
    "vector_in.in_layer.weight": (128, 768),
    "guidance_in.in_layer.weight": (128, 256),
    "double_blocks.0.img_attn.norm.key_norm.scale": (128,),
    "single_blocks.0.linear1.weight": (128 * 3 + 512, 128),
}
# Chroma keeps its widths fixed (3072 wide, a 5-layer 5120-wide guidance network), so it is only ever built on meta.
CHROMA_SEED = {
    "img_in.weight": (3072, 64),
    "txt_in.weight": (3072, 4096),
    "distilled_guidance_layer.norms.0.scale": (5120,),
    "double_blocks.0.img_attn.norm.key_norm.scale": (128,),
    "single_blocks.0.linear1.weight": (3072 * 7, 3072),
}


def comfy_model_shapes(seed: dict[str, tuple[int, ...]]) -> dict[str, torch.Size]:
    """Key names and shapes of the diffusion model ComfyUI detects from ``seed``."""
    prepare_comfy_import()
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet(_seed(seed), "")
    if config is None:
        raise ValueError(f"ComfyUI detects no model from the seed keys {sorted(seed)}")
    model = config.get_model({}, "", device=META)
    return {key: value.shape for key, value in model.diffusion_model.state_dict().items()}


def make_tiny_hunyuan_video(path: Path, original_format: bool = False, prefix: str = "") -> Path:
    """A 1+1-block HunyuanVideo in ComfyUI's key format, or with some keys in the original release's
    format (``img_attn_qkv``, ``img_mod.linear``), which ComfyUI renames when it loads the file.
    ``prefix`` goes before every key (``model.diffusion_model.`` as in a checkpoint)."""
    tensors = _fill(comfy_model_shapes(HUNYUAN_VIDEO_SEED), seed=0, dtype=torch.bfloat16)
    if original_format:
        tensors = {key.replace("img_attn.qkv.", "img_attn_qkv.").replace("img_mod.lin.", "img_mod.linear."): value
                   for key, value in tensors.items()}
    return _save({prefix + key: value for key, value in tensors.items()}, path)

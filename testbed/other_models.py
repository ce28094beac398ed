"""Diffusion models other than Qwen-Image, as ComfyUI builds them: their key names, and tiny files.

ComfyUI's own detection picks the model class and config from a few seed tensors (only their
shapes are read); the model is then built on the meta device, so every key and shape is ComfyUI's.
:func:`save_with_detection` writes a tiny model's own state dict and makes ComfyUI detect its config.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

from testbed.comfy_boot import prepare_comfy_import
from testbed.fixture_models import fill_seeded, save_safetensors

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
    tensors = fill_seeded(comfy_model_shapes(HUNYUAN_VIDEO_SEED), seed=0, dtype=torch.bfloat16)
    if original_format:
        tensors = {key.replace("img_attn.qkv.", "img_attn_qkv.").replace("img_mod.lin.", "img_mod.linear."): value
                   for key, value in tensors.items()}
    return save_safetensors({prefix + key: value for key, value in tensors.items()}, path)


# A tiny file's keys and shapes (after the prefix) -> the config class ComfyUI detects for it, and its unet_config.
_SAVED_CONFIGS: dict[frozenset[tuple[str, tuple[int, ...]]], tuple[str, dict]] = {}


def _layout(state_dict: dict[str, torch.Tensor], prefix: str) -> frozenset[tuple[str, tuple[int, ...]]]:
    return frozenset((key[len(prefix):], tuple(t.shape)) for key, t in state_dict.items() if key.startswith(prefix))


class _SavedConfig(dict):
    """The ``unet_config`` of a file written by :func:`save_with_detection`, with its config class."""

    def __init__(self, config_class: str, unet_config: dict) -> None:
        super().__init__(copy.deepcopy(unet_config))
        self.config_class = config_class


def _detect_saved_configs() -> None:
    """TEST ONLY: wrap ``comfy.model_detection.detect_unet_config`` and ``model_config_from_unet_config``
    so that a file written by :func:`save_with_detection` is detected as that file's config; the rest of
    ComfyUI's detection (quantized layers, scaled fp8) runs as it is, and any other state dict is detected
    as before. Idempotent; nothing shipped may call it."""
    prepare_comfy_import()
    import comfy.model_detection as model_detection
    import comfy.supported_models

    detect, config_of = model_detection.detect_unet_config, model_detection.model_config_from_unet_config
    if getattr(config_of, "group_offload_saved_configs", False):
        return

    @functools.wraps(detect)
    def detect_unet_config(state_dict, key_prefix, *args, **kwargs):
        saved = _SAVED_CONFIGS.get(_layout(state_dict, key_prefix))
        return detect(state_dict, key_prefix, *args, **kwargs) if saved is None else _SavedConfig(*saved)

    @functools.wraps(config_of)
    def model_config_from_unet_config(unet_config, *args, **kwargs):
        if isinstance(unet_config, _SavedConfig):
            return getattr(comfy.supported_models, unet_config.config_class)(dict(unet_config))
        return config_of(unet_config, *args, **kwargs)

    model_config_from_unet_config.group_offload_saved_configs = True
    model_detection.detect_unet_config = detect_unet_config
    model_detection.model_config_from_unet_config = model_config_from_unet_config


def save_with_detection(state_dict: dict[str, torch.Tensor], config_class: str, unet_config: dict, path: Path) -> Path:
    """Write a tiny diffusion model's own ``state_dict`` (ComfyUI's keys, no prefix) to ``path``, and make
    ComfyUI detect it as ``comfy.supported_models.<config_class>(unet_config)``, for every loader alike.

    ComfyUI reads a few sizes from the weights and takes the rest from the real models (heads of 128,
    fixed RoPE axes, ...), which a tiny model does not have.
    """
    _detect_saved_configs()
    _SAVED_CONFIGS[_layout(state_dict, "")] = config_class, copy.deepcopy(unet_config)
    return save_safetensors({key: tensor.detach().clone() for key, tensor in state_dict.items()}, path)

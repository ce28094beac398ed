"""Fixture models: tiny safetensors files ComfyUI's own loaders accept, generated once per parameter set
into ``.cache/fixtures``, and ComfyUI model folders that hold them.

The files are seeded and built from ComfyUI's own modules on the meta device (key names and shapes as
ComfyUI writes them): a narrow Qwen-Image, the real-width one-block Qwen-Image (761 MB) and a narrow
Wan 2.1 VAE. The one test-only change to ComfyUI is to its detection, here
(:func:`widen_qwen_detection`, so that it loads Qwen-Image models narrower than the real one), and
``other_models.save_with_detection`` for tiny files of other models. Nothing of ComfyUI or torch is
stubbed. Importing it does not import ComfyUI; the generators do.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from testbed.comfy_boot import REPO_ROOT, boot_comfyui_in_process, prepare_comfy_import

logger = logging.getLogger(__name__)

FIXTURE_CACHE = REPO_ROOT / ".cache" / "fixtures"

TINY_QWEN_NAME = "tiny_qwen_image.safetensors"
FULL_WIDTH_QWEN_NAME = "full_width_qwen_image.safetensors"
TINY_VAE_NAME = "tiny_wan_vae.safetensors"

# Bump when the generators change what they write, so cached fixture files are regenerated.
_FIXTURE_FORMAT = 1

# Qwen-Image as ComfyUI builds it by default (comfy/ldm/qwen_image/model.py) and as the real model is.
FULL_WIDTH_QWEN = {
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "out_channels": 16,
    "axes_dims_rope": (16, 56, 56),
}
_FULL_WIDTH_QWEN_WEIGHTS = {k: v for k, v in FULL_WIDTH_QWEN.items() if k != "axes_dims_rope"}
_QWEN_PATCH_SIZE = 2  # process_img() hard-codes 2x2 patches; in_channels = 16 latent channels * 2 * 2
_QWEN_IN_CHANNELS = 64


# --------------------------------------------------------------------------------------------
# Test-only widening of Qwen-Image detection
# --------------------------------------------------------------------------------------------

def qwen_rope_axes(attention_head_dim: int) -> tuple[int, int, int]:
    """RoPE axes for a Qwen-Image of this head width, in the real model's proportions (16, 56, 56)/128.

    ComfyUI needs three even axes summing to the head width, so the width must be a multiple of 32.
    """
    if attention_head_dim % 32:
        raise ValueError(f"attention_head_dim must be a multiple of 32, got {attention_head_dim}")
    small = attention_head_dim // 8
    large = (attention_head_dim - small) // 2
    return small, large, large


def _qwen_widths(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    """The Qwen-Image constructor arguments that the weights determine (RoPE axes excepted)."""
    inner_dim = state_dict[f"{prefix}img_in.weight"].shape[0]
    head_dim = state_dict[f"{prefix}transformer_blocks.0.attn.norm_q.weight"].shape[0]
    return {
        "attention_head_dim": head_dim,
        "num_attention_heads": inner_dim // head_dim,
        "joint_attention_dim": state_dict[f"{prefix}txt_in.weight"].shape[1],
        "out_channels": state_dict[f"{prefix}proj_out.weight"].shape[0] // _QWEN_PATCH_SIZE ** 2,
    }


def widen_qwen_detection() -> None:
    """TEST ONLY: let ComfyUI load Qwen-Image models narrower than the real one.

    ComfyUI recognises Qwen-Image by ``txt_norm.weight`` and reads only ``in_channels`` and
    ``num_layers`` from the weights; every width is the constructor default. This wraps
    ``comfy.model_detection.detect_unet_config`` so that, for a Qwen-Image whose widths differ from
    the real ones, the widths are read from the weights. Full-width models get exactly the config
    ComfyUI would have produced. Idempotent; nothing shipped may call it.
    """
    prepare_comfy_import()
    import comfy.model_detection as model_detection

    original = model_detection.detect_unet_config
    if getattr(original, "group_offload_original", None) is not None:
        return

    @functools.wraps(original)
    def detect_unet_config(state_dict, key_prefix, *args, **kwargs):
        config = original(state_dict, key_prefix, *args, **kwargs)
        if config is None or config.get("image_model") != "qwen_image":
            return config
        widths = _qwen_widths(state_dict, key_prefix)
        if widths == _FULL_WIDTH_QWEN_WEIGHTS:
            return config
        return {**config, **widths, "axes_dims_rope": qwen_rope_axes(widths["attention_head_dim"])}

    detect_unet_config.group_offload_original = original
    model_detection.detect_unet_config = detect_unet_config


# --------------------------------------------------------------------------------------------
# Fixture models
# --------------------------------------------------------------------------------------------

def fill_seeded(shapes: dict[str, torch.Size], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded values for every tensor; ComfyUI's ops skip init, so nothing may be left unset.

    Weights are N(0, 1/fan_in) so activations stay O(1) at any width; norm scales are 1 + N(0, 0.02²);
    biases N(0, 0.02²). Keys are filled in sorted order from one generator.
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key in sorted(shapes):
        shape = shapes[key]
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if key.endswith("bias"):
            value = noise.mul_(0.02)
        elif key.endswith("gamma") or len(shape) == 1:
            value = noise.mul_(0.02).add_(1.0)
        else:
            fan_in = shape[1:].numel()
            value = noise.mul_(fan_in ** -0.5)
        tensors[key] = value.to(dtype).contiguous()
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    """Write ``tensors`` to ``path`` whole or not at all (a partial file renamed into place)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial))
    os.replace(partial, path)
    return path


def _qwen_shapes(num_layers: int, **dims: Any) -> dict[str, torch.Size]:
    """Key names and shapes of ComfyUI's own QwenImageTransformer2DModel, built on the meta device."""
    prepare_comfy_import()
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(num_layers=num_layers, in_channels=_QWEN_IN_CHANNELS,
                                        patch_size=_QWEN_PATCH_SIZE, device="meta",
                                        operations=comfy.ops.disable_weight_init, **dims)
    return {key: value.shape for key, value in model.state_dict().items()}


def make_tiny_qwen_image(path: Path, num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         *, num_attention_heads: int = 2, attention_head_dim: int = 32,
                         joint_attention_dim: int = 64) -> Path:
    """Write a narrow Qwen-Image diffusion model (ComfyUI key names, no prefix) to ``path``.

    Loading it needs :func:`widen_qwen_detection`. The defaults make a 0.7 MB file (bf16, 2 layers).
    """
    dims = {"num_attention_heads": num_attention_heads, "attention_head_dim": attention_head_dim,
            "joint_attention_dim": joint_attention_dim, "axes_dims_rope": qwen_rope_axes(attention_head_dim)}
    return save_safetensors(fill_seeded(_qwen_shapes(num_layers, **dims), seed, dtype), path)


def make_full_width_qwen_image(path: Path, num_layers: int = 1, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a Qwen-Image with the real widths and ``num_layers`` blocks (761 MB for one block in bf16).

    It loads in unpatched ComfyUI. Tensors are generated one at a time in float32 and kept in ``dtype``.
    """
    return save_safetensors(fill_seeded(_qwen_shapes(num_layers), seed, dtype), path)


def make_tiny_wan_vae(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, dim: int = 8) -> Path:
    """Write a narrow Wan 2.1 VAE (16 latent channels, as Qwen-Image uses) that VAELoader detects.

    ComfyUI recognises it by ``decoder.middle.0.residual.0.gamma`` and reads ``dim`` from
    ``decoder.head.0.gamma``; the rest of its config is fixed, so only ``dim`` may vary.
    """
    prepare_comfy_import()
    from comfy.ldm.wan.vae import WanVAE

    with torch.device("meta"):
        vae = WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                     temperal_downsample=[False, True, True])
    shapes = {key: value.shape for key, value in vae.state_dict().items()}
    return save_safetensors(fill_seeded(shapes, seed, dtype), path)


def cached_fixture(stem: str, generator: Callable[..., Path], **params: Any) -> Path:
    """Generate a fixture once per parameter set into ``.cache/fixtures`` and reuse it afterwards."""
    key_source = json.dumps({"generator": generator.__name__, "format": _FIXTURE_FORMAT,
                             **{k: str(v) for k, v in params.items()}}, sort_keys=True)
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    path = FIXTURE_CACHE / f"{stem}-{key}.safetensors"
    if not path.exists():
        started = time.monotonic()
        generator(path, **params)
        logger.info("generated %s in %.1f s", path, time.monotonic() - started)
    return path


def tiny_qwen_image_file(num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         **dims: int) -> Path:
    """Cached :func:`make_tiny_qwen_image`."""
    return cached_fixture("tiny_qwen_image", make_tiny_qwen_image, num_layers=num_layers, seed=seed, dtype=dtype, **dims)


def full_width_qwen_image_file(num_layers: int = 1, seed: int = 0) -> Path:
    """Cached :func:`make_full_width_qwen_image`."""
    return cached_fixture("full_width_qwen_image", make_full_width_qwen_image, num_layers=num_layers, seed=seed)


def tiny_wan_vae_file(seed: int = 0) -> Path:
    """Cached :func:`make_tiny_wan_vae`."""
    return cached_fixture("tiny_wan_vae", make_tiny_wan_vae, seed=seed)


@dataclass(frozen=True)
class ModelDir:
    """A ComfyUI base directory with fixture models; the names are what the loader nodes take."""

    base_dir: Path
    unet_name: str = TINY_QWEN_NAME
    vae_name: str = TINY_VAE_NAME
    full_width_unet_name: str | None = None

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"


def link_or_copy(source: Path, target: Path) -> None:
    """Point ``target`` at ``source`` by a symlink, replacing what is there; a copy where links fail."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    try:
        target.symlink_to(source)
    except OSError:
        shutil.copyfile(source, target)


def link_or_copy_dir(source: Path, target: Path) -> None:
    """Link the folder ``source`` at ``target`` unless something is there; a copy where links fail."""
    if target.is_symlink() or target.exists():
        return
    try:
        target.symlink_to(source, target_is_directory=True)
    except OSError:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".*", "__pycache__"))


def populate_models(base_dir: Path, *, full_width: bool = False) -> ModelDir:
    """Lay out fixture models in ``base_dir/models`` as ComfyUI expects (files linked from the cache).

    ``models/loras`` is created empty. ``full_width`` adds the 761 MB single-block Qwen-Image.
    """
    base_dir = Path(base_dir)
    models = base_dir / "models"
    link_or_copy(tiny_qwen_image_file(), models / "diffusion_models" / TINY_QWEN_NAME)
    link_or_copy(tiny_wan_vae_file(), models / "vae" / TINY_VAE_NAME)
    (models / "loras").mkdir(parents=True, exist_ok=True)
    full_width_name = None
    if full_width:
        full_width_name = FULL_WIDTH_QWEN_NAME
        link_or_copy(full_width_qwen_image_file(), models / "diffusion_models" / full_width_name)
    return ModelDir(base_dir=base_dir, full_width_unet_name=full_width_name)


def use_models_in_process(model_dir: ModelDir) -> None:
    """Make the in-process ComfyUI's loader nodes find the models of ``model_dir``."""
    boot_comfyui_in_process()
    import folder_paths

    for kind in ("diffusion_models", "vae", "loras"):
        folder = model_dir.models_dir / kind
        if str(folder) not in folder_paths.get_folder_paths(kind):
            folder_paths.add_model_folder_path(kind, str(folder), is_default=True)

"""Stand-ins for the files the example workflows expect, under the same names, and the widths of their text
conditioning. A server writes them into its own folders through the ``stand_in_models`` test pack.

The diffusion models are tiny. Flux's VAE is not: ComfyUI reads only its latent channels from the weights and
builds the rest at full width, so its stand-in is a full-size 16-channel VAE with seeded weights (167 MB in
bf16, generated once into ``.cache/fixtures``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from testbed.comfy_boot import prepare_comfy_import
from testbed.fixture_models import (
    cached_fixture,
    fill_seeded,
    link_or_copy,
    save_safetensors,
    tiny_qwen_image_file,
    tiny_wan_vae_file,
)
from testbed import gguf_files
from testbed.lora_fixture import make_lora
from testbed.dit_families import FLUX, LATENT_CHANNELS, WAN_T2V, save_tiny_file

ENV = "GROUP_OFFLOAD_STAND_INS"  # JSON {"<folder>/<file name>": "<kind>"}; the folder: a model folder or "input"
# The text width of each kind of diffusion model: the conditioning that stands in for its text encoder has it.
TEXT_WIDTHS = {"qwen_image": 64, "qwen_image_gguf": 64, "flux": FLUX.unet_config["context_in_dim"],
               "wan_t2v": WAN_T2V.unet_config["text_dim"]}


# ComfyUI's default image VAE (comfy/sd.py), as Flux's ae.safetensors is: 16 latent channels, no quant convs.
FLUX_VAE_CONFIG = {"double_z": True, "z_channels": LATENT_CHANNELS, "resolution": 256, "in_channels": 3, "out_ch": 3,
                   "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def make_flux_vae(path: Path, seed: int = 0) -> Path:
    prepare_comfy_import()
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    with torch.device("meta"):
        parts = {"encoder": Encoder(**FLUX_VAE_CONFIG), "decoder": Decoder(**FLUX_VAE_CONFIG)}
    shapes = {f"{prefix}.{key}": value.shape for prefix, part in parts.items() for key, value in part.state_dict().items()}
    return save_safetensors(fill_seeded(shapes, seed, torch.bfloat16), path)


def _image(path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.radial_gradient("L").resize((64, 64)).convert("RGB").save(path)


WRITERS = {
    "qwen_image": lambda path: link_or_copy(tiny_qwen_image_file(), path),
    "qwen_image_lora": lambda path: make_lora(tiny_qwen_image_file(), path),
    "qwen_image_gguf": lambda path: gguf_files.write_tiny_gguf(path, policy=gguf_files.QType.Q4_K),
    "flux": lambda path: save_tiny_file(FLUX, path),
    "wan_t2v": lambda path: save_tiny_file(WAN_T2V, path),
    "wan_vae": lambda path: link_or_copy(tiny_wan_vae_file(), path),
    "flux_vae": lambda path: link_or_copy(cached_fixture("flux_vae", make_flux_vae), path),
    "image": _image,
}


def write(files: dict[str, str]) -> None:
    """Write each stand-in into the running ComfyUI's folder; Flux and Wan are then detected in this process."""
    import folder_paths

    for relative, kind in files.items():
        folder, _, name = relative.partition("/")
        directory = folder_paths.get_input_directory() if folder == "input" else folder_paths.get_folder_paths(folder)[0]
        WRITERS[kind](Path(directory) / name)

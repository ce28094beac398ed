"""ComfyUI-GGUF's tiny models through the nodes: a GGUF file of every type per model and a LoRA (the ``gguf_models``
fixture), loaded, offloaded and sampled, and the latents without the node."""
from __future__ import annotations

import pytest
import torch

from testbed import gguf_files
from testbed.comfy_boot import boot_comfyui_in_process
from testbed.fixture_models import tiny_qwen_image_file
from testbed.lora_fixture import make_lora
from testbed.pack_modules import pack_module
from testbed.run_nodes import make_test_conditioning, node_output
from testbed.stand_ins import TEXT_WIDTHS

MODELS = ["qwen_image", "flux", "wan"]
LORA = "tiny_qwen_gguf_lora.safetensors"
STREAM_ALL = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


def file_name(model: str) -> str:
    return f"tiny_{model}_every_gguf_type.gguf"


@pytest.fixture(scope="module")
def gguf_models(comfy_models):
    """ComfyUI-GGUF loaded; each tiny model as a GGUF file of every type, and a LoRA for the Qwen-Image one."""
    gguf_files.load_comfyui_gguf(boot_comfyui_in_process())
    folder = comfy_models.models_dir / "diffusion_models"
    for model in MODELS:
        gguf_files.write_tiny_gguf(folder / file_name(model), model, gguf_files.mixed_policy(gguf_files.COMFYUI_GGUF_TYPES))
    make_lora(tiny_qwen_image_file(num_layers=4), comfy_models.models_dir / "loras" / LORA)
    return folder


def load_gguf(model: str, **advanced):
    if advanced:
        return node_output("UnetLoaderGGUFAdvanced", unet_name=file_name(model), **advanced)
    return node_output("UnetLoaderGGUF", unet_name=file_name(model))


def offload(model, **options):
    return node_output("GroupOffload", model=model, **(STREAM_ALL | options))


def offload_handle(model):
    """The handle streaming ``model``'s blocks, whichever kind of model it is."""
    blocks = pack_module("nodes.blocks").find_blocks(model.model.diffusion_model)
    return pack_module("offload_core").handle_of(blocks[0])


def with_lora(model, strength: float = 0.8):
    return node_output("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=strength)


def sample(model, kind: str, seed: int = 3) -> torch.Tensor:
    """KSampler's latent, 2 steps at 64 px (one frame for Wan), with seeded conditionings of the model's text width."""
    latent = (node_output("EmptyHunyuanLatentVideo", width=64, height=64, length=1, batch_size=1) if kind == "wan"
              else node_output("EmptySD3LatentImage", width=64, height=64, batch_size=1))
    width = TEXT_WIDTHS["wan_t2v" if kind == "wan" else kind]
    samples = node_output("KSampler", model=model, seed=seed, steps=2, cfg=4.0, sampler_name="euler", scheduler="simple",
                   positive=make_test_conditioning(1, joint_dim=width), negative=make_test_conditioning(2, joint_dim=width),
                   latent_image=latent, denoise=1.0)
    return samples["samples"]


_EXPECTED: dict[tuple, torch.Tensor] = {}


def expected(kind: str, lora: float | None = None, **advanced) -> torch.Tensor:
    """The latent of the GGUF model without the node (with the LoRA at ``lora``), computed once."""
    key = (kind, lora, tuple(sorted(advanced.items())))
    if key not in _EXPECTED:
        plain = load_gguf(kind, **advanced)
        _EXPECTED[key] = sample(plain if lora is None else with_lora(plain, lora), kind)
    return _EXPECTED[key]


# A device this machine can tell from the host: ComfyUI and ComfyUI-GGUF run on it as on any device, and a tensor
# moved there is a new tensor (over the same memory), so a LoRA tensor still the host's at a forward is one that a
# GPU would copy to the device at that forward.
DEVICE_APART = torch.device("cpu", 0)

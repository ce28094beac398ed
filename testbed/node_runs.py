"""The pack's nodes run in-process on the tiny models: the four-block Qwen-Image and its LoRA (the ``models``
fixture), loaded plain or offloaded, and the handle that streams them; the tiny text encoders (``te_names``); the
``device`` fixture for CPU/CUDA twins."""
from __future__ import annotations

import pytest
import torch

from testbed import fixture_models, text_encoders
from testbed.lora_fixture import make_lora
from testbed.pack_modules import pack_module
from testbed.run_nodes import run_node

FOUR_BLOCKS = "tiny_qwen_image_4_blocks.safetensors"
LORA = "tiny_qwen_lora.safetensors"
OFFLOAD_DEFAULTS = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


@pytest.fixture(scope="module")
def models(comfy_models):
    """A four-block tiny Qwen-Image (so groups, prefetch and residency have room) and a LoRA for it."""
    source = fixture_models.tiny_qwen_image_file(num_layers=4)
    target = comfy_models.models_dir / "diffusion_models" / FOUR_BLOCKS
    if not target.exists():
        target.symlink_to(source)
    make_lora(source, comfy_models.models_dir / "loras" / LORA)
    return comfy_models


@pytest.fixture(scope="module")
def te_names(comfy_models) -> dict[str, str]:
    """The tiny text encoders (``testbed.text_encoders``) in the models' ``text_encoders`` folder: each file's name."""
    return text_encoders.use_text_encoders_in_process(comfy_models.models_dir)


def load_plain(weight_dtype: str = "default"):
    return run_node("UNETLoader", unet_name=FOUR_BLOCKS, weight_dtype=weight_dtype).outputs[0]


def offload(model, **options):
    return run_node("GroupOffload", model=model, **(OFFLOAD_DEFAULTS | options)).outputs[0]


def load_offloaded(weight_dtype: str = "default", **options):
    return run_node("GroupOffloadLoader", unet_name=FOUR_BLOCKS, weight_dtype=weight_dtype,
                    **(OFFLOAD_DEFAULTS | options)).outputs[0]


def with_lora(model, strength: float):
    return run_node("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=strength).outputs[0]


def raw_block_bytes(model) -> int:
    blocks = model.model.diffusion_model.transformer_blocks
    return sum(t.numel() * t.element_size() for t in (*blocks.parameters(), *blocks.buffers()))


def offload_handle(model):
    return pack_module("offload_core").handle_of(model.model.diffusion_model.transformer_blocks[0])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def device(request: pytest.FixtureRequest, comfy) -> torch.device:
    """ComfyUI's device, when it is the parametrized one; on the CPU, ComfyUI pins through the stand-in."""
    import comfy.model_management as mm

    running = mm.get_torch_device()
    if running.type != request.param:
        pytest.skip(f"ComfyUI runs on the {running.type} here")
    if running.type == "cpu":
        request.getfixturevalue("fake_cudart")
    return running



"""The quantized tiny Qwen-Image files (see quantized_files) load and sample in plain ComfyUI, with a LoRA.

Parametrized over ``QUANT_FORMATS``; a format the running ComfyUI cannot sample on the CPU is skipped
with the reason recorded in ``quantized_files.NOT_ON_CPU``.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from testbed.fixture_models import ModelDir
from testbed.run_nodes import run_node, run_txt2img
from testbed.lora_fixture import make_lora
from testbed.quantized_files import QUANT_FORMATS, cpu_skip_reason, quantized_qwen_file, source_qwen_file

LORA = "tiny_qwen_quantized_lora.safetensors"
# Largest relative error (Frobenius) of a dequantized block weight against the bf16 original; the
# 4-bit layouts reach about 0.13, a weight loaded without its scale is off by a factor of hundreds.
MAX_WEIGHT_ERROR = 0.2


FORMATS = [pytest.param(name, id=name, marks=[pytest.mark.skip(reason=reason)] if reason else [])
           for name, reason in ((name, cpu_skip_reason(name)) for name in QUANT_FORMATS)]


@pytest.fixture(scope="module")
def models(comfy_models: ModelDir) -> ModelDir:
    """The fixture models plus a LoRA made from the bf16 file the quantized ones come from."""
    make_lora(source_qwen_file(), comfy_models.models_dir / "loras" / LORA)
    return comfy_models


def load(models: ModelDir, name: str):
    """UNETLoader on the file quantized as ``name``, inside inference mode as in a real prompt."""
    target = models.models_dir / "diffusion_models" / f"tiny_qwen_image_{name}.safetensors"
    if not target.exists():
        target.symlink_to(quantized_qwen_file(name))
    with torch.inference_mode():
        return run_node("UNETLoader", unet_name=target.name, weight_dtype="default").outputs[0]


def with_lora(model, strength: float = 0.8):
    with torch.inference_mode():
        return run_node("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=strength).outputs[0]


def computed_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight ComfyUI computes with: dequantized, or scaled by ``scale_weight`` (0.3.75 scaled fp8)."""
    with torch.inference_mode():
        weight = module.convert_weight(module.weight) if hasattr(module, "convert_weight") else module.weight
        return weight.float()


def quantized_kind(module: torch.nn.Module) -> str | None:
    """How ComfyUI holds a block weight: its QuantizedTensor layout, ``"scale_weight"`` (0.3.75's scaled
    fp8 ops: an fp8 Parameter and a scale beside it), or ``None`` (plain)."""
    layout = getattr(module.weight, "_layout_cls", None) or getattr(module.weight, "_layout_type", None)
    if layout is None and getattr(module, "scale_weight", None) is not None:
        return "scale_weight"
    return layout


@pytest.mark.parametrize("name", FORMATS)
def test_loads_quantized_and_samples_bit_identically(models, name):
    from comfy.quant_ops import QUANT_ALGOS

    fmt = QUANT_FORMATS[name]
    kinds = {QUANT_ALGOS[fmt.quant_format]["comfy_tensor_layout"]}
    if fmt.container == "scaled_fp8":
        kinds.add("scale_weight")
    model = load(models, name)
    for key, original in load_file(str(source_qwen_file())).items():
        if not key.startswith("transformer_blocks.") or original.ndim != 2:
            continue
        module = model.model.diffusion_model.get_submodule(key.removesuffix(".weight"))
        assert quantized_kind(module) in (kinds if fmt.quantizes(key, original.shape) else {None}), key
        error = (computed_weight(module) - original.float()).norm() / original.float().norm()
        assert error < MAX_WEIGHT_ERROR, f"{key}: relative error {error:.3g} against the bf16 weight"

    first = run_txt2img(model, seed=3).latent
    assert torch.isfinite(first).all()
    assert torch.equal(run_txt2img(model, seed=3).latent, first)


@pytest.mark.parametrize("name", FORMATS)
def test_lora_applies_and_leaves_the_model_pristine(models, name):
    model = load(models, name)
    lora_model = with_lora(model)
    plain = run_txt2img(model, seed=4).latent
    patched = run_txt2img(lora_model, seed=4).latent
    assert torch.isfinite(patched).all()
    assert not torch.equal(patched, plain), "the LoRA must change the result"
    assert torch.equal(run_txt2img(lora_model, seed=4).latent, patched)
    assert torch.equal(run_txt2img(model, seed=4).latent, plain), "unpatching must restore the weights"

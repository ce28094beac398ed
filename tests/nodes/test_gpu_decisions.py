"""The pack under the decisions ComfyUI takes on a user's card (gpu_decisions), on the CPU: model dtype and
manual cast, LoRA compute dtype, casts and non-blocking copies as on an Ampere card (fp16 and bf16) and a
Turing card (fp16 only). Through KSampler the latent is bit-identical to the same model without the node
under the same decisions: the node and the loader at each residency, fp8 weights, a LoRA with bias diffs
before and after the node, for safetensors models and for a GGUF model against ComfyUI-GGUF alone.

Run the whole suite as a card decides with ``GROUP_OFFLOAD_CARD=ampere-24g python3 dev.py test``.
"""
from __future__ import annotations

import os

import pytest
import torch

from testbed import gguf_files
from testbed import gpu_decisions
from testbed.comfy_boot import boot_comfyui_in_process
from testbed.fixture_models import tiny_qwen_image_file
from testbed.lora_fixture import make_lora
from testbed.run_nodes import run_node, run_txt2img
from testbed.node_runs import load_offloaded, load_plain, offload

BIAS_LORA = "tiny_qwen_lora_with_bias_diffs.safetensors"
GGUF_Q8 = "tiny_qwen_image_q8_0.gguf"
SETTINGS = {
    "stream_all": {"residency": "stream_all"},
    "synchronous": {"residency": "stream_all", "prefetch": 0},
    "one_resident": {"residency": "budget", "resident_gb": 0.0003},
    "auto": {"residency": "auto"},
}


@pytest.fixture(params=list(gpu_decisions.CARDS))
def card(request: pytest.FixtureRequest, comfy, monkeypatch: pytest.MonkeyPatch,
         decisions_of_the_card: gpu_decisions.Card | None) -> gpu_decisions.Card:
    """ComfyUI deciding as on the named card (when the whole suite runs as one card decides, that card only)."""
    chosen = gpu_decisions.CARDS[request.param]
    if decisions_of_the_card is not None:
        if decisions_of_the_card != chosen:
            pytest.skip(f"the suite runs as {os.environ[gpu_decisions.CARD_VARIABLE]} decides")
        return chosen
    gpu_decisions.install(chosen, monkeypatch.setattr)
    return chosen


@pytest.fixture(scope="module")
def bias_lora(models, comfy_models) -> str:
    make_lora(tiny_qwen_image_file(num_layers=4), comfy_models.models_dir / "loras" / BIAS_LORA, seed=5, bias_diffs=True)
    return BIAS_LORA


@pytest.fixture(scope="module")
def gguf_q8(comfy_models) -> str:
    missing = gguf_files.comfyui_gguf_missing()
    if missing is not None:
        pytest.skip(str(missing))
    gguf_files.load_comfyui_gguf(boot_comfyui_in_process())
    path = comfy_models.models_dir / "diffusion_models" / GGUF_Q8
    gguf_files.write_tiny_gguf(path, "qwen_image", gguf_files.converter_policy(gguf_files.gguf.GGMLQuantizationType.Q8_0))
    return GGUF_Q8


def _lora(model, name: str, strength: float = 0.8):
    return run_node("LoraLoaderModelOnly", model=model, lora_name=name, strength_model=strength).outputs[0]


def _latent(model) -> torch.Tensor:
    return run_txt2img(model, seed=11, steps=2).latent


def test_comfyui_decides_as_on_the_card(card, models):
    import comfy.model_management as mm

    cpu = torch.device("cpu")
    assert mm.should_use_fp16(cpu) and mm.should_use_bf16(cpu) == (card.major >= 8)
    if hasattr(mm, "lora_compute_dtype"):
        assert mm.lora_compute_dtype(cpu) == torch.float16, "LoRA computed in fp16, as on any fp16-capable card"
    model = load_plain().model
    computes_in = model.manual_cast_dtype or model.get_dtype()
    if card.major >= 8:
        assert computes_in == torch.bfloat16, "the bf16 file computed in bf16, as the card does, not in float32"
    else:
        assert computes_in != torch.bfloat16, "no bf16 computed where the card has none"


@pytest.mark.parametrize("options", SETTINGS.values(), ids=SETTINGS)
@pytest.mark.parametrize("via", ["node", "loader"])
def test_bit_identical_as_the_card_decides(card, models, fake_cudart, via, options):
    expected = _latent(load_plain())
    model = offload(load_plain(), **options) if via == "node" else load_offloaded(**options)
    assert torch.equal(_latent(model), expected)
    assert torch.equal(_latent(model), expected), "and again, from the same host copies"


@pytest.mark.parametrize("via", ["node", "loader"])
def test_fp8_weights_as_the_card_decides(card, models, fake_cudart, via):
    expected = _latent(load_plain("fp8_e4m3fn"))
    model = offload(load_plain("fp8_e4m3fn")) if via == "node" else load_offloaded("fp8_e4m3fn")
    assert torch.equal(_latent(model), expected)


def test_a_lora_with_bias_diffs_before_and_after_the_node(card, models, bias_lora, fake_cudart):
    expected = _latent(_lora(load_plain(), bias_lora))
    assert not torch.equal(expected, _latent(load_plain())), "the LoRA changes the result"
    assert torch.equal(_latent(offload(_lora(load_plain(), bias_lora))), expected), "before the node"
    assert torch.equal(_latent(_lora(offload(load_plain()), bias_lora)), expected), "after the node"
    assert torch.equal(_latent(_lora(load_offloaded(), bias_lora)), expected), "after the loader"


def test_a_gguf_lora_with_bias_diffs_is_comfyui_ggufs(card, models, bias_lora, gguf_q8, fake_cudart):
    def load():
        with torch.inference_mode():
            return run_node("UnetLoaderGGUF", unet_name=gguf_q8).outputs[0]

    expected = _latent(_lora(load(), bias_lora))
    assert not torch.equal(expected, _latent(load())), "the LoRA changes the result"
    assert torch.equal(_latent(offload(_lora(load(), bias_lora))), expected), "before the node"
    assert torch.equal(_latent(_lora(offload(load()), bias_lora)), expected), "after the node"

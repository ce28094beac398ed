"""LoRA rows: what a LoRA's temporaries cost the overlap, under ComfyUI's allocator and under torch's own."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from ..balloon import Balloon
from ..comfyui import load_comfy_model, start_comfyui
from ..config import BenchConfig, Row
from ..sampling import offload_row
from ..weights import comfy_qwen_shapes


def lora_rows(family: str, config: BenchConfig, out: Path) -> None:
    """A third of the blocks, every one streamed, with and without a LoRA on every attention projection:
    what the LoRA's temporaries cost the overlap under this process's allocator (``lora``: ComfyUI's
    default, cudaMallocAsync on cu130; ``lora-native``: torch's own, as ``--disable-cuda-malloc``)."""
    start_comfyui(config, dynamic=True)
    import comfy.sd

    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "torch's native allocator"
    config = replace(config, blocks=max(1, config.blocks // 3))
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    dtype = f"bf16, {config.blocks} blocks"
    settings, balloon = {"residency": "stream_all", "prefetch": 1}, Balloon(config.device)
    offload_row(Row(family, "this pack", "stream_all p1", dtype, None, note=allocator), plain, settings, config,
                balloon, out)
    with_lora = comfy.sd.load_lora_for_models(plain, None, attention_lora(config), 0.8, 0)[0]
    note = f"{allocator}; LoRA rank {config.lora_rank} on {len(with_lora.patches)} weights"
    offload_row(Row(family, "this pack", "stream_all p1 + LoRA", dtype, None, note=note), with_lora, settings,
                config, balloon, out)


def attention_lora(config: BenchConfig) -> dict[str, torch.Tensor]:
    """A LoRA of ``config.lora_rank`` on every attention projection of the blocks, ComfyUI's generic keys."""
    generator = torch.Generator().manual_seed(3)
    lora = {}
    for name, shape in comfy_qwen_shapes(config).items():
        if name.startswith("transformer_blocks.") and ".attn." in name and name.endswith(".weight") and len(shape) == 2:
            stem = "diffusion_model." + name.removesuffix(".weight")
            lora[f"{stem}.lora_up.weight"] = (torch.randn(shape[0], config.lora_rank, generator=generator) * 0.01).bfloat16()
            lora[f"{stem}.lora_down.weight"] = (torch.randn(config.lora_rank, shape[1], generator=generator) * 0.01).bfloat16()
    return lora

"""ComfyUI as shipped: newest ComfyUI as its main.py starts it (Dynamic VRAM), bf16, all resident and at each cap."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..balloon import Balloon
from ..comfyui import comfy_system, load_comfy_model, start_comfyui
from ..config import BenchConfig, Row, emit
from ..sampling import comfy_rows, sample_row


def shipped_family(config: BenchConfig, out: Path) -> None:
    """Newest ComfyUI as main.py starts it (Dynamic VRAM), bf16: all resident and its own rows."""
    patcher = start_comfyui(config, dynamic=True)
    emit("fact", {"patcher": patcher, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")})
    balloon = Balloon(config.device)
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    emit("fact", {"model_bytes": plain.model_size()})
    system = comfy_system(patcher)
    sample_row(Row("shipped", "all resident", "resident", "bf16", None), plain, config, balloon)
    comfy_rows("shipped", system, plain, config, balloon, "bf16", tuple(sorted(config.caps_bytes)))
